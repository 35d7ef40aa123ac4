"""Packed weights on transparent huge pages (Linux).

A decode step streams every weight from memory once. On 4 KiB pages that is a TLB miss, and a
page walk, every 4 KiB (the kernels' prefetches into a new page wait for it too); on 2 MiB pages
the INT4 kernels of a ~1B layer ran faster at one row on both x86 targets, most on `avx2`, whose
tiles have the fewest bytes in flight (``python -m benchmarks.linear_paths --huge-pages off``
against the default). Where the OS's transparent huge pages are on for regions that ask
(``madvise``, the common default, or ``always``), ``on_huge_pages`` copies a tensor into such a
region; elsewhere, or with ``PAGEDSERVE_HUGE_PAGES=off`` in the environment, it changes nothing.

Only the whole 2 MiB pages inside a tensor ask: its last partial page stays on 4 KiB pages, so
the copy takes no more memory than the tensor.
"""

from __future__ import annotations

import mmap
import os
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20


def huge_pages_wanted() -> bool:
    """Whether this OS lets a region ask for transparent huge pages, and the environment does not
    say ``PAGEDSERVE_HUGE_PAGES=off``."""
    return (
        sys.platform.startswith("linux")
        and hasattr(mmap, "MADV_HUGEPAGE")
        and os.environ.get("PAGEDSERVE_HUGE_PAGES", "on") != "off"
    )


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of CPU tensor ``t`` whose whole 2 MiB pages the kernel is asked to back with huge
    pages; ``t`` itself where that cannot be or is not wanted (not Linux, not on the CPU, under one
    huge page, huge pages off)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE_BYTES or not huge_pages_wanted():
        return t
    # (one huge page more than the tensor, so that its start can be aligned to one: the pages
    # past its end are never touched, so never backed)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError:  # huge pages off in this kernel ("never", or not built in)
        return t
    out = whole[start : start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t.contiguous())
    return out
