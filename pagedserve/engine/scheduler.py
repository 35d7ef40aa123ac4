"""Continuous batching under a token budget, vLLM v1's single rule.

Each request has ``num_computed_tokens`` and ``num_tokens``; every step hands out tokens so that the
first catches up with the second: running requests first, then waiting ones in arrival order. Chunked
prefill, prefix-cache hits, decode and recompute after preemption are all that one rule.

A preempted request either recomputes (its pages freed, ``num_computed_tokens`` back to 0) or is
swapped out (its pages copied to the host tier, ``num_computed_tokens`` kept), as
``--preemption-mode`` and ``swap_policy`` decide; either way it waits at the front of the queue,
and a swapped one comes back by copy. A step that preempts admits nobody, so no step both swaps
out and swaps in (vLLM v0's rule).

Speculative decoding changes one thing: a running request's ``num_tokens_with_spec`` counts its
drafts, so they are scheduled (and their KV slots allocated) as extra tokens under the same
budget; a budget that cuts them short drops the drafts it has no room for. After the step the
engine rolls ``num_computed_tokens`` back past the rejected drafts and returns their pages
(``BlockManager.trim``). A preempted request loses its drafts.

LoRA: the running requests use at most ``max_loras`` distinct adapters (the device slots); a
waiting request for another adapter keeps its place in the queue until one of them has no
running request left, and the requests behind it may go first (vLLM's rule).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pagedserve.config import SchedulerConfig
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.swap_policy import PreemptionCosts, should_swap

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]
    spec_token_ids: list[int] = field(default_factory=list)  # the drafts this step verifies

    @property
    def completes_sequence(self) -> bool:
        """After this step every known token (and every draft) is computed, so a next token is
        sampled (and the drafts verified)."""
        req = self.request
        num_done = req.num_computed_tokens + self.num_new_tokens
        return num_done == req.num_tokens + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    """What one step computes: the boundary between deciding and computing."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # swapped out or to recompute
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (KV page, host frame)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host frame, KV page)
    # LoRA: the adapters moved into device slots before the step (slot, adapter id), and the
    # slot of each adapter the step runs (the engine fills them in)
    lora_loads: list[tuple[int, int]] = field(default_factory=list)
    lora_slot_of: dict[int, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_page_moves(self) -> bool:
        """Copies the runner must do even when nothing is scheduled (a step that only preempts
        swaps its victims out all the same)."""
        return bool(self.swap_out or self.swap_in or self.page_copies)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_loras: int = 0):
        self.config = config
        self.max_loras = max_loras  # distinct adapters among the running requests (0: none)
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.costs = PreemptionCosts()  # the engine feeds it each step's measured times
        self.num_preemptions = 0
        self.num_swapped_preemptions = 0  # of those, the ones swapped out
        self.num_recomputed_tokens = 0  # tokens computed again after a preemption freed them

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self.block_manager.moves_done()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.page_copies = self.block_manager.take_pending_copies()
        out.swap_out, out.swap_in = self.block_manager.take_pending_swaps()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if req.spec_token_ids:  # the drafts the budget has room for
                del req.spec_token_ids[max(req.num_computed_tokens + n - req.num_tokens, 0) :]
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
        skipped: list[Request] = []  # waiting for their grammars or adapters: they keep places
        loras = self.running_loras()
        while self.waiting and budget > 0 and _num_seats(self.waiting[0]) <= seats:
            req = self.waiting[0]
            if req.waiting_for_grammar or self._waits_for_lora(req, loras):
                skipped.append(self.waiting.popleft())
                continue
            if req.status is RequestStatus.SWAPPED:
                n = self._swap_in(req, budget)
            else:
                n = self._allocate_waiting(req, budget)
            if n is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n))
            budget -= n
            seats -= _num_seats(req)
            loras.add(req.lora_int_id)
        self.waiting.extendleft(reversed(skipped))

    def running_loras(self) -> set[int]:
        """The adapters of the running requests (0, the base model, among them if it runs)."""
        return {r.lora_int_id for r in self.running}

    def _waits_for_lora(self, req: Request, loras: set[int]) -> bool:
        """Whether admitting ``req`` would run one adapter more than ``max_loras``."""
        lora_id = req.lora_int_id
        return bool(lora_id) and lora_id not in loras and len(loras - {0}) >= self.max_loras

    def _allocate_waiting(self, req: Request, budget: int) -> int | None:
        """Pages for a waiting request's prefix hits and first tokens: how many tokens it gets
        this step, or None when the pages do not suffice."""
        bm, computed_blocks, num_hit = self.block_manager, [], 0
        look_up = req.sampling_params.prompt_logprobs is None  # cached positions would have none
        if look_up:
            computed_blocks, num_hit = bm.get_computed_blocks(req)
        n = min(req.num_tokens - num_hit, budget)
        if not bm.allocate_slots(req, n, computed_blocks):
            return None
        if look_up:
            bm.record_prefix_lookup(req, computed_blocks)
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = num_hit
        return n

    def _swap_in(self, req: Request, budget: int) -> int | None:
        """A swapped-out request's pages back from the host tier, and its next tokens."""
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        return n if self.block_manager.swap_in(req, n) else None

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        if start < req.num_lost_tokens:  # computing again what a preemption threw away
            self.num_recomputed_tokens += min(start + n, req.num_lost_tokens) - start
        table = self.block_manager.get_block_table(req.request_id)
        return ScheduledRequest(req, n, table, list(req.spec_token_ids))

    def preempt(self, req: Request) -> None:
        """Take a running request back to the front of the queue to recompute: its pages are
        freed whatever the preemption mode (their contents are not trusted)."""
        self.running.remove(req)
        self._preempt(req, recompute=True)

    def _preempt(self, req: Request, recompute: bool = False) -> None:
        """Swap the request's pages out, or free them: it recomputes from scratch later (prefix
        caching may help)."""
        bm = self.block_manager
        req.spec_token_ids.clear()  # drafted for a next step it no longer gets
        num_pages, num_tokens = bm.num_pages_to_swap(req), req.num_computed_tokens
        mode = "recompute" if recompute else self.config.preemption_mode
        if bm.can_swap_out(req) and should_swap(mode, self.costs, num_pages, num_tokens):
            bm.swap_out(req)
            req.status = RequestStatus.SWAPPED
            self.num_swapped_preemptions += 1
        else:
            bm.free(req)
            self._forget_computed(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (%s)", req.request_id, req.status.value)

    def _forget_computed(self, req: Request) -> None:
        req.num_lost_tokens = max(req.num_lost_tokens, req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED

    def recompute_swapped(self, req: Request) -> None:
        """A swapped-out request whose host frames are no longer trusted recomputes instead; it
        keeps its place in the queue."""
        assert req.status is RequestStatus.SWAPPED, f"{req.request_id} is not swapped out"
        self.block_manager.free_swapped(req)
        self._forget_computed(req)

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
            if req.status is RequestStatus.SWAPPED:
                self.block_manager.free_swapped(req)
        req.status = status

    @property
    def swapped(self) -> list[Request]:
        """Waiting requests whose pages are in the host tier."""
        return [r for r in self.waiting if r.status is RequestStatus.SWAPPED]


def _num_seats(req: Request) -> int:
    """Seats in the running batch a request takes: an ``n > 1`` request that has not sampled yet
    forks its ``n - 1`` siblings into the batch when it does."""
    return req.sampling_params.n if not req.output_token_ids else 1
