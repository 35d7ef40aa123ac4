"""Packed INT4 weights on transparent huge pages (hal/huge_pages.py): the same values, no more
memory, and, where the OS grants huge pages to regions that ask, backed by them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pagedserve.hal import get_device
from pagedserve.hal.huge_pages import HUGE_PAGE_BYTES, huge_pages_wanted, on_huge_pages
from pagedserve.models.quant_formats import quantize_rtn

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The OS's transparent huge page mode (always, madvise, never), "" where it has none."""
    if not THP_SETTING.exists():
        return ""
    return re.search(r"\[(\w+)\]", THP_SETTING.read_text()).group(1)


needs_thp = pytest.mark.skipif(
    not huge_pages_wanted() or thp_mode() not in ("always", "madvise"),
    reason="this OS grants no transparent huge pages to regions that ask",
)


def huge_page_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            mapping = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def test_a_copy_with_the_same_values_shape_and_dtype():
    t = torch.randint(0, 255, (3 * HUGE_PAGE_BYTES // 4 + 5, 4), dtype=torch.uint8)
    out = on_huge_pages(t)
    assert torch.equal(out, t) and out.dtype == t.dtype and out.shape == t.shape
    if huge_pages_wanted():
        assert out.data_ptr() != t.data_ptr()
        assert out.data_ptr() % HUGE_PAGE_BYTES == 0  # the whole pages start where it starts
        t.zero_()  # a copy: the original is free to go
        assert out.any()


def test_a_copy_of_another_dtype_keeps_its_values():
    t = torch.randn(HUGE_PAGE_BYTES // 2 + 3, 2).to(torch.bfloat16)
    out = on_huge_pages(t)
    assert torch.equal(out, t) and out.is_contiguous()


def test_small_tensors_and_huge_pages_off_change_nothing(monkeypatch):
    small = torch.zeros(HUGE_PAGE_BYTES // 2, dtype=torch.uint8)
    assert on_huge_pages(small) is small
    monkeypatch.setenv("PAGEDSERVE_HUGE_PAGES", "off")
    big = torch.zeros(2 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    assert not huge_pages_wanted() and on_huge_pages(big) is big


@needs_thp
def test_the_whole_pages_are_backed_by_huge_pages():
    t = torch.ones(3 * HUGE_PAGE_BYTES + 12345, dtype=torch.uint8)
    out = on_huge_pages(t)
    # the three whole pages may ask; the tail does not (no more memory than the tensor)
    assert HUGE_PAGE_BYTES <= huge_page_bytes_at(out.data_ptr()) <= 3 * HUGE_PAGE_BYTES


@needs_thp
def test_an_int4_layer_keeps_its_codes_on_huge_pages_with_the_same_results(monkeypatch):
    dev = get_device("cpu")
    q, s, z = quantize_rtn(torch.randn(2048, 4096) * 0.02, 32)  # 4 MiB of codes
    w = dev.prepare_int4(q, s, z, 32, "on huge pages")
    assert huge_page_bytes_at(w.packed.data_ptr()) >= HUGE_PAGE_BYTES
    monkeypatch.setenv("PAGEDSERVE_HUGE_PAGES", "off")
    w4k = dev.prepare_int4(q, s, z, 32, "on 4 KiB pages")
    assert huge_page_bytes_at(w4k.packed.data_ptr()) == 0 or thp_mode() == "always"
    assert torch.equal(w.packed, w4k.packed) and w.nbytes == w4k.nbytes
    x = torch.randn(3, 4096).to(torch.bfloat16)
    assert torch.equal(dev.linear(x, w), dev.linear(x, w4k))
