"""A CPU emulation of a Kunlun XPU: separate memory tiers with hard capacities, page frames by number,
cached/uncached memory attributes, an INT4 unit (PyTorch's CPU int4 kernel) and injectable faults.

The kernels are the CPU backend's; what the emulation adds is the device's bookkeeping, so code that
runs here respects the limits it would meet on the real card, and the faults the Kunlun XPU
deployment guide's firmware recovers from can be provoked on purpose: a flipped bit in a KV page
(the memory controller's ECC reports it), a flipped bit in a weight page (the patrol scrub finds
it) and a kernel that fails mid-step.
"""

from __future__ import annotations

import random

import torch

from pagedserve.hal.cpu import CpuDevice
from pagedserve.hal.device import DevicePreset
from pagedserve.hal.faults import WEIGHT_PAGE_BYTES, DeviceKernelError, WeightPage, page_bytes


class KunlunEmuDevice(CpuDevice):
    backend = "kunlun-emu"

    def __init__(self, preset: DevicePreset, kernels: str = "auto"):
        super().__init__(preset, kernels)
        # The memory controller's ECC check bits, kept (to emulate them cheaply) only for the
        # words an injection upset: (pool, frame, layer) -> the word as it was written.
        self._check_bits: dict[tuple[str, int, int], torch.Tensor] = {}
        self._kernel_fault_armed = False

    def inject_fault(self, page: int, layer: int = 0) -> None:
        """Flip the top exponent bit of the first K element of ``page`` in ``layer``, as an HBM
        upset would: the value is wrecked, so an undetected fault shows in the output.

        The emulated memory controller's ECC detects it, as the real card's does: the page is
        reported by ``take_faulted_pages``.
        """
        assert self.kv_cache is not None, "inject_fault before the KV cache was allocated"
        self._upset("kv", page, layer)
        self.faults.injected["kv_page"] += 1

    def take_faulted_pages(self) -> list[int]:
        """The KV pages whose words fail their ECC check (each reported once)."""
        return self._ecc_check("kv")

    def inject_host_fault(self, frame: int, layer: int = 0) -> None:
        """The same upset in host-tier KV frame ``frame`` (a swapped-out or spilled page): the
        host memory's ECC reports it (``take_faulted_host_frames``). Counted as a KV page fault:
        it is one, wherever the page lives, and it is recovered the same way (a recompute)."""
        assert self.host_kv_cache is not None, "inject_host_fault without a host tier KV pool"
        self._upset("host", frame, layer)
        self.faults.injected["kv_page"] += 1

    def take_faulted_host_frames(self) -> list[int]:
        return self._ecc_check("host")

    def _word(self, pool: str, frame: int, layer: int) -> torch.Tensor:
        """The first K element of a KV frame (INT8: its first 4 codes), as a view."""
        cache = (
            self.kv_cache[layer, 0, frame] if pool == "kv" else self.host_kv_cache[frame, layer, 0]
        )
        first = cache.view(-1)
        return first[:4] if first.dtype == torch.int8 else first[:1]

    def _upset(self, pool: str, frame: int, layer: int) -> None:
        word = self._word(pool, frame, layer)
        self._check_bits.setdefault((pool, frame, layer), word.clone())
        _flip_top_bit(word)

    def _ecc_check(self, pool: str) -> list[int]:
        """Read each watched word of ``pool`` against its check bits: the frames where they
        differ, counted as detected. (Engines check before every step; nothing writes KV between
        an injection and that check, so the check bits are still the word as written.)"""
        bad = set()
        for key in [k for k in self._check_bits if k[0] == pool]:
            if not torch.equal(self._word(*key), self._check_bits.pop(key)):
                bad.add(key[1])
        self.faults.detected["kv_page"] += len(bad)
        return sorted(bad)

    def inject_weight_fault(self, tag: str | None = None, index: int | None = None) -> WeightPage:
        """Flip bit 30 of the first 32-bit word of a weight page (a random one unless named): a
        16-bit weight's top exponent bit, or a high bit of packed int4 codes. Nothing reports
        it: only the patrol scrub's checksums find it."""
        assert self.weight_tensors, "inject_weight_fault before the weights were placed"
        rng = random.Random()
        tag = tag if tag is not None else rng.choice(sorted(self.weight_tensors))
        if tag not in self.weight_tensors:
            raise ValueError(f"no weight tensor {tag!r} on {self.name}")
        t = self.weight_tensors[tag]
        num_pages = -(-t.numel() * t.element_size() // WEIGHT_PAGE_BYTES)
        index = rng.randrange(num_pages) if index is None else index
        if not 0 <= index < num_pages:
            raise ValueError(f"{tag} has weight pages 0..{num_pages - 1}, not {index}")
        _flip_top_bit(page_bytes(t, index)[:4])
        self.faults.injected["weight_page"] += 1
        return WeightPage(tag, index)

    def inject_kernel_fault(self) -> None:
        """The next forward pass fails in its first kernel, as an XPU exception would."""
        self._kernel_fault_armed = True
        self.faults.injected["step"] += 1

    def rotary_at(self, cos_sin: torch.Tensor, positions: torch.Tensor) -> object:
        """The first kernel of every forward pass: where an armed kernel fault goes off."""
        if self._kernel_fault_armed:
            self._kernel_fault_armed = False
            raise DeviceKernelError("kunlun-emu: injected kernel fault (an XPU exception mid-step)")
        return super().rotary_at(cos_sin, positions)


def _flip_top_bit(element: torch.Tensor) -> None:
    """Flip the top exponent bit of a 16- or 32-bit element (or of a 4-byte word)."""
    nbytes = element.numel() * element.element_size()
    int_view, bit = {2: (torch.int16, 14), 4: (torch.int32, 30)}[nbytes]
    element.view(int_view).bitwise_xor_(1 << bit)
