"""A CPU emulation of a Kunlun XPU: separate memory tiers with hard capacities, page frames by number,
cached/uncached memory attributes, an INT4 unit (PyTorch's CPU int4 kernel) and page-fault detection.

The kernels are the CPU backend's; what the emulation adds is the device's bookkeeping, so code that
runs here respects the limits it would meet on the real card.
"""

from __future__ import annotations

import torch

from pagedserve.hal.cpu import CpuDevice
from pagedserve.hal.device import DevicePreset


class KunlunEmuDevice(CpuDevice):
    backend = "kunlun-emu"

    def __init__(self, preset: DevicePreset, enforce_eager: bool = False):
        super().__init__(preset, enforce_eager)
        self._faulted_pages: set[int] = set()

    def inject_fault(self, page: int, layer: int = 0) -> None:
        """Flip the top exponent bit of the first K element of ``page`` in ``layer``, as an HBM
        upset would: the value is wrecked, so an undetected fault shows in the output.

        The emulated memory controller's ECC detects it, as the real card's does: the page is
        reported by ``take_faulted_pages``.
        """
        assert self.kv_cache is not None, "inject_fault before the KV cache was allocated"
        element = self.kv_cache[layer, 0, page].view(-1)[:1]
        int_view, bit = {2: (torch.int16, 14), 4: (torch.int32, 30)}[element.element_size()]
        element.view(int_view).bitwise_xor_(1 << bit)
        self._faulted_pages.add(page)

    def take_faulted_pages(self) -> list[int]:
        pages, self._faulted_pages = sorted(self._faulted_pages), set()
        self.num_faults_detected += len(pages)
        return pages
