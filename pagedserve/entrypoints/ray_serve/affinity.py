"""Which data-parallel replica a request should go to: the routing policies, without Ray.

``PrefixAffinity`` keeps, for each replica, the chained hashes of the full KV blocks it was sent
(hashed as the engine's prefix cache hashes them, ``engine.block_manager.hash_block_tokens``),
as many as the replica's KV pool holds, least recently sent dropped first: a guess at what its
prefix cache holds. A request goes to the replica where it costs the fewest tokens of prefill:
those queued there, which it waits for, plus twice those of the prompt past the leading blocks
the replica holds, which it waits for and so does every request sent there after it. A
prefix that other prompts branched off counts as held everywhere: a system prompt that many
conversations share is worth computing once on every replica, so it ends up cached on each
instead of pinning all traffic to the replica that saw it first. Past ``imbalance_threshold``
more requests in flight than the least-loaded replica, a replica takes no more.

``SessionAffinity`` sends every request of one session key (the request's ``user``, or the
``X-Session-ID`` header) to one replica by rendezvous hashing: the same replica as long as it
lives, and when replicas come or go only the keys of those move.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from pagedserve.engine.block_manager import hash_block_tokens

Replica = Hashable  # a replica's id, as the router knows it

DEFAULT_IMBALANCE_THRESHOLD = 8  # requests in flight beyond the least-loaded replica's
SHARED_FANOUT = 2  # a block that this many different blocks followed is a shared prefix
# A prompt's uncached tokens delay its own first token and, as much, those of the requests sent
# to its replica after it: counted twice, a follow-up leaves the replica holding its history
# only for a queue there longer than twice the history it would recompute elsewhere (once, it
# left for any queue longer than that history, and its misses then slowed the other replica).
UNCACHED_WEIGHT = 2


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, as the engine's prefix cache keys them."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tuple(token_ids[start : start + block_size])))
    return hashes


class PrefixAffinity:
    def __init__(
        self,
        block_size: int,
        blocks_per_replica: int,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
    ):
        self.block_size = block_size
        self.blocks_per_replica = blocks_per_replica
        self.imbalance_threshold = imbalance_threshold
        self.held: dict[Replica, OrderedDict[int, None]] = {}
        # per block hash, the hashes of the blocks seen after it (up to SHARED_FANOUT of them)
        self.children: OrderedDict[int, set[int]] = OrderedDict()

    # ---- choosing --------------------------------------------------------------------------------
    def choose(
        self,
        token_ids: Sequence[int],
        load: dict[Replica, int],
        queued: dict[Replica, int] | None = None,
    ) -> tuple[Replica, list[int]]:
        """The replica for a prompt among those in ``load`` (replica -> requests in flight), and
        the prompt's block hashes (for ``record`` once it is sent).

        The one where it costs the fewest tokens of prefill: those already ``queued`` there
        (replica -> tokens of requests sent to it that have not had their first token), plus
        ``UNCACHED_WEIGHT`` times those of this prompt it does not hold. A prefix that other
        prompts branched off counts as held everywhere (computed once on each replica, it is);
        ties go to the fewest requests in flight, then to the fewest blocks held. Replicas with
        ``imbalance_threshold`` more requests in flight than the least-loaded one are passed
        over."""
        assert load, "no replica to choose from"
        hashes = block_hashes(token_ids, self.block_size)
        fewest = min(load.values())
        shared = self.num_shared(hashes)
        queued = queued or {}

        def cost(r: Replica) -> tuple[int, int, int]:
            uncached = self.num_uncached(r, token_ids, hashes, shared)
            return queued.get(r, 0) + UNCACHED_WEIGHT * uncached, load[r], len(self.held.get(r, ()))

        costs = {r: cost(r) for r, n in load.items() if n <= fewest + self.imbalance_threshold}
        best = min(costs.values())
        return random.choice([r for r, c in costs.items() if c == best]), hashes

    def num_uncached(
        self,
        replica: Replica,
        token_ids: Sequence[int],
        hashes: list[int],
        shared: int | None = None,
    ) -> int:
        """The prompt's tokens the replica would compute: those past the leading blocks it
        holds, or past the shared prefix (``num_shared``) if that is longer."""
        if shared is None:
            shared = self.num_shared(hashes)
        held = max(self.num_matched(replica, hashes), shared)
        return len(token_ids) - held * self.block_size

    def least_loaded(self, load: dict[Replica, int]) -> Replica:
        """Fewest requests in flight; then fewest blocks held; then chance."""
        fewest = min(load.values())
        tied = [r for r, n in load.items() if n == fewest]
        smallest = min(len(self.held.get(r, ())) for r in tied)
        return random.choice([r for r in tied if len(self.held.get(r, ())) == smallest])

    def num_matched(self, replica: Replica, hashes: list[int]) -> int:
        """How many of the prompt's leading blocks the replica holds."""
        held = self.held.get(replica, {})
        for i, h in enumerate(hashes):
            if h not in held:
                return i
        return len(hashes)

    def num_shared(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` are a prefix that other prompts branched off:
        up to and including the last block that several different blocks followed."""
        shared = 0
        for i, h in enumerate(hashes):
            if len(self.children.get(h, ())) >= SHARED_FANOUT:
                shared = i + 1
        return shared

    # ---- what each replica was sent ------------------------------------------------------------
    def record(self, replica: Replica, hashes: list[int], capacity: int | None = None) -> None:
        """The prompt with these block hashes went to ``replica``, whose prefix cache holds them
        now; it holds ``capacity`` blocks (its KV pages; default ``blocks_per_replica``)."""
        held = self.held.setdefault(replica, OrderedDict())
        for parent, h in zip([None, *hashes], hashes):
            held[h] = None
            held.move_to_end(h)
            if parent is not None:
                self._add_child(parent, h)
        while len(held) > (capacity or self.blocks_per_replica):
            held.popitem(last=False)
        while len(self.children) > self.blocks_per_replica * max(len(self.held), 1):
            self.children.popitem(last=False)

    def _add_child(self, parent: int, child: int) -> None:
        children = self.children.setdefault(parent, set())
        if len(children) < SHARED_FANOUT:
            children.add(child)
        self.children.move_to_end(parent)

    def forget(self, replicas: Iterable[Replica]) -> None:
        """Replicas that are gone (their successors start with an empty cache)."""
        for r in replicas:
            self.held.pop(r, None)


class SessionAffinity:
    """Rendezvous (highest random weight) hashing of a session key over the replicas."""

    def __init__(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD):
        self.imbalance_threshold = imbalance_threshold

    def choose(self, key: str, load: dict[Replica, int]) -> Replica:
        """The key's replica among those in ``load``, unless it has ``imbalance_threshold`` more
        requests in flight than the least-loaded one (which then takes the request)."""
        assert load, "no replica to choose from"
        home = max(load, key=lambda r: _weight(key, r))
        least = min(load, key=load.__getitem__)
        return least if load[home] > load[least] + self.imbalance_threshold else home


def _weight(key: str, replica: Replica) -> int:
    digest = hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
