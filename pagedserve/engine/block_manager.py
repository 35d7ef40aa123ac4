"""Logical blocks -> physical pages: block tables, automatic prefix caching, copy-on-write, and
the moves to and from the host tier (``host_tier.py``): a preempted sequence swapped out and in,
and prefix blocks the KV tier evicts spilled to host frames and brought back on a hit.

Every page move is queued here and done by the model runner before the step's forward pass, in
this order: swap-outs (KV page -> host frame: a preempted sequence's pages, spilled prefix
blocks), swap-ins (host frame -> KV page: a resumed sequence, a prefix hit in the host tier),
copy-on-write. A KV page is read out before it is written again; a host frame a swap-in reads is
pinned until the next step, so no swap-out of the same step lands on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pagedserve.engine.host_tier import HOST_PAGE_STATES, HostBlock, HostTier
from pagedserve.engine.page_allocator import PhysicalPageAllocator

PAGE_STATES = ("free", "cached", "used", "shared")  # page_map's states, busiest last
PAGE_MAP_CELLS = 4096  # the most cells page_map returns (what a console can draw legibly)


class SequenceLike(Protocol):
    """What the block manager reads from a request (``engine.request.Request`` fits)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    lora_int_id: int  # 0: the base model

    @property
    def num_tokens(self) -> int: ...


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: it depends on every token before the block too."""
    return hash((parent_hash, token_ids))


def root_hash(lora_int_id: int) -> int | None:
    """The parent of a sequence's first block: None for the base model, its adapter's own value
    otherwise, so that the KV a prefix got under one adapter is never reused under another (nor
    under the base model): every hash of the chain, and the parent each hit is checked
    against, differs."""
    return hash(("lora", lora_int_id)) if lora_int_id else None


@dataclass(slots=True)
class CachedBlock:
    """What a cached page holds; checked on every hit so that a hash collision is a miss."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


ComputedBlock = int | HostBlock  # a prefix hit: its KV page, or its frame in the host tier


