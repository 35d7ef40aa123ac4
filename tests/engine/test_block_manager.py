"""Block manager and page allocator: prefix caching, LRU eviction, copy-on-write, no page leaks."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from pagedserve.engine import block_manager as bm_module
from pagedserve.engine.block_manager import PAGE_STATES, BlockManager, CachedBlock
from pagedserve.engine.host_tier import HostBlock, HostTier
from pagedserve.engine.page_allocator import PhysicalPageAllocator
from pagedserve.engine.request import Request
from pagedserve.sampling_params import SamplingParams


@dataclass
class Seq:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    lora_int_id: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def admit(bm: BlockManager, req, num_new_tokens: int | None = None) -> bool:
    """Prefix lookup + allocation as the scheduler does it; marks the tokens computed on success."""
    pages, num_hit = bm.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - num_hit
    if not bm.allocate_slots(req, num_new_tokens, pages):
        return False
    bm.record_prefix_lookup(req, pages)
    req.num_computed_tokens = num_hit + num_new_tokens
    return True


def snapshot(bm: BlockManager):
    a = bm.allocator
    return copy.deepcopy(
        (
            bm.block_tables,
            a.ref_counts,
            list(a.free_queue),
            bm.cached_block_hash_to_page,
            bm.page_to_cached_block,
            bm.num_cached_blocks,
            bm.pending_copies,
            bm.pending_swap_in,
            bm.pending_swap_out,
            bm.host and (bm.host.block_tables, list(bm.host.allocator.free_queue)),
        )
    )


# ---- allocator


def test_allocator_hands_out_least_recently_freed_first():
    a = PhysicalPageAllocator(4)
    pages = [a.allocate() for _ in range(4)]
    assert pages == [0, 1, 2, 3] and a.num_free_pages == 0 and a.usage == 1.0
    a.free(2)
    a.free(0)
    assert a.allocate() == 2 and a.allocate() == 0


def test_allocator_incref_revives_a_free_page_out_of_the_middle():
    a = PhysicalPageAllocator(3)
    a.incref(1)
    assert a.refcount(1) == 1 and list(a.free_queue) == [0, 2]
    assert a.num_used_pages == 1 and a.num_free_pages == 2


def test_double_free_asserts():
    a = PhysicalPageAllocator(2)
    page = a.allocate()
    a.free(page)
    with pytest.raises(AssertionError, match="double free of page 0"):
        a.free(page)
    with pytest.raises(AssertionError, match="not allocated"):
        a.free(1)
    with pytest.raises(AssertionError, match="outside the pool"):
        a.free(7)
    assert a.num_free_pages == 2


def test_allocator_misuse_is_named_with_the_pool_range():
    with pytest.raises(AssertionError, match="num_pages must be positive, got 0"):
        PhysicalPageAllocator(0)
    a = PhysicalPageAllocator(2)
    for page in (2, -1):  # one past the end, and before the start
        with pytest.raises(AssertionError, match=rf"page {page} is outside the pool 0\.\.1$"):
            a.refcount(page)
    a.allocate(), a.allocate()
    with pytest.raises(AssertionError, match=r"^no free KV pages; check num_free_pages"):
        a.allocate()


def test_block_manager_double_free_of_a_request_asserts():
    bm = BlockManager(4, 4)
    req = Seq("a", list(range(5)))
    assert admit(bm, req)
    bm.free(req)
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(req)
    assert bm.num_free_pages == 4


# ---- prefix caching


def test_prefix_hit_across_two_requests_with_equal_prefixes():
    bm = BlockManager(16, 4)
    a = Seq("a", list(range(10)))
    assert admit(bm, a)
    b = Seq("b", list(range(8)) + [100, 101, 102])
    pages, num_hit = bm.get_computed_blocks(b)
    assert pages == bm.get_block_table("a")[:2] and num_hit == 8
    assert bm.allocate_slots(b, b.num_tokens - num_hit, pages)
    bm.record_prefix_lookup(b, pages)
    assert bm.get_block_table("b")[:2] == bm.get_block_table("a")[:2]
    assert bm.get_block_table("b")[2] not in bm.get_block_table("a")
    assert [bm.allocator.refcount(p) for p in pages] == [2, 2]
    assert bm.prefix_cache_queries == 10 + 11 and bm.prefix_cache_hits == 8


def test_page_map_shows_used_shared_cached_and_free_pages():
    bm = BlockManager(8, 4)
    a = Seq("a", list(range(10)))  # pages 0, 1 full (cached), page 2 partial
    assert admit(bm, a)
    assert bm.page_map()["cells"] == "22200000"
    b = Seq("b", list(range(8)) + [50])  # hits pages 0 and 1, takes page 3
    assert admit(bm, b)
    assert bm.page_map()["cells"] == "33220000"
    assert bm.page_map()["counts"] == {"free": 4, "cached": 0, "used": 2, "shared": 2}
    bm.free(a)
    bm.free(b)
    # full blocks stay cached for a later hit; partial ones are plain free pages
    assert bm.page_map()["cells"] == "11000000"


def test_page_map_of_a_large_pool_shows_the_busiest_page_of_each_cell():
    bm = BlockManager(10, 4)
    assert admit(bm, Seq("a", list(range(9))))  # pages 0, 1 full (cached), page 2 partial
    bm.free(Seq("a", []))
    assert admit(bm, Seq("b", [7] * 5))  # pages 3 and 4: never used, first in the free queue
    page_map = bm.page_map(max_cells=4)
    assert page_map["pages_per_cell"] == 3
    assert page_map["cells"] == "1200"  # [0 1 2] [3 4 5] [6 7 8] [9]
    assert page_map["counts"] == {"free": 6, "cached": 2, "used": 2, "shared": 0}


def test_fully_cached_prompt_still_leaves_a_block_to_compute():
    bm = BlockManager(8, 4)
    assert admit(bm, Seq("a", list(range(8))))
    pages, num_hit = bm.get_computed_blocks(Seq("b", list(range(8))))
    assert num_hit == 4 and pages == bm.get_block_table("a")[:1]


def test_prefix_hit_is_verified_on_token_ids(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens: 0)
    bm = BlockManager(8, 4)
    assert admit(bm, Seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert bm.get_computed_blocks(Seq("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == ([], 0)
    # Same first block: a genuine hit; the second collides with the first and is refused.
    pages, num_hit = bm.get_computed_blocks(Seq("c", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert pages == bm.get_block_table("a")[:1] and num_hit == 4


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    assert admit(bm, Seq("a", list(range(9))))
    assert bm.get_computed_blocks(Seq("b", list(range(9)))) == ([], 0)
    assert not bm.cached_block_hash_to_page and bm.prefix_cache_queries == 0


def test_freed_cached_pages_are_evicted_lru_tail_blocks_first():
    bm = BlockManager(6, 4)
    a = Seq("a", list(range(8)))
    assert admit(bm, a)
    a_pages = list(bm.get_block_table("a"))
    bm.free(a)
    assert bm.num_free_pages == 6 and bm.usage == 0.0
    assert admit(bm, Seq("b", list(range(100, 108))))
    assert admit(bm, Seq("c", list(range(200, 208))))
    assert not set(a_pages) & set(bm.get_block_table("b") + bm.get_block_table("c"))
    assert admit(bm, Seq("d", [300, 301]))
    assert bm.get_block_table("d") == [a_pages[1]]  # a's tail block goes first
    pages, num_hit = bm.get_computed_blocks(Seq("a2", list(range(9))))
    assert pages == [a_pages[0]] and num_hit == 4


def test_evictable_cached_page_is_revived_on_a_hit():
    bm = BlockManager(4, 4)
    a = Seq("a", list(range(9)))
    assert admit(bm, a)
    bm.free(a)
    b = Seq("b", list(range(9)))
    pages, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 8
    assert bm.allocate_slots(b, 1, pages)
    assert [bm.allocator.refcount(p) for p in pages] == [1, 1]
    assert bm.num_free_pages == 1


def test_revived_prefix_pages_count_against_free_pages():
    bm = BlockManager(3, 4)
    a = Seq("a", list(range(8)))
    assert admit(bm, a)
    bm.free(a)
    assert admit(bm, Seq("c", [50, 51, 52, 53]))
    b = Seq("b", list(range(13)))
    pages, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 8 and bm.num_free_pages == 2
    before = snapshot(bm)
    assert not bm.allocate_slots(b, b.num_tokens - num_hit, pages)
    assert snapshot(bm) == before


def test_reset_prefix_cache_forgets_blocks():
    bm = BlockManager(4, 4)
    assert admit(bm, Seq("a", list(range(9))))
    bm.reset_prefix_cache()
    assert bm.get_computed_blocks(Seq("b", list(range(9)))) == ([], 0)


def test_reset_prefix_cache_is_for_good_even_as_holders_grow():
    bm = BlockManager(8, 4)
    a = Seq("a", list(range(9)))
    assert admit(bm, a)
    bm.reset_prefix_cache()
    a.all_token_ids += [9, 10, 11]  # a third full block: only it is new to the cache
    assert bm.allocate_slots(a, 3)
    a.num_computed_tokens += 3
    assert bm.get_computed_blocks(Seq("b", list(range(13)))) == ([], 0)


def test_uncached_page_is_no_longer_found_and_uncaching_a_plain_page_is_harmless():
    bm = BlockManager(8, 4)
    a = Seq("a", list(range(9)))
    assert admit(bm, a)
    first, second, third = bm.get_block_table("a")
    bm.uncache_page(third)  # holds a partial block: nothing cached there
    bm.uncache_page(second)
    assert bm.get_computed_blocks(Seq("b", list(range(9)))) == ([first], 4)


def count_hits(bm: BlockManager, tokens: list[int]) -> int:
    return bm.get_computed_blocks(Seq("probe", tokens))[1]


def test_blocks_computed_in_chunks_and_by_decoding_are_all_found_again():
    bm = BlockManager(16, 4)
    a = Seq("a", list(range(10)))
    for chunk in (3, 4, 3):  # a chunked prefill
        assert bm.allocate_slots(a, chunk)
        a.num_computed_tokens += chunk
    for token in (50, 51, 52):  # then decoding
        a.all_token_ids.append(token)
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert count_hits(bm, a.all_token_ids + [99]) == 12


def test_a_block_repeated_at_two_positions_is_cached_at_both():
    bm = BlockManager(8, 2)
    assert admit(bm, Seq("a", [1, 2, 1, 2, 3]))
    assert count_hits(bm, [1, 2, 1, 2, 9]) == 4


def test_each_request_caches_its_own_blocks():
    bm = BlockManager(16, 2)
    for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [6, 7, 8, 9, 10])):
        assert admit(bm, Seq(rid, prompt))
    assert count_hits(bm, [6, 7, 8, 9, 0]) == 4 and count_hits(bm, [1, 2, 3, 4, 0]) == 4


def test_blocks_after_a_prefix_hit_are_cached_too():
    bm = BlockManager(16, 2)
    assert admit(bm, Seq("a", [1, 2, 3, 4]))
    assert admit(bm, Seq("b", [1, 2, 5, 6, 7]))  # block [1, 2] found, [5, 6] new
    assert count_hits(bm, [1, 2, 5, 6, 9]) == 4


def test_hit_counters_accumulate_over_admissions():
    bm = BlockManager(16, 4)
    assert admit(bm, Seq("a", list(range(9))))
    for rid in ("b", "c"):
        assert admit(bm, Seq(rid, list(range(9))))
    assert bm.prefix_cache_hits == 16 and bm.prefix_cache_queries == 27


def test_a_lookup_whose_admission_fails_is_not_counted():
    """A request that waits for pages looks its prefix up again at every try: only the try that
    admits it counts (vLLM's issue 43736: a hit rate inflated by retries)."""
    bm = BlockManager(4, 4)
    assert admit(bm, Seq("a", list(range(9))))  # 3 of the 4 pages
    assert not admit(bm, Seq("b", list(range(8)) + list(range(100, 110))))  # needs 3 more
    assert count_hits(bm, list(range(9))) == 8  # a bare lookup: not counted either
    assert bm.prefix_cache_hits == 0 and bm.prefix_cache_queries == 9


def test_a_child_forked_before_its_first_full_block_caches_that_block_when_full():
    bm = BlockManager(8, 4)
    parent = Seq("p", [1, 2, 3])
    assert admit(bm, parent)
    child = Seq("c", list(parent.all_token_ids), parent.num_computed_tokens)
    bm.fork(parent, child)
    child.all_token_ids.append(4)
    assert bm.allocate_slots(child, 1)
    child.num_computed_tokens += 1
    assert count_hits(bm, [1, 2, 3, 4, 5]) == 4


def test_allocating_no_new_tokens_copies_nothing():
    bm = BlockManager(8, 4)
    parent = Seq("p", [1, 2, 3])
    assert admit(bm, parent)
    child = Seq("c", list(parent.all_token_ids), parent.num_computed_tokens)
    bm.fork(parent, child)
    assert bm.allocate_slots(child, 0)
    assert bm.get_block_table("c") == bm.get_block_table("p") and bm.take_pending_copies() == []


def test_a_freed_request_leaves_no_pending_copy_and_no_bookkeeping():
    bm = BlockManager(8, 4)
    parent = Seq("p", [1, 2, 3, 4, 5])
    assert admit(bm, parent)
    child = Seq("c", list(parent.all_token_ids), parent.num_computed_tokens)
    bm.fork(parent, child)
    child.all_token_ids.append(6)
    assert bm.allocate_slots(child, 1)  # copy-on-write of the shared partial block
    assert bm.pending_copies
    bm.free(child)
    assert bm.take_pending_copies() == []
    bm.free(parent)
    assert not bm.block_tables and not bm.block_hashes and not bm.num_cached_blocks


def test_block_size_must_be_positive():
    with pytest.raises(AssertionError, match="block_size must be positive, got 0"):
        BlockManager(4, 0)
    bm = BlockManager(4, 1)
    assert admit(bm, Seq("a", [1, 2, 3])) and len(bm.get_block_table("a")) == 3


# ---- copy-on-write and all-or-nothing


def test_copy_on_write_after_fork_keeps_parent_page_and_records_copy():
    bm = BlockManager(8, 4)
    parent = Seq("p", list(range(6)))
    assert admit(bm, parent)
    child = Seq("c", list(parent.all_token_ids), parent.num_computed_tokens)
    bm.fork(parent, child)
    shared = list(bm.get_block_table("p"))
    assert bm.get_block_table("c") == shared
    assert [bm.allocator.refcount(p) for p in shared] == [2, 2]
    child.all_token_ids.append(42)
    assert bm.allocate_slots(child, 1)
    new_page = bm.get_block_table("c")[1]
    assert new_page not in shared and bm.get_block_table("c")[0] == shared[0]
    assert bm.get_block_table("p") == shared
    assert bm.take_pending_copies() == [(shared[1], new_page)]
    assert bm.take_pending_copies() == []
    assert bm.allocator.refcount(shared[1]) == 1 and bm.allocator.refcount(shared[0]) == 2
    parent.all_token_ids.append(7)
    assert bm.allocate_slots(parent, 1)  # no longer shared: written in place
    assert bm.get_block_table("p") == shared and bm.take_pending_copies() == []


def test_failed_allocation_changes_nothing():
    bm = BlockManager(3, 4)
    assert admit(bm, Seq("a", list(range(8))))
    before = snapshot(bm)
    assert not admit(bm, Seq("b", list(range(100, 108))))
    assert snapshot(bm) == before and "b" not in bm.block_tables


def test_copy_on_write_page_counts_in_the_all_or_nothing_check():
    bm = BlockManager(2, 4)
    parent = Seq("p", list(range(6)))
    assert admit(bm, parent)
    child = Seq("c", list(parent.all_token_ids), parent.num_computed_tokens)
    bm.fork(parent, child)
    child.all_token_ids.append(1)
    before = snapshot(bm)
    assert not bm.allocate_slots(child, 1)
    assert snapshot(bm) == before


def test_the_invariant_check_names_a_leaked_page_and_a_lost_refcount():
    bm = BlockManager(8, 4)
    req = Seq("a", list(range(9)))
    assert admit(bm, req) and bm.check_invariants() == []
    bm.allocator.ref_counts[bm.get_block_table("a")[0]] += 1  # a reference nobody holds
    problems = bm.check_invariants()
    assert len(problems) == 1 and "has refcount 2 but 1 holders" in problems[0]
    bm.allocator.ref_counts[bm.get_block_table("a")[0]] -= 1
    bm.block_tables.pop("a")  # pages leaked: held by refcount, by no table
    problems = bm.check_invariants()
    assert "has refcount 1 but 0 holders" in problems[0]
    assert any("bookkeeping kept" in p for p in problems)


def test_can_fit_and_usage():
    bm = BlockManager(4, 16)
    assert bm.can_fit(64) and not bm.can_fit(65)
    assert admit(bm, Seq("a", list(range(17))))
    assert bm.usage == 0.5 and bm.num_free_pages == 2


def test_engine_request_satisfies_the_protocol():
    bm = BlockManager(4, 4)
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams())
    assert admit(bm, req) and len(bm.get_block_table("r")) == 2


