"""NVIDIA GPUs through PyTorch: reference kernels on CUDA tensors (not exercised by CI)."""

from __future__ import annotations

import torch

from pagedserve.hal.device import Device, DevicePreset


class CudaDevice(Device):
    backend = "cuda"
    distributed_backend = "nccl"

    def __init__(self, preset: DevicePreset, kernels: str = "auto"):
        if not torch.cuda.is_available():
            raise ValueError(
                "--device cuda needs a GPU that torch can see; use --device kunlun-emu or cpu"
            )
        super().__init__(preset, "cuda")

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def join_group(self, rank: int, world_size: int) -> None:
        """Rank ``rank`` drives the GPU of its index on its node (NCCL wants one GPU per rank)."""
        super().join_group(rank, world_size)
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        self.torch_device = torch.device("cuda", index)
