"""Page frame numbers of the KV pool: reference counts and an LRU free queue (vLLM v1 BlockPool)."""

from __future__ import annotations

from collections import OrderedDict


class PhysicalPageAllocator:
    """Hands out page frames ``0..num_pages-1``, least-recently-freed first.

    The free queue is an ``OrderedDict`` used as a doubly-linked list: ``allocate`` pops its head,
    ``free`` appends to its tail, and ``incref`` of a free page (a cached prefix block being reused)
    takes it out of the middle, all in O(1). The allocator knows nothing about hashes: the caller
    that caches page contents drops a page's hash when ``allocate`` hands that page out again.
    """

    def __init__(self, num_pages: int) -> None:
        assert num_pages > 0, f"num_pages must be positive, got {num_pages}"
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))

    def allocate(self) -> int:
        """Take the least recently freed page; its refcount becomes 1."""
        assert self.free_queue, "no free KV pages; check num_free_pages before allocate()"
        page, _ = self.free_queue.popitem(last=False)
        assert self.ref_counts[page] == 0, f"page {page} in the free queue has refcount > 0"
        self.ref_counts[page] = 1
        return page

    def free(self, page: int) -> None:
        """Drop one reference; at zero the page joins the tail of the free queue."""
        self._check(page)
        assert self.ref_counts[page] > 0, f"double free of page {page}: it is not allocated"
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_queue[page] = None

    def incref(self, page: int) -> None:
        """Add a reference; a free page (e.g. an evictable cached block) is revived in O(1)."""
        self._check(page)
        if self.ref_counts[page] == 0:
            del self.free_queue[page]
        self.ref_counts[page] += 1

    def refcount(self, page: int) -> int:
        self._check(page)
        return self.ref_counts[page]

    @property
    def num_free_pages(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_pages

    def check_invariants(self, holders: list[int]) -> list[str]:
        """What is wrong with the pool, given how many block tables hold each page (empty: all
        is well): free + used == total, every refcount equals its holders, the free queue is
        exactly the pages nobody holds."""
        problems = []
        if self.num_free_pages + self.num_used_pages != self.num_pages:
            problems.append(
                f"free {self.num_free_pages} + used {self.num_used_pages} != total {self.num_pages}"
            )
        for page, (count, held) in enumerate(zip(self.ref_counts, holders)):
            if count != held:
                problems.append(f"page {page} has refcount {count} but {held} holders")
        unheld = {p for p, held in enumerate(holders) if held == 0}
        if set(self.free_queue) != unheld:
            problems.append(
                f"free queue differs from the unheld pages on {sorted(set(self.free_queue) ^ unheld)}"
            )
        return problems

    def _check(self, page: int) -> None:
        assert 0 <= page < self.num_pages, (
            f"page {page} is outside the pool 0..{self.num_pages - 1}"
        )