# ---- the host tier


def host_manager(num_pages=8, swap=4, cache=0, block_size=4) -> BlockManager:
    return BlockManager(num_pages, block_size, True, swap, cache)


def test_swap_out_copies_the_computed_pages_and_keeps_the_computed_tokens():
    bm = host_manager()
    a = Seq("a", list(range(10)))
    assert admit(bm, a)
    table = list(bm.get_block_table("a"))
    assert bm.can_swap_out(a)
    bm.swap_out(a)
    frames = bm.host.block_tables["a"]
    assert bm.take_pending_swaps() == (list(zip(table, frames)), [])
    assert a.num_computed_tokens == 10 and "a" not in bm.block_tables and bm.is_swapped(a)
    assert bm.num_free_pages == 8 and bm.host.num_swapped_frames == 3
    assert bm.check_invariants() == []


def test_swap_in_gets_fresh_pages_for_the_frames_and_the_new_tokens():
    bm = host_manager()
    a = Seq("a", list(range(8)))
    assert admit(bm, a)
    bm.swap_out(a)
    frames = list(bm.host.block_tables["a"])
    bm.take_pending_swaps()
    bm.moves_done()
    a.all_token_ids.append(99)
    assert bm.swap_in(a, 1)
    table = bm.get_block_table("a")
    assert len(table) == 3 and bm.take_pending_swaps() == ([], list(zip(frames, table[:2])))
    assert bm.host.pinned == frames and not bm.is_swapped(a)  # read by this step's copies
    assert bm.check_invariants() == []
    bm.moves_done()
    assert not bm.host.pinned and bm.host.allocator.num_free_pages == 4


