"""A CPU emulation of a Kunlun XPU: separate memory tiers with hard capacities, page frames by number,
cached/uncached memory attributes, an INT4 unit (PyTorch's CPU int4 kernel) and page-fault detection.

The kernels are the CPU backend's; what the emulation adds is the device's bookkeeping, so code that
runs here respects the limits it would meet on the real card.
"""

from __future__ import annotations

from pagedserve.hal.cpu import CpuDevice


class KunlunEmuDevice(CpuDevice):
    backend = "kunlun-emu"
