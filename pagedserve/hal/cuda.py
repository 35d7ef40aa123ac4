"""NVIDIA GPUs through PyTorch: reference kernels on CUDA tensors (not exercised by CI).

Pages move to and from the host tier (pinned host memory) on a copy stream of their own: the
host thread enqueues them and goes on to enqueue the step's forward pass, which waits for them on
the GPU, not on the host. Pages going out are first gathered into one staging tensor on the GPU;
the forward pass (which may write those pages again) waits for that gather only, and the copies to
the host run beside it. Pages coming in are read by the forward pass: it waits for them whole.
"""

from __future__ import annotations

import torch

from pagedserve.hal.device import Device, DevicePreset
from pagedserve.hal.memory import MemoryAttr


class CudaDevice(Device):
    backend = "cuda"
    distributed_backend = "nccl"

    def __init__(self, preset: DevicePreset, kernels: str = "auto"):
        if not torch.cuda.is_available():
            raise ValueError(
                "--device cuda needs a GPU that torch can see; use --device kunlun-emu or cpu"
            )
        super().__init__(preset, "cuda")
        self._copy_stream: torch.cuda.Stream | None = None

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    # ---- the host tier ------------------------------------------------------------------------
    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> torch.Tensor:
        """Pinned: copies to and from it run asynchronously."""
        return self._zeros_in("host", tag, MemoryAttr.CACHED, shape, dtype, pin_memory=True)

    def _copies(self) -> torch.cuda.Stream:
        """The copy stream, after everything the compute stream has enqueued so far."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.torch_device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.torch_device))
        return self._copy_stream

    def swap_out(self, moves: list[tuple[int, int]]) -> None:
        if not moves:
            return
        stream = self._copies()
        with torch.cuda.stream(stream):
            src = torch.tensor([p for p, _ in moves], device=self.torch_device)
            staged = self.kv_cache[:, :, src].movedim(2, 0).contiguous()
            gathered = stream.record_event()
            for i, (_, frame) in enumerate(moves):  # one contiguous frame each
                self.host_kv_cache[frame].copy_(staged[i], non_blocking=True)
        # ``staged`` belongs to the copy stream's pool: nothing reuses it before these copies end
        torch.cuda.current_stream(self.torch_device).wait_event(gathered)

    def swap_in(self, moves: list[tuple[int, int]]) -> None:
        if not moves:
            return
        stream = self._copies()
        with torch.cuda.stream(stream):
            staged = torch.empty(
                (len(moves), *self.host_kv_cache.shape[1:]),
                dtype=self.host_kv_cache.dtype,
                device=self.torch_device,
            )
            for i, (frame, _) in enumerate(moves):
                staged[i].copy_(self.host_kv_cache[frame], non_blocking=True)
            dst = torch.tensor([p for _, p in moves], device=self.torch_device)
            self.kv_cache[:, :, dst] = staged.movedim(0, 2)
        torch.cuda.current_stream(self.torch_device).wait_stream(stream)

    def join_group(self, rank: int, world_size: int) -> None:
        """Rank ``rank`` drives the GPU of its index on its node (NCCL wants one GPU per rank)."""
        super().join_group(rank, world_size)
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        self.torch_device = torch.device("cuda", index)