def test_the_swap_share_bounds_what_is_swapped_out():
    bm = host_manager(swap=2)
    a = Seq("a", list(range(9)))  # 3 pages
    assert admit(bm, a)
    assert not bm.can_swap_out(a)
    with pytest.raises(AssertionError, match="no room to swap it out"):
        bm.swap_out(a)
    assert bm.check_invariants() == [] and not bm.is_swapped(a)


def test_a_failed_swap_in_changes_nothing():
    bm = host_manager(num_pages=3)
    a = Seq("a", list(range(8)))
    assert admit(bm, a)
    bm.swap_out(a)
    bm.take_pending_swaps()
    assert admit(bm, Seq("b", list(range(100, 108))))
    before = snapshot(bm)
    a.all_token_ids.append(9)
    assert not bm.swap_in(a, 1)
    assert snapshot(bm) == before and bm.is_swapped(a)


def test_an_evicted_prefix_block_spills_to_the_host_and_a_hit_copies_it_back():
    bm = host_manager(num_pages=3, swap=0, cache=4)
    a = Seq("a", list(range(9)))  # blocks [0..3], [4..7] cached, then a partial one
    assert admit(bm, a)
    pages = list(bm.get_block_table("a"))
    bm.free(a)
    assert admit(bm, Seq("b", list(range(100, 112))))  # all three pages: a's blocks evicted
    out, _ = bm.take_pending_swaps()
    assert [p for p, _ in out] == [pages[1], pages[0]]  # a's tail went first; its partial block
    spilled = dict(out)  # was never cached
    assert len(bm.host.frame_to_cached_block) == 2
    bm.free(Seq("b", []))
    queries = bm.host_prefix_cache_queries
    blocks, num_hit = bm.get_computed_blocks(Seq("c", list(range(9))))
    assert num_hit == 8 and all(isinstance(b, HostBlock) for b in blocks)
    assert [b.frame for b in blocks] == [spilled[pages[0]], spilled[pages[1]]]
    c = Seq("c", list(range(9)))
    assert admit(bm, c) and c.num_computed_tokens == 9
    assert bm.host_prefix_cache_hits == 8 and bm.host_prefix_cache_queries == queries + 9
    _, loads = bm.take_pending_swaps()
    assert [f for f, _ in loads] == [b.frame for b in blocks]
    assert [p for _, p in loads] == bm.get_block_table("c")[:2]
    assert bm.check_invariants() == []