class BlockManager:
    def __init__(
        self,
        num_pages: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_swap_frames: int = 0,
        num_host_cache_frames: int = 0,
    ) -> None:
        """``num_swap_frames`` and ``num_host_cache_frames``: the host tier's shares, in frames
        of one page each (none: no host tier)."""
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        assert enable_prefix_caching or not num_host_cache_frames, (
            "a host prefix cache needs prefix caching"
        )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = PhysicalPageAllocator(num_pages)
        self.host: HostTier | None = None
        if num_swap_frames or num_host_cache_frames:
            self.host = HostTier(num_swap_frames, num_host_cache_frames)
        self.block_tables: dict[str, list[int]] = {}
        self.cached_block_hash_to_page: dict[int, int] = {}
        self.page_to_cached_block: dict[int, CachedBlock] = {}
        self.block_hashes: dict[str, list[int]] = {}  # per request: chained hashes of full blocks
        self.num_cached_blocks: dict[str, int] = {}  # per request: leading blocks already cached
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src page, dst page)
        self.pending_swap_out: list[tuple[int, int]] = []  # (KV page, host frame)
        self.pending_swap_in: list[tuple[int, int]] = []  # (host frame, KV page)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0  # tokens found in either tier
        self.host_prefix_cache_queries = 0  # tokens looked up in the host tier (missed the KV tier)
        self.host_prefix_cache_hits = 0  # ... and found there
        self.num_swapped_out_pages = 0  # pages copied to the host tier for swapped sequences
        self.num_swapped_in_pages = 0

    # ---- queries

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages no request holds, evictable cached ones included."""
        return self.allocator.num_free_pages

    @property
    def num_cached_free_pages(self) -> int:
        """Free pages that still hold a cached prefix block: a later request with that prefix
        reuses one, a new page evicts it. The others of ``num_free_pages`` hold nothing."""
        refs = self.allocator.ref_counts
        return sum(1 for page in self.page_to_cached_block if refs[page] == 0)

    @property
    def usage(self) -> float:
        return self.allocator.usage

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` could ever fit in the whole pool."""
        return self._num_blocks(num_tokens) <= self.num_pages

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def page_map(self, max_cells: int = PAGE_MAP_CELLS) -> dict:
        """The pool frame by frame, for the web console's page-frame map: ``cells``, one digit
        per page in frame order (an index into ``PAGE_STATES``: free, cached = free but holding a
        prefix block a later request may reuse, used = held by one sequence, shared = held by
        several), and ``counts`` per state. A pool of more than ``max_cells`` pages is drawn
        ``pages_per_cell`` pages a cell, each the busiest state among them, so the answer stays
        small. Vectorized, as it runs on the engine loop: a few ms for 65,536 pages."""
        refs = np.asarray(self.allocator.ref_counts, dtype=np.int64)
        codes = np.minimum(refs, 2).astype(np.int8)
        codes[codes > 0] += 1  # 2 used, 3 shared
        cached = np.fromiter(self.page_to_cached_block, np.int64, len(self.page_to_cached_block))
        codes[cached[codes[cached] == 0]] = 1
        return _cells(codes, PAGE_STATES, max_cells)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src_page, dst_page) copies the model runner must do before the next forward pass."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The swap-outs (KV page, host frame) and swap-ins (host frame, KV page) the model
        runner must do before the next forward pass, before the copies."""
        out, self.pending_swap_out = self.pending_swap_out, []
        into, self.pending_swap_in = self.pending_swap_in, []
        return out, into

    def moves_done(self) -> None:
        """The last step's page moves have run: the host frames they read are free again (the
        engine calls it after each step; ``Scheduler.schedule`` before each, in case)."""
        if self.host is not None:
            self.host.unpin_all()

    def host_page_map(self, max_cells: int = PAGE_MAP_CELLS) -> dict | None:
        """The host tier frame by frame, as ``page_map`` draws the KV tier: a digit per frame, an
        index into ``HOST_PAGE_STATES`` (free, cached = a spilled prefix block, swapped = a page
        of a swapped-out sequence); None without a host tier."""
        if self.host is None:
            return None
        codes = np.asarray(self.host.page_map_codes(), dtype=np.int8)
        return {"total": self.host.num_frames, **_cells(codes, HOST_PAGE_STATES, max_cells)}

    def check_invariants(self) -> list[str]:
        """The pool's consistency, as a soak or a test checks it (empty: all is well).

        Every page's refcount is the number of block tables that hold it (so with no request in
        flight every refcount is zero and the only pages not free-for-use are none: cached
        prefix pages sit in the free queue, evictable); free + used == total; the two prefix-cache
        maps agree; no per-request bookkeeping outlives its block table.
        """
        holders = [0] * self.num_pages
        for table in self.block_tables.values():
            for page in table:
                holders[page] += 1
        problems = self.allocator.check_invariants(holders)
        by_page = {p: b.block_hash for p, b in self.page_to_cached_block.items()}
        if by_page != {p: h for h, p in self.cached_block_hash_to_page.items()}:
            problems.append("the prefix cache's hash -> page and page -> block maps disagree")
        stale = (set(self.block_hashes) | set(self.num_cached_blocks)) - set(self.block_tables)
        if stale:
            problems.append(f"bookkeeping kept for requests that hold no pages: {sorted(stale)}")
        if self.host is not None:
            problems += self.host.check_invariants()
            both = set(self.block_tables) & set(self.host.block_tables)
            if both:
                problems.append(f"sequences with pages in both tiers: {sorted(both)}")
        return problems

    # ---- prefix cache

    def get_computed_blocks(self, req: SequenceLike) -> tuple[list[ComputedBlock], int]:
        """The longest verified prefix of full blocks cached in either tier, and the tokens it
        covers: per block its KV page, or a ``HostBlock`` where only the host tier has it.

        Leaves at least one token to compute. Call at admission, before ``allocate_slots``; a
        lookup counts in the hit rate once the admission succeeds (``record_prefix_lookup``).
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._hash_full_blocks(
            req, list(self.block_hashes.get(req.request_id, ())), max_blocks
        )
        blocks: list[ComputedBlock] = []
        for i in range(max_blocks):
            block = self._cached_block(req, i, hashes)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, req: SequenceLike, blocks: Sequence[ComputedBlock]) -> None:
        """Count an admitted request's lookup in the hit rates (``blocks``: what
        ``get_computed_blocks`` found): its prompt tokens queried, the ones found in either tier,
        and of those that missed the KV tier, the ones the host tier had. Only an admission
        counts, so a request that waits for pages and looks up again is not counted twice (the
        over-count vLLM's issue 43736 reports)."""
        if not self.enable_prefix_caching:
            return
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        if self.host is not None and self.host.caches:
            num_device = sum(isinstance(b, int) for b in blocks) * self.block_size
            self.host_prefix_cache_queries += req.num_tokens - num_device
            self.host_prefix_cache_hits += num_hit_tokens - num_device

    def uncache_page(self, page: int) -> None:
        """Forget the block a page caches (its contents are no longer trusted)."""
        block = self.page_to_cached_block.pop(page, None)
        if block is not None:
            del self.cached_block_hash_to_page[block.block_hash]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, in both tiers; pages in use stay with their requests."""
        self.cached_block_hash_to_page.clear()
        self.page_to_cached_block.clear()
        if self.host is not None:
            self.host.reset_cache()

    # ---- allocation

    def allocate_slots(
        self,
        req: SequenceLike,
        num_new_tokens: int,
        new_computed_blocks: Sequence[ComputedBlock] = (),
    ) -> bool:
        """Grow the block table to cover the computed, prefix-hit and ``num_new_tokens`` tokens;
        a prefix hit in the host tier gets a fresh page, and its copy back is queued.

        All or nothing: returns False and changes nothing when the free pages do not suffice.
        """
        table = self.block_tables.get(req.request_id, [])
        if table and not new_computed_blocks:
            num_tokens = req.num_computed_tokens + num_new_tokens
            if self._fits_in_own_pages(table, req.num_computed_tokens, num_tokens):
                if self.enable_prefix_caching:
                    self._cache_full_blocks(req, table, num_tokens)
                return True
        assert not new_computed_blocks or not table, (
            f"request {req.request_id}: prefix-hit blocks are only taken at admission"
        )
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens = num_computed + num_new_tokens
        cow_blocks = self._blocks_to_copy_on_write(table, num_computed, num_tokens)
        num_fresh = max(0, self._num_blocks(num_tokens) - len(table) - len(new_computed_blocks))
        num_revived = sum(
            isinstance(b, HostBlock) or self.allocator.refcount(b) == 0 for b in new_computed_blocks
        )
        if num_revived + len(cow_blocks) + num_fresh > self.allocator.num_free_pages:
            return False
        self.block_tables[req.request_id] = table
        self._take_computed_blocks(table, new_computed_blocks)
        for i in cow_blocks:
            self._copy_on_write(table, i, copy=i * self.block_size < num_computed)
        table.extend(self._allocate_page() for _ in range(num_fresh))
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, table, num_tokens)
        return True

    def trim(self, req: SequenceLike) -> int:
        """Return the pages past the request's known tokens: those its rejected drafts were
        written to (a speculative step allocated them). No such page holds a cached block, as
        only blocks full of known tokens are cached. How many pages were returned."""
        table = self.block_tables[req.request_id]
        keep = self._num_blocks(req.num_tokens)
        extra = table[keep:]
        if not extra:
            return 0
        del table[keep:]
        for page in reversed(extra):
            self.allocator.free(page)
        return len(extra)

    def free(self, req: SequenceLike) -> None:
        """Release the request's pages, tail first so that tail blocks are evicted before the prefix."""
        assert req.request_id in self.block_tables, (
            f"request {req.request_id} holds no pages (freed twice?)"
        )
        table = self.block_tables.pop(req.request_id)
        for page in reversed(table):
            self.allocator.free(page)
        self.block_hashes.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
        refs = self.allocator.ref_counts
        self.pending_copies = [(s, d) for s, d in self.pending_copies if refs[d]]
        self.pending_swap_in = [(f, p) for f, p in self.pending_swap_in if refs[p]]

    # ---- the host tier: swap

    def is_swapped(self, req: SequenceLike) -> bool:
        """Whether the request's pages are in the host tier (it is preempted, not recomputing)."""
        return self.host is not None and self.host.is_swapped(req.request_id)

    def can_swap_out(self, req: SequenceLike) -> bool:
        """Whether the host tier's swap share has room for the request's computed pages."""
        num_pages = self._num_blocks(req.num_computed_tokens)
        return self.host is not None and num_pages > 0 and self.host.can_hold(num_pages)

    def num_pages_to_swap(self, req: SequenceLike) -> int:
        """The pages a swap-out of the request copies (those that hold computed tokens)."""
        return self._num_blocks(req.num_computed_tokens)

    def swap_out(self, req: SequenceLike) -> None:
        """Copy the request's computed pages to host frames and release its KV pages (check
        ``can_swap_out`` first); its ``num_computed_tokens`` stays as it is."""
        assert self.can_swap_out(req), f"request {req.request_id}: no room to swap it out"
        table = self.block_tables[req.request_id]
        frames = self.host.hold(req.request_id, self.num_pages_to_swap(req))
        for page, frame in zip(table, frames):
            self._queue_swap_out(page, frame)
        self.num_swapped_out_pages += len(frames)
        self.free(req)

    def swap_in(self, req: SequenceLike, num_new_tokens: int) -> bool:
        """Fresh KV pages for a swapped-out request's pages, and for ``num_new_tokens`` beyond
        them; their copies back are queued. All or nothing, as ``allocate_slots``."""
        frames = self.host.block_tables[req.request_id]
        num_tokens = req.num_computed_tokens + num_new_tokens
        num_pages = max(len(frames), self._num_blocks(num_tokens))
        if num_pages > self.allocator.num_free_pages:
            return False
        table = [self._allocate_page() for _ in range(num_pages)]
        self.host.release(req.request_id, pin=True)
        self.pending_swap_in += zip(frames, table)
        self.num_swapped_in_pages += len(frames)
        self.block_tables[req.request_id] = table
        if self.enable_prefix_caching:
            self._cache_full_blocks(req, table, num_tokens)
        return True

    def free_swapped(self, req: SequenceLike) -> None:
        """Drop a swapped-out request's host frames (it finished, or it recomputes instead)."""
        self.host.release(req.request_id)

    def drop_host_frames(self, frames: Sequence[int]) -> list[str]:
        """Host frames whose contents are no longer trusted (a fault): the blocks they cache are
        forgotten. The swapped-out requests that hold any of them (they must recompute)."""
        if self.host is None:
            return []
        bad = set(frames)
        for frame in bad:
            self.host.uncache(frame)
        return [rid for rid, held in self.host.block_tables.items() if bad & set(held)]

    def fork(self, parent: SequenceLike, child: SequenceLike) -> None:
        """The child (n > 1 sampling) shares every page of the parent until it writes (copy-on-write)."""
        assert child.request_id not in self.block_tables, (
            f"request {child.request_id} already has pages"
        )
        table = self.block_tables[parent.request_id]
        for page in table:
            self.allocator.incref(page)
        self.block_tables[child.request_id] = list(table)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    # ---- helpers

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _fits_in_own_pages(self, table: list[int], num_computed: int, num_tokens: int) -> bool:
        """The new tokens land in pages the table already holds alone: nothing to allocate or
        copy (a decode step's usual case, checked without building lists)."""
        if num_tokens > len(table) * self.block_size or num_tokens <= num_computed:
            return False
        ref_counts = self.allocator.ref_counts
        first, last = num_computed // self.block_size, (num_tokens - 1) // self.block_size
        return all(ref_counts[table[i]] == 1 for i in range(first, last + 1))

    def _allocate_page(self) -> int:
        """A fresh page; if it held an evictable cached block, that block leaves the cache (for
        the host tier's, if there is one)."""
        page = self.allocator.allocate()
        block = self.page_to_cached_block.pop(page, None)
        if block is not None:
            del self.cached_block_hash_to_page[block.block_hash]
            if self.host is not None and self.host.caches:
                frame = self.host.spill(block)
                if frame is not None:
                    self._queue_swap_out(page, frame)
        return page

    def _queue_swap_out(self, page: int, frame: int) -> None:
        """A copy of ``page`` into ``frame``; an earlier copy into the same frame this step (its
        block since evicted) is dropped."""
        self.pending_swap_out = [(p, f) for p, f in self.pending_swap_out if f != frame]
        self.pending_swap_out.append((page, frame))

    def _take_computed_blocks(self, table: list[int], blocks: Sequence[ComputedBlock]) -> None:
        """Take the prefix hits in order: a KV page is shared; a host-tier block gets a fresh
        page and a copy back. Every KV page is taken, and every host frame pinned, before any
        fresh page is allocated, since an allocation may evict either."""
        for block in blocks:
            if isinstance(block, HostBlock):
                assert self.host.frame_to_cached_block.get(block.frame) is not None, (
                    f"prefix-hit host frame {block.frame} was evicted"
                )
                self.host.pin(block.frame)
            else:
                assert block in self.page_to_cached_block, f"prefix-hit page {block} was evicted"
                self.allocator.incref(block)
        for block in blocks:
            if isinstance(block, HostBlock):
                page = self._allocate_page()
                self.pending_swap_in.append((block.frame, page))
                self.host.touch(block.frame)
                table.append(page)
            else:
                table.append(block)

    def _blocks_to_copy_on_write(
        self, table: list[int], num_computed: int, num_tokens: int
    ) -> list[int]:
        """Indices of shared pages this step writes into."""
        if num_tokens <= num_computed:
            return []
        first, end = num_computed // self.block_size, min(len(table), self._num_blocks(num_tokens))
        return [i for i in range(first, end) if self.allocator.refcount(table[i]) > 1]

    def _copy_on_write(self, table: list[int], i: int, copy: bool) -> None:
        src, dst = table[i], self._allocate_page()
        self.allocator.free(src)
        table[i] = dst
        if copy:
            self.pending_copies.append((src, dst))

    def _hash_full_blocks(self, req: SequenceLike, hashes: list[int], num_blocks: int) -> list[int]:
        """Extend ``hashes`` in place to the first ``num_blocks`` full blocks of the request."""
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else root_hash(req.lora_int_id)
            hashes.append(
                hash_block_tokens(parent, tuple(req.all_token_ids[i * bs : (i + 1) * bs]))
            )
        return hashes

    def _block_key(self, req: SequenceLike, i: int, hashes: list[int]) -> CachedBlock:
        tokens = tuple(req.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
        return CachedBlock(hashes[i], hashes[i - 1] if i else root_hash(req.lora_int_id), tokens)

    def _cached_block(self, req: SequenceLike, i: int, hashes: list[int]) -> ComputedBlock | None:
        """Block ``i`` of the request in the KV tier's cache, else in the host tier's."""
        key = self._block_key(req, i, hashes)
        page = self.cached_block_hash_to_page.get(key.block_hash)
        if page is not None and self.page_to_cached_block[page] == key:
            return page
        if self.host is not None and self.host.caches:
            frame = self.host.cached_frame(key)
            if frame is not None:
                return HostBlock(frame)
        return None

    def _cache_full_blocks(self, req: SequenceLike, table: list[int], num_tokens: int) -> None:
        """Register every block that is full of known tokens; an already cached hash is kept."""
        num_full = min(num_tokens, req.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hash_full_blocks(
            req, self.block_hashes.setdefault(req.request_id, []), num_full
        )
        for i in range(start, num_full):
            key = self._block_key(req, i, hashes)
            if (
                key.block_hash in self.cached_block_hash_to_page
                or table[i] in self.page_to_cached_block
            ):
                continue
            self.cached_block_hash_to_page[key.block_hash] = table[i]
            self.page_to_cached_block[table[i]] = key
        self.num_cached_blocks[req.request_id] = num_full


def _cells(codes: np.ndarray, states: tuple[str, ...], max_cells: int) -> dict:
    """A pool's state codes as at most ``max_cells`` digits (each the busiest of its pages) and
    the count of pages in each state."""
    per_cell = -(-len(codes) // max_cells)
    cells = np.zeros(-(-len(codes) // per_cell) * per_cell, dtype=np.int8)
    cells[: len(codes)] = codes
    cells = cells.reshape(-1, per_cell).max(axis=1)
    return {
        "pages_per_cell": per_cell,
        "cells": (cells + ord("0")).astype(np.uint8).tobytes().decode("ascii"),
        "counts": dict(zip(states, np.bincount(codes, minlength=len(states)).tolist())),
    }
