"""The data-parallel routing policies on their own (``entrypoints/ray_serve/affinity.py``, no Ray):
a prompt goes where its leading blocks were sent, a prefix that many prompts share does not pin
the traffic, load past the threshold wins over affinity, and a session key keeps to one replica.
The blocks are hashed as the engine's prefix cache hashes them: checked against the engine's own
block manager."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pagedserve.entrypoints.ray_serve.affinity import (
    UNCACHED_WEIGHT,
    PrefixAffinity,
    SessionAffinity,
    block_hashes,
)

BS = 16
SYSTEM = list(range(1000, 1000 + 5 * BS))  # a system prompt of five full blocks


def conversation(i: int, turns: int = 1) -> list[int]:
    """The system prompt, then ``turns`` turns of this conversation's own tokens."""
    return SYSTEM + [2000 + 50 * i + t for t in range(turns * 24)]


def route(policy: PrefixAffinity, prompt: list[int], load: dict) -> str:
    chosen, hashes = policy.choose(prompt, load)
    policy.record(chosen, hashes)
    return chosen


def test_blocks_are_hashed_as_the_engines_prefix_cache_hashes_them():
    from pagedserve.engine.block_manager import BlockManager

    prompt = list(range(3 * BS + 5))  # three full blocks and a partial one

    class Req:
        request_id = "r"
        all_token_ids = prompt
        num_tokens = len(prompt)
        lora_int_id = 0  # the base model's chain (an adapter's starts from its own root)

    manager = BlockManager(num_pages=8, block_size=BS)
    assert block_hashes(prompt, BS) == manager._hash_full_blocks(Req(), [], 3)
    assert block_hashes(prompt[: BS - 1], BS) == []


def test_a_conversations_next_turn_goes_where_its_history_was_sent():
    policy = PrefixAffinity(BS, blocks_per_replica=1000)
    idle = {"a": 0, "b": 0}
    homes = {i: route(policy, conversation(i), idle) for i in range(8)}
    for turn in (2, 3, 4):
        for i, home in homes.items():
            assert route(policy, conversation(i, turn), idle) == home, (i, turn)


def test_a_shared_system_prompt_does_not_pin_new_conversations_to_one_replica():
    """Sent one at a time (no load to balance), new conversations still spread over both."""
    policy = PrefixAffinity(BS, blocks_per_replica=1000)
    homes = Counter(route(policy, conversation(i), {"a": 0, "b": 0}) for i in range(20))
    assert min(homes.values()) >= 8, homes
    # once others branched off it, the system prompt is cached on both replicas
    assert all(policy.num_matched(r, block_hashes(SYSTEM, BS)) == 5 for r in "ab")


def test_past_the_imbalance_threshold_the_least_loaded_replica_takes_the_request():
    policy = PrefixAffinity(BS, blocks_per_replica=1000, imbalance_threshold=4)
    home = route(policy, conversation(0), {"a": 0, "b": 0})
    other = "b" if home == "a" else "a"
    nxt = conversation(0, 2)
    assert route(policy, nxt, {home: 4, other: 0}) == home  # within the threshold: affinity
    assert policy.choose(nxt, {home: 5, other: 0})[0] == other  # past it: the least loaded


def test_a_follow_up_waits_behind_queued_prefill_only_while_that_costs_less_than_its_history():
    """A replica busy prefilling other prompts keeps a conversation while recomputing its
    history elsewhere would cost more (the follow-up's wait, and as much for the requests sent
    to that replica after it); past that, the idle replica takes it."""
    policy = PrefixAffinity(BS, blocks_per_replica=1000)
    home = route(policy, conversation(0), {"a": 0, "b": 0})
    other = "b" if home == "a" else "a"
    nxt = conversation(0, 2)
    history = policy.num_uncached(other, nxt, block_hashes(nxt, BS))
    here = policy.num_uncached(home, nxt, block_hashes(nxt, BS))
    assert here < history == len(nxt)
    idle = {home: 0, other: 0}
    moved = UNCACHED_WEIGHT * (history - here)  # what leaving costs, in tokens of prefill
    assert policy.choose(nxt, idle, {home: history - here + 1})[0] == home
    assert policy.choose(nxt, idle, {home: moved - 1})[0] == home
    assert policy.choose(nxt, idle, {home: moved + 1})[0] == other


def test_a_shared_prefix_counts_as_held_on_every_replica():
    policy = PrefixAffinity(BS, blocks_per_replica=1000)
    for i in range(3):  # three conversations branch off the system prompt on "a"
        policy.record("a", block_hashes(conversation(i), BS))
    new = conversation(9)
    assert policy.num_shared(block_hashes(new, BS)) == 5
    assert policy.num_uncached("b", new, block_hashes(new, BS)) == len(new) - len(SYSTEM)
    assert policy.least_loaded({"a": 0, "b": 0}) == "b"
    assert policy.choose(new, {"a": 0, "b": 0})[0] == "b"  # the same work: the emptier one


def test_a_replica_forgets_the_least_recently_sent_blocks_past_its_capacity():
    policy = PrefixAffinity(BS, blocks_per_replica=4)
    first = list(range(3 * BS))
    policy.record("a", block_hashes(first, BS))
    policy.record("a", block_hashes(list(range(5000, 5000 + 3 * BS)), BS))
    assert len(policy.held["a"]) == 4
    assert policy.num_matched("a", block_hashes(first, BS)) == 0  # its first blocks went first
    policy.record("a", block_hashes(first, BS), capacity=8)
    assert len(policy.held["a"]) == 6  # all six blocks fit now


def test_a_gone_replica_is_forgotten():
    policy = PrefixAffinity(BS, blocks_per_replica=100)
    policy.record("a", block_hashes(conversation(0), BS))
    policy.forget(["a"])
    assert policy.num_matched("a", block_hashes(conversation(0), BS)) == 0
    assert route(policy, conversation(0, 2), {"b": 0}) == "b"


def test_ties_go_to_the_replica_holding_fewer_blocks():
    policy = PrefixAffinity(BS, blocks_per_replica=100)
    policy.record("a", block_hashes(list(range(5 * BS)), BS))
    assert policy.least_loaded({"a": 0, "b": 0}) == "b"
    assert policy.least_loaded({"a": 0, "b": 1}) == "a"


@pytest.mark.parametrize("seed", range(3))
def test_a_session_key_keeps_to_one_replica_and_only_its_replicas_keys_move(seed):
    rng = random.Random(seed)
    policy = SessionAffinity(imbalance_threshold=4)
    keys = [f"user-{rng.randrange(10**9)}" for _ in range(200)]
    three = {"a": 0, "b": 0, "c": 0}
    homes = {k: policy.choose(k, three) for k in keys}
    assert all(policy.choose(k, three) == homes[k] for k in keys)
    assert min(Counter(homes.values()).values()) > 40  # spread over all three
    without_c = {k: policy.choose(k, {"a": 0, "b": 0}) for k in keys}
    assert all(without_c[k] == homes[k] for k in keys if homes[k] != "c")
    key = keys[0]
    assert policy.choose(key, {**three, homes[key]: 5}) != homes[key]  # overloaded: moves