def test_a_block_back_from_the_host_is_not_copied_there_again():
    bm = host_manager(num_pages=2, swap=0, cache=4)
    assert admit(bm, Seq("a", list(range(5))))  # one full block
    bm.free(Seq("a", []))
    assert admit(bm, Seq("b", list(range(50, 58))))  # evicts it: one spill
    assert len(bm.take_pending_swaps()[0]) == 1
    bm.free(Seq("b", []))
    c = Seq("c", list(range(5)))
    assert admit(bm, c)  # a host hit, copied back
    bm.take_pending_swaps()
    bm.moves_done()
    bm.free(c)
    assert admit(bm, Seq("d", list(range(60, 68))))  # evicts it again: the host has it
    out, _ = bm.take_pending_swaps()
    assert all(
        f not in bm.host.frame_to_cached_block
        or bm.host.frame_to_cached_block[f].token_ids != (0, 1, 2, 3)
        for _, f in out
    )


def test_frames_a_swap_in_reads_are_not_reused_by_a_spill_of_the_same_step():
    """A swap-in's frames are read by this step's copies, after its swap-outs: a spill must not
    land on them. (Freed at once, the second spill of c's admission below would take one.)"""
    bm = BlockManager(5, 2, True, num_swap_frames=2, num_host_cache_frames=1)
    a = Seq("a", [1, 2, 3, 4])
    assert admit(bm, a)
    bm.swap_out(a)  # frames 0 and 1; a's two pages stay cached in the KV tier
    bm.take_pending_swaps()
    bm.moves_done()
    b = Seq("b", [5, 6, 7, 8, 13, 14])
    assert admit(bm, b)
    bm.free(b)  # every KV page now caches a block
    a.all_token_ids.append(9)
    assert bm.swap_in(a, 1)  # three pages: a spill takes the one free frame
    assert admit(bm, Seq("c", [10, 11, 12, 15]))  # two more evictions, two more spills
    out, into = bm.take_pending_swaps()
    assert sorted(f for f, _ in into) == [0, 1]
    assert not {f for _, f in out} & {f for f, _ in into}
    assert bm.check_invariants() == []


