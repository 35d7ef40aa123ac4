"""The request routers of the engine replicas, on Ray Serve's public ``RequestRouter`` API.

Each runs in the ingress's process (the handle to the engine deployment creates it there) and
sees each request's arguments: ``EngineReplica.generate(request_id, prompt_token_ids, params,
prompt, session=..., exclude=...)``. Every router also keeps what the replicas report every
second (``EngineReplica.record_routing_stats``: the engine's figures and whether its core lives),
which the ingress reads for ``/health`` and ``/metrics`` (``ingress.ROUTERS``), and never sends a
request to a replica whose engine core is dead while another lives.

Policies (``--request-router``):
- ``prefix-aware`` (``PrefixAwareRouter``): to the replica where the request costs the fewest
  tokens of prefill: those queued there (requests sent that have had no output yet, as the
  ingress reports their first ones) plus twice those of the prompt whose blocks its prefix cache
  most likely lacks (``affinity.PrefixAffinity``); none past the imbalance threshold;
- ``session`` (``SessionRouter``): a request with a session key to the key's replica, one without
  as ``prefix-aware``;
- ``power-of-two`` (``PowerOfTwoRouter``): Ray Serve's default procedure, two replicas at random
  and the one with the shorter queue.

Ray's own ``PrefixCacheAffinityRouter`` is not used: its public import (``ray.serve.llm``) pulls
in vLLM and pyarrow, and it matches the prompt's characters in a detached actor that every
routing decision waits on, where the token ids are at hand here.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from pagedserve.entrypoints.ray_serve.affinity import (
    DEFAULT_IMBALANCE_THRESHOLD,
    PrefixAffinity,
    SessionAffinity,
    block_hashes,
)

GENERATE = "generate"
PENDING_EXPIRY_S = 10.0


class EngineRouter(RequestRouter):
    """What every policy shares: requests in flight per replica, the replicas' reports, and the
    candidates a request may go to."""

    def initialize_state(
        self,
        block_size: int = 16,
        blocks_per_replica: int = 4096,
        imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
    ) -> None:
        self.in_flight: Counter[ReplicaID] = Counter()
        # requests chosen a replica but not sent yet (Ray routes a burst of them concurrently:
        # each must see the ones before it), by internal request id: (replica, when chosen)
        self.pending: dict[str, tuple[ReplicaID, float]] = {}
        # generate calls that have not had their first output: request id -> (replica, tokens
        # it has to prefill for it, when chosen); the ingress says when the first output comes
        self.prefilling: dict[str, tuple[ReplicaID, int, float]] = {}
        self.request_ids: dict[str, str] = {}  # internal request id -> generate's request id
        self.prefix = PrefixAffinity(block_size, blocks_per_replica, imbalance_threshold)
        self.session = SessionAffinity(imbalance_threshold)
        self.num_routed: Counter[str] = Counter()  # generate calls by replica, since start
        # the ingress reads the replicas' reports here; imported now, not with this module,
        # which Ray Serve ships by value (its globals copied, the ingress's registry with them)
        import pagedserve.entrypoints.ray_serve.ingress as ingress

        deployment = self._deployment_id  # noqa: SLF001 - set by RequestRouter's constructor
        ingress.ROUTERS[(deployment.app_name, deployment.name)] = self

    # ---- what the replicas report ----------------------------------------------------------------
    def replica_reports(self) -> list[dict[str, Any]]:
        """Each replica's last report (``EngineReplica.record_routing_stats``) with its id and
        node; a replica that has not reported yet reports nothing but those."""
        return [
            {
                "replica": replica_id.unique_id,
                "node_id": replica.node_id,
                "num_routed": self.num_routed[replica_id.unique_id],
                **replica.routing_stats,
            }
            for replica_id, replica in self.curr_replicas.items()
        ]

    def candidates(
        self, replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[RunningReplica]:
        """The replicas a request may go to: not the ones the request was refused by (its
        ``exclude``), and not one whose engine core is dead while another's lives."""
        exclude = set(pending_request.kwargs.get("exclude", ())) if pending_request else set()
        allowed = [r for r in replicas if r.replica_id.unique_id not in exclude] or replicas
        alive = [r for r in allowed if r.routing_stats.get("engine_alive", True)]
        return alive or allowed

    def load(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests in flight on each replica, counting those chosen for it and not sent yet."""
        now = time.monotonic()
        for request_id, (_, when) in list(self.pending.items()):
            if now - when > PENDING_EXPIRY_S:  # cancelled before it was sent
                del self.pending[request_id]
        chosen = Counter(replica_id for replica_id, _ in self.pending.values())
        return {r.replica_id: self.in_flight[r.replica_id] + chosen[r.replica_id] for r in replicas}

    def queued(self) -> Counter[ReplicaID]:
        """The tokens each replica has yet to prefill for the requests sent to it."""
        now = time.monotonic()
        queued: Counter[ReplicaID] = Counter()
        for request_id, (replica_id, tokens, when) in list(self.prefilling.items()):
            if now - when > PENDING_EXPIRY_S * 6:  # its end went unreported: not waiting now
                self.prefilling.pop(request_id, None)
            else:
                queued[replica_id] += tokens
        return queued

    def prefilled(self, request_id: str) -> None:
        """The request's first output has come (the ingress calls this)."""
        self.prefilling.pop(request_id, None)

    def by_load(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        load = self.load(replicas)
        return sorted(replicas, key=lambda r: load[r.replica_id])

    def choose(self, pending_request: PendingRequest | None, replica: RunningReplica) -> None:
        """``replica`` is the first choice for the request: count it there until it is sent."""
        if pending_request is None:
            return
        now = time.monotonic()
        self.pending[pending_request.metadata.internal_request_id] = (replica.replica_id, now)
        if pending_request.metadata.call_method == GENERATE:
            self.expect_prefill(pending_request, replica.replica_id, now)

    def expect_prefill(self, pending_request: PendingRequest, replica_id: ReplicaID, now: float):
        ids = prompt_token_ids(pending_request)
        tokens = self.prefix.num_uncached(replica_id, ids, self.prefix_hashes(pending_request))
        self.prefilling[pending_request.args[0]] = (replica_id, tokens, now)

    # ---- Ray Serve's hooks ------------------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        self.prefix.forget(gone)
        for replica_id in gone:
            self.in_flight.pop(replica_id, None)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        internal_id = pending_request.metadata.internal_request_id
        self.pending.pop(internal_id, None)
        self.in_flight[replica_id] += 1
        if pending_request.metadata.call_method == GENERATE:
            self.num_routed[replica_id.unique_id] += 1
            request_id = pending_request.args[0]
            self.request_ids[internal_id] = request_id
            chosen = self.prefilling.get(request_id)
            if chosen is None or chosen[0] != replica_id:  # not the first choice: recount
                self.expect_prefill(pending_request, replica_id, time.monotonic())
            replica = self.curr_replicas.get(replica_id)
            capacity = replica.routing_stats.get("num_kv_pages") if replica else None
            self.prefix.record(replica_id, self.prefix_hashes(pending_request), capacity)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1
        request_id = self.request_ids.pop(internal_request_id, None)
        if request_id is not None:
            self.prefilling.pop(request_id, None)

    def prefix_hashes(self, pending_request: PendingRequest) -> list[int]:
        return block_hashes(prompt_token_ids(pending_request), self.prefix.block_size)


class PrefixAwareRouter(EngineRouter):
    """To the replica whose prefix cache most likely holds the prompt's leading blocks; the
    others follow, least loaded first, should it be full."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        replicas = self.candidates(candidate_replicas, pending_request)
        if not replicas:
            return []
        first = self.first_choice(replicas, pending_request)
        self.choose(pending_request, first)
        return [[first], [r for r in self.by_load(replicas) if r is not first]]

    def first_choice(
        self, replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> RunningReplica:
        by_id = {r.replica_id: r for r in replicas}
        load = self.load(replicas)
        if pending_request is None or pending_request.metadata.call_method != GENERATE:
            return by_id[self.prefix.least_loaded(load)]
        chosen, _ = self.prefix.choose(prompt_token_ids(pending_request), load, self.queued())
        return by_id[chosen]


class SessionRouter(PrefixAwareRouter):
    """A request with a session key to the key's replica; one without as ``prefix-aware``."""

    def first_choice(
        self, replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> RunningReplica:
        key = pending_request.kwargs.get("session") if pending_request else None
        if not key:
            return super().first_choice(replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in replicas}
        load = {r.replica_id.unique_id: n for r, n in zip(replicas, self.load(replicas).values())}
        return by_id[self.session.choose(key, load)]


class PowerOfTwoRouter(FIFOMixin, EngineRouter):
    """Ray Serve's default procedure (its PowerOfTwoChoicesRequestRouter, whose import path is
    internal): two replicas at random, the one with the shorter queue; requests in order."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        replicas = self.candidates(candidate_replicas, pending_request)
        return [random.sample(replicas, min(2, len(replicas)))] if replicas else []


def prompt_token_ids(pending_request: PendingRequest) -> list[int]:
    """``EngineReplica.generate``'s second argument."""
    return pending_request.args[1]


POLICIES = {
    "prefix-aware": PrefixAwareRouter,
    "session": SessionRouter,
    "power-of-two": PowerOfTwoRouter,
}
