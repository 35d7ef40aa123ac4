"""The host tier's KV page frames, as the block manager sees them: the pages of swapped-out
sequences (vLLM v0's swap space) and a prefix cache that the KV tier's evicted blocks spill into
(SGLang's HiCache, vLLM's KV offloading).

One pool of frames, ``swap_share + cache_share`` of them, in one LRU free queue
(``PhysicalPageAllocator``): a frame held by a swapped sequence is out of the queue; a frame that
caches a prefix block sits in the queue, evictable, as a cached page of the KV tier does. Swapped
sequences may hold at most ``swap_share`` frames, so the prefix cache always keeps its share;
cached blocks may fill every frame that swapped sequences leave free.

A frame that one step's copies read (a swap-in, a prefix hit brought back) is pinned until the
next step starts, so that no copy written in the same step lands on it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pagedserve.engine.page_allocator import PhysicalPageAllocator

HOST_PAGE_STATES = ("free", "cached", "swapped")  # host_page_map's states


@dataclass(frozen=True, slots=True)
class HostBlock:
    """A prefix block found only in the host tier: ``allocate_slots`` brings it back to a fresh
    KV page by copy."""

    frame: int


class BlockKey(Protocol):
    """What a cached block is known by (the block manager's ``CachedBlock`` fits): its chained
    hash, and equality that checks its token ids."""

    block_hash: int


class HostTier:
    def __init__(self, swap_share: int, cache_share: int) -> None:
        assert swap_share >= 0 and cache_share >= 0 and swap_share + cache_share > 0, (
            f"a host tier needs frames: swap {swap_share}, cache {cache_share}"
        )
        self.swap_share = swap_share
        self.cache_share = cache_share
        self.allocator = PhysicalPageAllocator(swap_share + cache_share)
        self.block_tables: dict[str, list[int]] = {}  # swapped sequences: their pages' frames
        self.num_swapped_frames = 0
        self.cached_block_hash_to_frame: dict[int, int] = {}
        self.frame_to_cached_block: dict[int, BlockKey] = {}
        self.pinned: list[int] = []  # read by this step's copies; released when the next starts

    @property
    def num_frames(self) -> int:
        return self.allocator.num_pages

    @property
    def caches(self) -> bool:
        return self.cache_share > 0

    @property
    def usage(self) -> float:
        """Frames held (by swapped sequences, or pinned), of all frames; cached blocks in free
        frames do not count, as in the KV tier's usage."""
        return self.allocator.usage

    # ---- swap space

    def can_hold(self, num_frames: int) -> bool:
        """Whether a sequence of ``num_frames`` pages can be swapped out now."""
        return (
            self.num_swapped_frames + num_frames <= self.swap_share
            and num_frames <= self.allocator.num_free_pages
        )

    def hold(self, request_id: str, num_frames: int) -> list[int]:
        """Frames for a sequence swapped out (check ``can_hold`` first); the cached blocks in
        them are evicted, least recently used first."""
        assert request_id not in self.block_tables, f"request {request_id} is swapped out already"
        frames = [self.allocate() for _ in range(num_frames)]
        self.block_tables[request_id] = frames
        self.num_swapped_frames += num_frames
        return frames

    def release(self, request_id: str, pin: bool = False) -> list[int]:
        """A swapped sequence's frames: freed now, or pinned until the next step (a swap-in
        reads them in this one)."""
        frames = self.block_tables.pop(request_id)
        self.num_swapped_frames -= len(frames)
        if pin:
            self.pinned += frames  # their one reference now belongs to the pin
        else:
            for frame in frames:
                self.allocator.free(frame)
        return frames

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.block_tables

    # ---- the prefix cache

    def cached_frame(self, block: BlockKey) -> int | None:
        """The frame caching ``block`` (a ``CachedBlock``), its token ids checked."""
        frame = self.cached_block_hash_to_frame.get(block.block_hash)
        if frame is None or self.frame_to_cached_block[frame] != block:
            return None
        return frame

    def touch(self, frame: int) -> None:
        """A cached block used again: last in line for eviction."""
        if self.allocator.refcount(frame) == 0:
            self.allocator.free_queue.move_to_end(frame)

    def spill(self, block: BlockKey) -> int | None:
        """A frame for ``block`` evicted from the KV tier, newest in the LRU order; None when
        every frame is held (or the block is cached here already: then it is touched)."""
        frame = self.cached_block_hash_to_frame.get(block.block_hash)
        if frame is not None:  # here already (it came from here), or a colliding hash: keep it
            self.touch(frame)
            return None
        if not self.allocator.num_free_pages:
            return None
        frame = self.allocate()
        self.allocator.free(frame)  # evictable, at the tail of the queue
        self.cached_block_hash_to_frame[block.block_hash] = frame
        self.frame_to_cached_block[frame] = block
        return frame

    def pin(self, frame: int) -> None:
        """Keep ``frame`` (a prefix hit being copied back) from eviction until the next step."""
        self.allocator.incref(frame)
        self.pinned.append(frame)

    def uncache(self, frame: int) -> None:
        block = self.frame_to_cached_block.pop(frame, None)
        if block is not None:
            del self.cached_block_hash_to_frame[block.block_hash]

    def reset_cache(self) -> None:
        self.cached_block_hash_to_frame.clear()
        self.frame_to_cached_block.clear()

    # ---- frames

    def allocate(self) -> int:
        """The least recently freed frame; the block it cached leaves the cache."""
        frame = self.allocator.allocate()
        self.uncache(frame)
        return frame

    def unpin_all(self) -> None:
        """The previous step's copies are done: its pinned frames go back to the free queue."""
        for frame in self.pinned:
            self.allocator.free(frame)
        self.pinned = []

    def page_map_codes(self) -> list[int]:
        """Per frame, an index into ``HOST_PAGE_STATES``."""
        codes = [0] * self.num_frames
        for frame in self.frame_to_cached_block:
            codes[frame] = 1
        for frames in self.block_tables.values():
            for frame in frames:
                codes[frame] = 2
        return codes

    def check_invariants(self) -> list[str]:
        """Every frame in exactly one place: held by one swapped sequence, pinned, or free (then
        possibly caching a block); the swap share kept; the cache's two maps agreeing."""
        holders = [0] * self.num_frames
        for frames in self.block_tables.values():
            for frame in frames:
                holders[frame] += 1
        in_tables = [f for f, n in enumerate(holders) if n]
        for frame in self.pinned:
            holders[frame] += 1
        problems = [f"host tier: {p}" for p in self.allocator.check_invariants(holders)]
        if any(holders[f] > 1 for f in in_tables):
            problems.append("host tier: a swapped sequence's frame is held twice")
        swapped = sum(len(t) for t in self.block_tables.values())
        if swapped != self.num_swapped_frames or swapped > self.swap_share:
            problems.append(
                f"host tier: {swapped} frames held by swapped sequences (counted "
                f"{self.num_swapped_frames}; the swap share is {self.swap_share})"
            )
        if set(in_tables) & set(self.frame_to_cached_block):
            problems.append("host tier: a swapped sequence's frame also caches a prefix block")
        by_frame = {f: b.block_hash for f, b in self.frame_to_cached_block.items()}
        if by_frame != {f: h for h, f in self.cached_block_hash_to_frame.items()}:
            problems.append(
                "host tier: the prefix cache's hash -> frame and frame -> block maps disagree"
            )
        return problems