def test_a_faulted_host_frame_is_forgotten_and_names_its_swapped_holder():
    bm = host_manager(swap=4, cache=4)
    a = Seq("a", list(range(6)))
    assert admit(bm, a)
    bm.swap_out(a)
    frame = bm.host.block_tables["a"][1]
    assert bm.drop_host_frames([frame]) == ["a"]
    bm.free_swapped(a)
    assert not bm.is_swapped(a) and bm.check_invariants() == []
    assert bm.host.allocator.num_free_pages == 8


def test_the_host_page_map_shows_swapped_cached_and_free_frames():
    bm = host_manager(num_pages=3, swap=2, cache=2)
    a = Seq("a", list(range(5)))
    assert admit(bm, a)
    bm.swap_out(a)  # two frames swapped
    bm.take_pending_swaps()
    assert admit(bm, Seq("b", list(range(50, 62))))  # evicts a's cached block: one spill
    host_map = bm.host_page_map()
    assert host_map["counts"] == {"free": 1, "cached": 1, "swapped": 2}
    assert sorted(host_map["cells"]) == ["0", "1", "2", "2"]
    assert BlockManager(4, 4).host_page_map() is None


def test_the_invariant_check_covers_the_host_tier():
    bm = host_manager()
    a = Seq("a", list(range(6)))
    assert admit(bm, a)
    bm.swap_out(a)
    assert bm.check_invariants() == []
    bm.host.allocator.ref_counts[bm.host.block_tables["a"][0]] += 1
    assert any("host tier" in p and "refcount 2 but 1 holders" in p for p in bm.check_invariants())
    bm.host.allocator.ref_counts[bm.host.block_tables["a"][0]] -= 1
    bm.block_tables["a"] = []  # in both tiers
    assert any("both tiers" in p for p in bm.check_invariants())


