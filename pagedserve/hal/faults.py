"""Device faults: what a device counts, and the weight tier's checksums and patrol scrub.

The Kunlun XPU deployment guide's firmware recovery is the model: the memory controller's ECC
reports a corrupted KV page on read; a patrol scrub walks the weight tier between steps, a few
pages at a time, comparing each page with the checksum it had when the weights were loaded, and
a page that differs is restored from the checkpoint. Which requests to recompute is the
engine's business; the device finds, counts and repairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FAULT_KINDS = ("kv_page", "weight_page", "step")
WEIGHT_PAGE_BYTES = 64 * 2**10


class DeviceKernelError(RuntimeError):
    """A kernel failed on the device (on ``kunlun-emu``: an injected one)."""


class UnrecoverableFaultError(RuntimeError):
    """A fault the device cannot repair (a weight page whose checkpoint is gone or changed):
    serving on would give wrong answers, so the engine stops and its supervisor restarts it."""


@dataclass
class FaultCounts:
    """Per fault kind: injected on purpose, detected, and recovered (the engine went on with
    nothing lost: a KV page recomputed, a weight page restored, a failed step's requests ended
    with an error and the next served)."""

    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    detected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    recovered: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {
            kind: {
                "injected": self.injected[kind],
                "detected": self.detected[kind],
                "recovered": self.recovered[kind],
            }
            for kind in FAULT_KINDS
        }


@dataclass(frozen=True, slots=True)
class WeightPage:
    tag: str  # the device tensor's tag (as the weight tier's allocations name it)
    index: int  # page number within that tensor


def page_bytes(t: torch.Tensor, index: int, size: int = WEIGHT_PAGE_BYTES) -> torch.Tensor:
    """Page ``index`` of a contiguous tensor, as a uint8 view of its bytes (writable)."""
    return t.view(-1).view(torch.uint8)[index * size : (index + 1) * size]


def checksum(page: torch.Tensor) -> int:
    """Sum of the page's 64-bit words, wrapping: one flipped bit changes it by 2**k (k < 64),
    never by a multiple of 2**64, so every single-bit upset is seen; one pass at memory speed,
    on any torch device."""
    return _sum(_words(page))


def _words(page: torch.Tensor) -> torch.Tensor:
    """The page as 64-bit words (an unaligned tail stays bytes)."""
    if page.numel() % 8 == 0 and page.storage_offset() % 8 == 0:
        return page.view(torch.int64)
    return page


def _sum(words: torch.Tensor) -> int:
    return int(words.sum())  # torch sums an integer tensor (bytes too) in int64, wrapping


class WeightScrubber:
    """Checksums of every weight page, taken once the weights are placed, and a patrol cursor
    that verifies the next few pages each time it is asked (each page's word view is made once:
    a patrol step is one sum per page)."""

    def __init__(self, tensors: dict[str, torch.Tensor], size: int = WEIGHT_PAGE_BYTES):
        self.tensors = tensors
        self.size = size
        self.pages = [
            WeightPage(tag, i)
            for tag, t in tensors.items()
            for i in range(-(-t.numel() * t.element_size() // size))
        ]
        self.words = [_words(self.page(p)) for p in self.pages]
        self.checksums = [_sum(w) for w in self.words]
        self.cursor = 0
        self.num_pages_scrubbed = 0

    def page(self, p: WeightPage) -> torch.Tensor:
        return page_bytes(self.tensors[p.tag], p.index, self.size)

    def scrub(self, num_pages: int) -> list[WeightPage]:
        """Verify the next ``num_pages`` pages of the patrol (wrapping); the corrupted ones."""
        num_pages = min(num_pages, len(self.pages))
        bad = []
        for _ in range(num_pages):
            i, self.cursor = self.cursor, (self.cursor + 1) % len(self.pages)
            if _sum(self.words[i]) != self.checksums[i]:
                bad.append(self.pages[i])
        self.num_pages_scrubbed += num_pages
        return bad

    def verified(self, p: WeightPage) -> bool:
        """Whether page ``p`` holds what it held when the checksums were taken."""
        i = self.pages.index(p)
        return _sum(self.words[i]) == self.checksums[i]

    def restore(self, p: WeightPage, source: torch.Tensor) -> bool:
        """Copy the page's bytes from ``source`` (the same tensor rebuilt); True when the page
        then matches its checksum again."""
        self.page(p).copy_(page_bytes(source.to(self.tensors[p.tag].device), p.index, self.size))
        return self.verified(p)
