"""Adapters over device slots: the scheduler runs at most ``max_loras`` distinct adapters (a
request for another waits, keeping its place, and those behind it may go first), and rank 0's
registry moves adapters into slots least recently used first, keeping those the step needs."""

from __future__ import annotations

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.scheduler import Scheduler
from pagedserve.lora.registry import LoRARegistry
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams


def _request(rid: str, lora_id: int) -> Request:
    lora = LoRARequest(f"a{lora_id}", lora_id, "/a") if lora_id else None
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), lora_request=lora)


def test_a_request_for_one_adapter_too_many_waits_and_those_behind_it_run():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(64, 4), max_loras=2)
    for rid, lora_id in (("a", 1), ("b", 2), ("c", 3), ("base", 0), ("d", 1)):
        scheduler.add_request(_request(rid, lora_id))
    first = [s.request.request_id for s in scheduler.schedule().scheduled]
    assert first == ["a", "b", "base", "d"]  # c's adapter would be a third
    assert [r.request_id for r in scheduler.waiting] == ["c"]  # it keeps its place
    assert scheduler.running_loras() - {0} == {1, 2}
    for req in [r for r in scheduler.running if r.lora_int_id == 2]:
        scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
    assert [s.request.request_id for s in scheduler.schedule().scheduled][-1] == "c"


def test_slots_keep_the_steps_adapters_and_evict_the_least_recently_used():
    registry = LoRARegistry(max_loras=2)
    moves, slot_of = registry.assign({1, 2})
    assert sorted(moves) == [(0, 1), (1, 2)] and slot_of == {1: 0, 2: 1}
    assert registry.assign({2}) == ([], {2: 1})  # already in a slot: no move
    moves, slot_of = registry.assign({2, 3})  # 1 is the least recently used: 3 takes its slot
    assert moves == [(0, 3)] and slot_of == {2: 1, 3: 0}
    registry.forget_slots([0])  # a step failed while moving 3 in
    assert registry.assign({3}) == ([(0, 3)], {3: 0})
    registry.add(LoRARequest("x", 3, "/x"))
    registry.remove(3)
    assert registry.slot_ids == [None, 2] and registry.next_id() == 4
    with pytest.raises(AssertionError):
        registry.assign({4, 5, 6})