def test_the_swap_share_is_usable_to_its_last_frame():
    bm = host_manager(swap=4, cache=0)
    a = Seq("a", list(range(16)))  # 4 pages
    assert admit(bm, a) and bm.can_swap_out(a)
    bm.swap_out(a)
    assert bm.host.num_swapped_frames == 4 and bm.check_invariants() == []


def test_a_host_tier_of_swap_space_alone_caches_no_evicted_block():
    bm = host_manager(num_pages=2, swap=4, cache=0)
    assert admit(bm, Seq("a", list(range(5))))  # one full block, cached
    bm.free(Seq("a", []))
    assert admit(bm, Seq("b", list(range(50, 58))))  # evicts it
    assert bm.take_pending_swaps() == ([], []) and not bm.host.frame_to_cached_block


def test_a_sequence_cannot_be_swapped_out_twice():
    host = HostTier(4, 0)
    host.hold("a", 1)
    with pytest.raises(AssertionError, match="request a is swapped out already"):
        host.hold("a", 1)


def test_a_block_spilled_again_is_kept_and_becomes_the_last_evicted():
    host = HostTier(0, 2)
    a, b, c = (CachedBlock(h, None, (h,)) for h in (1, 2, 3))
    frame_a, frame_b = host.spill(a), host.spill(b)
    assert host.spill(a) is None  # cached already: kept where it is, newest in the LRU order
    assert host.spill(c) == frame_b  # so b, the least recently used, is evicted for c
    assert host.cached_frame(a) == frame_a and host.cached_frame(b) is None
    assert host.check_invariants() == []


def test_a_host_tier_needs_frames_and_no_negative_share():
    for swap, cache in [(0, 0), (-1, 3), (3, -1)]:
        with pytest.raises(AssertionError, match=f"needs frames: swap {swap}, cache {cache}"):
            HostTier(swap, cache)


def _swap_share_full_and_a_block_spilled() -> BlockManager:
    """A host tier whose swap share a swapped-out sequence fills, beside a spilled block."""
    bm = host_manager(num_pages=3, swap=2, cache=2)
    a = Seq("a", list(range(5)))
    assert admit(bm, a)
    bm.swap_out(a)
    bm.take_pending_swaps()
    assert admit(bm, Seq("b", list(range(50, 62))))  # evicts a's cached block: one spill
    assert bm.host.num_swapped_frames == bm.host.swap_share and bm.host.frame_to_cached_block
    assert bm.check_invariants() == []
    return bm


def _cache_a_swapped_frame(host: HostTier) -> None:
    host.frame_to_cached_block[host.block_tables["a"][0]] = host.frame_to_cached_block[
        next(iter(host.frame_to_cached_block))
    ]


@pytest.mark.parametrize(
    "breakage, problem",
    [
        (lambda h: h.pinned.append(h.block_tables["a"][0]), "a swapped sequence's frame is held"),
        (lambda h: setattr(h, "num_swapped_frames", 1), "2 frames held by swapped sequences "),
        (lambda h: setattr(h, "swap_share", 1), "(counted 2; the swap share is 1)"),
        (_cache_a_swapped_frame, "a swapped sequence's frame also caches a prefix block"),
        (lambda h: h.cached_block_hash_to_frame.clear(), "hash -> frame and frame -> block"),
    ],
    ids=["pinned-while-swapped", "miscounted", "over-the-share", "swapped-and-cached", "maps"],
)
def test_the_host_invariant_check_names_each_broken_rule(breakage, problem):
    bm = _swap_share_full_and_a_block_spilled()
    breakage(bm.host)
    assert any(p.startswith("host tier: ") and problem in p for p in bm.check_invariants())


# ---- property test: a scheduler's random moves never leak or corrupt pages

BLOCK_SIZE = 4
NUM_PAGES = 10
SHARED_PREFIXES = [[], [0, 1, 2, 0, 1, 2, 0, 1], [2] * 12]


