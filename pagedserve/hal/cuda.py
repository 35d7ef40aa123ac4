"""NVIDIA GPUs through PyTorch: reference kernels on CUDA tensors (not exercised by CI)."""

from __future__ import annotations

import torch

from pagedserve.hal.device import Device, DevicePreset


class CudaDevice(Device):
    backend = "cuda"

    def __init__(self, preset: DevicePreset, enforce_eager: bool = False):
        if not torch.cuda.is_available():
            raise ValueError(
                "--device cuda needs a GPU that torch can see; use --device kunlun-emu or cpu"
            )
        super().__init__(preset, "cuda")

    def synchronize(self) -> None:
        torch.cuda.synchronize()
