"""Continuous batching under a token budget, vLLM v1's single rule.

Each request has ``num_computed_tokens`` and ``num_tokens``; every step hands out tokens so that the
first catches up with the second: running requests first, then waiting ones in arrival order. Chunked
prefill, prefix-cache hits, decode and recompute after preemption are all that one rule.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pagedserve.config import SchedulerConfig
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]

    @property
    def completes_sequence(self) -> bool:
        """After this step every known token is computed, so a next token is sampled."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens == req.num_tokens


@dataclass
class SchedulerOutput:
    """What one step computes: the boundary between deciding and computing."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.page_copies = self.block_manager.take_pending_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(req, n):
                victim = self.running.pop()  # the most recently admitted request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._scheduled(req, n))
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        seats = self.config.max_num_seqs - sum(_num_seats(r) for r in self.running)
        skipped: list[Request] = []  # waiting for their grammars: they keep their places
        while self.waiting and budget > 0 and _num_seats(self.waiting[0]) <= seats:
            req = self.waiting[0]
            if req.waiting_for_grammar:
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_hit = [], 0
            if req.sampling_params.prompt_logprobs is None:  # cached positions would have none
                computed_blocks, num_hit = self.block_manager.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            if not self.block_manager.allocate_slots(req, n, computed_blocks):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n
            seats -= _num_seats(req)
        self.waiting.extendleft(reversed(skipped))

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(req, n, self.block_manager.get_block_table(req.request_id))

    def preempt(self, req: Request) -> None:
        """Take a running request back to the front of the queue, its pages freed (recompute)."""
        self.running.remove(req)
        self._preempt(req)

    def _preempt(self, req: Request) -> None:
        """Free the request's pages; it recomputes from scratch (prefix caching may help) later."""
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s", req.request_id)

    def admit_forked(self, child: Request) -> None:
        """A child of an ``n > 1`` request that shares its parent's pages joins the running set."""
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and return its pages; idempotent."""
        assert status.finished
        if req in self.running:
            self.running.remove(req)
            self.block_manager.free(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status


def _num_seats(req: Request) -> int:
    """Seats in the running batch a request takes: an ``n > 1`` request that has not sampled yet
    forks its ``n - 1`` siblings into the batch when it does."""
    return req.sampling_params.n if not req.output_token_ids else 1