class BlockManagerMachine(RuleBasedStateMachine):
    """Simulates the KV pool and the host tier as token ids per slot, runs each rule's page
    moves as the model runner does (swap-outs, swap-ins, copy-on-write, then the forward pass's
    writes), and checks every computed slot holds its token, in whichever tier it is."""

    enable_prefix_caching = True
    num_swap_frames = 0
    num_host_cache_frames = 0
    waiting = Bundle("waiting")
    running = Bundle("running")

    @initialize()
    def setup(self):
        self.bm = BlockManager(
            NUM_PAGES,
            BLOCK_SIZE,
            self.enable_prefix_caching,
            self.num_swap_frames,
            self.num_host_cache_frames,
        )
        self.kv: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_PAGES)]
        num_frames = self.num_swap_frames + self.num_host_cache_frames
        self.host_kv: list[list[int | None]] = [[None] * BLOCK_SIZE for _ in range(num_frames)]
        self.reqs: dict[str, Seq] = {}
        self.swapped: dict[str, Seq] = {}
        self.next_id = 0
        self.next_token = 100

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _run_moves(self) -> None:
        """The runner's page moves, in its order, then the step is over (pins released)."""
        out, into = self.bm.take_pending_swaps()
        for page, frame in out:
            self.host_kv[frame] = list(self.kv[page])
        for frame, page in into:
            self.kv[page] = list(self.host_kv[frame])
        for src, dst in self.bm.take_pending_copies():
            self.kv[dst] = list(self.kv[src])

    def _compute(self, req: Seq, start: int, end: int) -> None:
        """Run the pending moves, then write KV for positions start..end-1 (a forward pass)."""
        self._run_moves()
        table = self.bm.get_block_table(req.request_id)
        for pos in range(start, end):
            self.kv[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = req.all_token_ids[pos]
        req.num_computed_tokens = end
        self.bm.moves_done()

    @rule(
        target=waiting,
        prefix=st.sampled_from(SHARED_PREFIXES),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=16),
    )
    def add_request(self, prefix, tail):
        return Seq(self._new_id(), prefix + tail)

    @rule(target=running, req=consumes(waiting), chunk=st.integers(1, 24))
    def schedule_waiting(self, req, chunk):
        assert req.request_id not in self.bm.block_tables and req.num_computed_tokens == 0
        pages, num_hit = self.bm.get_computed_blocks(req)
        assert num_hit < req.num_tokens
        num_new = min(chunk, req.num_tokens - num_hit)
        before = snapshot(self.bm)
        if not self.bm.allocate_slots(req, num_new, pages):
            assert snapshot(self.bm) == before
            return multiple()
        self.reqs[req.request_id] = req
        self._compute(req, num_hit, num_hit + num_new)
        return req

    def _sample_if_complete(self, req: Seq) -> None:
        if req.num_computed_tokens == req.num_tokens:
            self.next_token += 1
            req.all_token_ids.append(self.next_token)  # a sampled token no other sequence has

    @rule(req=running, chunk=st.integers(1, 8))
    def schedule_running(self, req, chunk):
        if req.request_id not in self.reqs:
            return
        self._sample_if_complete(req)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        before = snapshot(self.bm)
        if not self.bm.allocate_slots(req, num_new):
            assert snapshot(self.bm) == before
            return
        self._compute(req, req.num_computed_tokens, req.num_computed_tokens + num_new)

    @rule(target=running, parent=running)
    def fork(self, parent):
        if parent.request_id not in self.reqs:
            return multiple()
        child = Seq(self._new_id(), list(parent.all_token_ids), parent.num_computed_tokens)
        self.bm.fork(parent, child)
        self.reqs[child.request_id] = child
        return child

    @rule(req=consumes(running))
    def finish(self, req):
        if self.reqs.pop(req.request_id, None) is not None:
            self.bm.free(req)

    @rule(target=waiting, req=consumes(running))
    def preempt(self, req):
        if self.reqs.pop(req.request_id, None) is None:
            return multiple()
        self.bm.free(req)
        req.num_computed_tokens = 0
        return req

    # ---- the host tier

    @rule(req=running)
    def swap_out(self, req):
        if req.request_id not in self.reqs or not self.bm.can_swap_out(req):
            return
        self.bm.swap_out(req)
        assert self.bm.is_swapped(req) and req.request_id not in self.bm.block_tables
        self.swapped[self.reqs.pop(req.request_id).request_id] = req
        self._run_moves()
        self.bm.moves_done()

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def swap_in(self, data, chunk):
        req = self.swapped[data.draw(st.sampled_from(sorted(self.swapped)))]
        self._sample_if_complete(req)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        before = snapshot(self.bm)
        if not self.bm.swap_in(req, num_new):
            assert snapshot(self.bm) == before
            return
        self.reqs[req.request_id] = self.swapped.pop(req.request_id)
        self._compute(req, req.num_computed_tokens, req.num_computed_tokens + num_new)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def finish_swapped(self, data):
        req = self.swapped.pop(data.draw(st.sampled_from(sorted(self.swapped))))
        self.bm.free_swapped(req)

    @precondition(lambda self: self.bm.host is not None)
    @rule(data=st.data())
    def host_fault(self, data):
        """A frame's contents wrecked: what it caches is forgotten, its swapped holder dropped."""
        frame = data.draw(st.integers(0, self.bm.host.num_frames - 1))
        self.host_kv[frame] = [-1] * BLOCK_SIZE
        for rid in self.bm.drop_host_frames([frame]):
            self.bm.free_swapped(self.swapped.pop(rid))
        assert frame not in self.bm.host.frame_to_cached_block

    @invariant()
    def pages_are_accounted_for(self):
        a = self.bm.allocator
        holders = [0] * NUM_PAGES
        for table in self.bm.block_tables.values():
            for page in table:
                holders[page] += 1
        assert a.ref_counts == holders
        assert set(a.free_queue) == {p for p in range(NUM_PAGES) if holders[p] == 0}
        assert a.num_free_pages + a.num_used_pages == NUM_PAGES
        assert set(self.bm.block_tables) == set(self.reqs)
        assert self.bm.check_invariants() == []

    @invariant()
    def page_map_shows_every_page_as_its_holders_see_it(self):
        """The web console's map, expanded, against the block tables (not the allocator)."""
        holders = [0] * NUM_PAGES
        for table in self.bm.block_tables.values():
            for page in table:
                holders[page] += 1
        page_map = self.bm.page_map()
        assert page_map["pages_per_cell"] == 1 and len(page_map["cells"]) == NUM_PAGES
        for page, code in enumerate(page_map["cells"]):
            cached = page in self.bm.page_to_cached_block
            want = {0: "cached" if cached else "free", 1: "used"}.get(holders[page], "shared")
            assert PAGE_STATES[int(code)] == want, (page, holders[page], cached)
        assert sum(page_map["counts"].values()) == NUM_PAGES

    @invariant()
    def prefix_cache_maps_agree(self):
        h2p, p2b = self.bm.cached_block_hash_to_page, self.bm.page_to_cached_block
        assert {p: b.block_hash for p, b in p2b.items()} == {p: h for h, p in h2p.items()}
        if not self.enable_prefix_caching:
            assert not h2p

    @invariant()
    def every_computed_slot_holds_its_token(self):
        for req in self.reqs.values():
            table = self.bm.get_block_table(req.request_id)
            assert len(table) * BLOCK_SIZE >= req.num_computed_tokens
            for pos in range(req.num_computed_tokens):
                slot = self.kv[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                assert slot == req.all_token_ids[pos], (req.request_id, pos)

    @invariant()
    def cached_pages_hold_their_tokens(self):
        for page, block in self.bm.page_to_cached_block.items():
            assert tuple(self.kv[page]) == block.token_ids

    @invariant()
    def swapped_frames_hold_their_tokens(self):
        for req in self.swapped.values():
            frames = self.bm.host.block_tables[req.request_id]
            assert len(frames) * BLOCK_SIZE >= req.num_computed_tokens
            for pos in range(req.num_computed_tokens):
                slot = self.host_kv[frames[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                assert slot == req.all_token_ids[pos], (req.request_id, pos)

    @invariant()
    def host_cached_frames_hold_their_tokens(self):
        if self.bm.host is not None:
            for frame, block in self.bm.host.frame_to_cached_block.items():
                assert tuple(self.host_kv[frame]) == block.token_ids
            assert set(self.bm.host.block_tables) == set(self.swapped)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for req in list(self.reqs.values()):
            self.bm.free(req)
        for req in list(self.swapped.values()):
            self.bm.free_swapped(req)
        assert self.bm.num_free_pages == NUM_PAGES and self.bm.usage == 0.0
        assert self.bm.check_invariants() == []
        assert not self.bm.block_tables
        assert not self.bm.block_hashes and not self.bm.num_cached_blocks, "bookkeeping leaked"
        host = self.bm.host
        if host is not None:
            assert host.allocator.num_free_pages == host.num_frames and not host.block_tables


class BlockManagerMachineNoCaching(BlockManagerMachine):
    enable_prefix_caching = False


class BlockManagerMachineWithSwap(BlockManagerMachine):
    num_swap_frames = 6


class BlockManagerMachineWithSwapAndHostCache(BlockManagerMachine):
    num_swap_frames = 4
    num_host_cache_frames = 3  # fewer than the KV pool: spills evict host blocks too


PROPERTY_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockManagerWithPrefixCaching = BlockManagerMachine.TestCase
TestBlockManagerWithPrefixCaching.settings = PROPERTY_SETTINGS
TestBlockManagerWithoutPrefixCaching = BlockManagerMachineNoCaching.TestCase
TestBlockManagerWithoutPrefixCaching.settings = PROPERTY_SETTINGS
TestBlockManagerWithSwap = BlockManagerMachineWithSwap.TestCase
TestBlockManagerWithSwap.settings = PROPERTY_SETTINGS
TestBlockManagerWithSwapAndHostCache = BlockManagerMachineWithSwapAndHostCache.TestCase
TestBlockManagerWithSwapAndHostCache.settings = PROPERTY_SETTINGS


def test_a_host_tier_of_one_frame_is_allowed_and_one_of_none_is_not():
    assert HostTier(1, 0).num_frames == 1 and HostTier(0, 1).num_frames == 1
    with pytest.raises(AssertionError, match="a host tier needs frames"):
        HostTier(0, 0)


def test_the_frames_of_two_sequences_swapped_in_in_one_step_stay_pinned_until_the_next():
    host = HostTier(4, 0)
    a, b = host.hold("a", 2), host.hold("b", 1)
    assert host.release("a", pin=True) == a and host.release("b", pin=True) == b
    assert sorted(host.pinned) == sorted(a + b) and host.allocator.num_free_pages == 1
    assert host.check_invariants() == []
    host.unpin_all()
    assert host.pinned == [] and host.allocator.num_free_pages == 4


def test_a_frame_in_two_swapped_sequences_tables_breaks_the_invariants():
    host = HostTier(4, 0)
    a = host.hold("a", 2)
    host.block_tables["b"] = [a[0]]  # the bug the check exists for
    host.num_swapped_frames += 1
    assert any("held twice" in p for p in host.check_invariants())
