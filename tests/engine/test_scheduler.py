"""The scheduler's limits, checked on every ``SchedulerOutput`` of random workloads.

A driver does around ``Scheduler.schedule()`` what ``LLMEngine`` does around a step: requests
arrive at given steps, scheduled tokens become computed, a request whose sequence is complete
samples one token (its ``n - 1`` siblings fork off it the first time), a request finishes at
``max_tokens``, and some requests are aborted. The driver keeps its own record of who was admitted
when and of the waiting queue's order, and checks the scheduler's decisions against it:

- never more than ``max_num_seqs`` running or scheduled, never more than
  ``max_num_batched_tokens`` scheduled tokens, running requests included;
- a request gets fewer tokens than it needs only when the token budget is spent (so a prompt
  longer than the budget is chunked over several steps, and no budget is left idle);
- running requests go first, in admission order; waiting ones are admitted in queue order; the
  prefix-cache counters count each admission's lookup once, however often the queue's head
  waited for pages;
- when pages run out, the requests preempted are the most recently admitted running ones; each
  is swapped out to the host tier (its computed tokens kept) or freed to recompute (back to 0),
  as the preemption mode says and the host tier's room allows;
- every page move runs before the step that needs it, in the runner's order: the driver keeps
  the token each KV slot and each host frame holds, and after every step every computed token of
  a running request is in its page, every token of a swapped-out one is in its host frames, and
  every cached block (in either tier) holds the tokens it is cached for;
- every request finishes within a bound of steps, and every page and frame returns to its pool;
- with speculative decoding (``num_speculative_tokens``), the same, drafts included: a running
  request's drafts are scheduled as extra tokens under the budget (dropped only when it runs out),
  their KV slots written; the driver verifies them against its own next-token rule, rolls back
  the rejected ones and returns their pages, as the engine does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.config import SchedulerConfig
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.scheduler import Scheduler, SchedulerOutput
from pagedserve.engine.swap_policy import PreemptionCosts
from pagedserve.sampling_params import SamplingParams


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    max_tokens: int
    n: int = 1
    abort_step: int | None = None
    prompt_logprobs: bool = False  # such a request computes its whole prompt: no prefix hits


@dataclass
class Group:
    """One user request: its ``n`` sequences, of which ``pending_forks`` have not forked yet."""

    arrival: Arrival
    seqs: list[Request]
    pending_forks: list[Request]
    aborted: bool = False

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs) and not self.pending_forks


@dataclass
class Driver:
    """``LLMEngine``'s step loop around a real ``Scheduler`` and ``BlockManager``, no model."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_pages: int
    block_size: int
    enable_prefix_caching: bool = True
    fault_steps: frozenset[int] = frozenset()  # steps that preempt the oldest, as a KV fault does
    preemption_mode: str = "recompute"
    num_swap_frames: int = 0
    num_host_cache_frames: int = 0
    host_fault_steps: frozenset[int] = frozenset()  # steps that corrupt a swapped-out request
    num_speculative_tokens: int = 0  # drafts a running request proposes (some of them wrong)
    step_count: int = 0
    groups: list[Group] = field(default_factory=list, repr=False)
    admitted: list[Request] = field(default_factory=list, repr=False)  # running, in admission order
    queue: list[Request] = field(default_factory=list, repr=False)  # waiting, in the order due
    first_admissions: list[Request] = field(default_factory=list, repr=False)
    outputs: list[SchedulerOutput] = field(default_factory=list, repr=False)
    samplers: list[list[Request]] = field(default_factory=list, repr=False)  # per step
    preemptions_of: dict[str, int] = field(default_factory=dict, repr=False)
    first_scheduled: dict[str, float] = field(default_factory=dict, repr=False)
    num_preemptions: int = 0
    prefix_lookups: list[int] = field(default_factory=lambda: [0, 0])  # tokens queried, hit
    proposed: dict[str, int] = field(default_factory=dict, repr=False)  # drafts, before the budget
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # the most tokens of a request computed before a preemption freed them, and the tokens
    # scheduled again below that mark
    lost: dict[str, int] = field(default_factory=dict, repr=False)
    num_recomputed_tokens: int = 0

    def __post_init__(self) -> None:
        host_cache = self.num_host_cache_frames if self.enable_prefix_caching else 0
        self.bm = BlockManager(
            self.num_pages,
            self.block_size,
            self.enable_prefix_caching,
            self.num_swap_frames,
            host_cache,
        )
        config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            preemption_mode=self.preemption_mode,
        )
        self.scheduler = Scheduler(config, self.bm)
        # what each KV slot and each host frame's slot holds, as the runner would leave it
        self.kv = [[None] * self.block_size for _ in range(self.num_pages)]
        num_frames = self.num_swap_frames + host_cache
        self.host_kv = [[None] * self.block_size for _ in range(num_frames)]

    # ---- what the engine does

    def add(self, arrival: Arrival) -> None:
        rid = f"r{len(self.groups)}"
        seqs = [
            Request(
                rid if i == 0 else f"{rid}#{i}",
                list(arrival.prompt),
                SamplingParams(
                    n=arrival.n,
                    max_tokens=arrival.max_tokens,
                    prompt_logprobs=1 if arrival.prompt_logprobs else None,
                ),
            )
            for i in range(arrival.n)
        ]
        self.groups.append(Group(arrival, seqs, seqs[1:]))
        self.scheduler.add_request(seqs[0])
        self.queue.append(seqs[0])

    def abort(self, group: Group) -> None:
        group.aborted = True
        group.pending_forks.clear()
        for seq in group.seqs:
            if not seq.status.finished:
                self.scheduler.finish_request(seq, RequestStatus.FINISHED_ABORTED)
                assert seq.status is RequestStatus.FINISHED_ABORTED
                assert seq not in self.scheduler.running and seq not in self.scheduler.waiting
                assert seq.request_id not in self.bm.block_tables
                self._forget(seq)

    def step(self) -> SchedulerOutput:
        for group in self.groups:
            if group.arrival.abort_step == self.step_count and not group.finished:
                self.abort(group)
        for arrival in self.arrivals_now():
            self.add(arrival)
        if self.step_count in self.fault_steps and self.admitted:
            self.fault(self.admitted[0])
        if self.step_count in self.host_fault_steps and self.scheduler.swapped:
            self.host_fault(self.scheduler.swapped[0])
        running_before = list(self.admitted)
        self.computed_before = {r.request_id: r.num_computed_tokens for r in running_before}
        swapped_before = set(map(id, self.scheduler.swapped))
        out = self.scheduler.schedule()
        self.check(out, running_before, swapped_before)
        self.outputs.append(out)
        self.run_model(out)
        completing = [s for s in out.scheduled if s.completes_sequence]
        samplers = [s.request for s in completing]
        self.samplers.append(samplers)
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        self.bm.moves_done()
        for s in completing:
            for seq in [s.request, *self.fork(s.request)]:
                self.verify(seq, s.spec_token_ids if seq is s.request else [])
        self.check_contents()
        self.step_count += 1
        return out

    def run_model(self, out: SchedulerOutput) -> None:
        """The runner's page moves in its order, then the forward pass's KV writes."""
        for page, frame in out.swap_out:
            self.host_kv[frame] = list(self.kv[page])
        for frame, page in out.swap_in:
            self.kv[page] = list(self.host_kv[frame])
        for src, dst in out.page_copies:
            self.kv[dst] = list(self.kv[src])
        bs = self.block_size
        for s in out.scheduled:
            start = s.request.num_computed_tokens
            tokens = s.request.all_token_ids + s.spec_token_ids
            for pos in range(start, start + s.num_new_tokens):
                self.kv[s.block_table[pos // bs]][pos % bs] = tokens[pos]

    def check_contents(self) -> None:
        """Every computed token where its sequence will read it; every cached block true."""
        bs = self.block_size
        for r in self.scheduler.running:
            table = self.bm.get_block_table(r.request_id)
            for pos in range(r.num_computed_tokens):
                assert self.kv[table[pos // bs]][pos % bs] == r.all_token_ids[pos], (r, pos)
        for r in self.scheduler.swapped:
            frames = self.bm.host.block_tables[r.request_id]
            assert len(frames) == -(-r.num_computed_tokens // bs)
            for pos in range(r.num_computed_tokens):
                assert self.host_kv[frames[pos // bs]][pos % bs] == r.all_token_ids[pos], (r, pos)
        for page, block in self.bm.page_to_cached_block.items():
            computed = any(
                page in self.bm.block_tables.get(r.request_id, ())
                and r.num_computed_tokens
                < (self.bm.get_block_table(r.request_id).index(page) + 1) * bs
                for r in self.scheduler.running
            )
            if not computed:  # (a block registered this step may still await its tokens)
                assert tuple(self.kv[page]) == block.token_ids, page
        if self.bm.host is not None:
            for frame, block in self.bm.host.frame_to_cached_block.items():
                assert tuple(self.host_kv[frame]) == block.token_ids, frame
        assert self.bm.check_invariants() == []

    def host_fault(self, victim: Request) -> None:
        """What the engine does when the device reports a corrupt host frame under a swapped-out
        request: the frame's contents are garbage, and the request recomputes."""
        frame = self.bm.host.block_tables[victim.request_id][0]
        self.host_kv[frame] = [-1] * self.block_size
        self.lose(victim, victim.num_computed_tokens)
        assert victim.request_id in self.bm.drop_host_frames([frame])
        self.scheduler.recompute_swapped(victim)
        assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
        assert not self.bm.is_swapped(victim) and self.scheduler.waiting.count(victim) == 1

    def fault(self, victim: Request) -> None:
        """What the engine does when a device reports a corrupt page under a running request."""
        self.lose(victim, victim.num_computed_tokens)
        self.scheduler.preempt(victim)
        assert not victim.spec_token_ids, "a preempted request keeps its drafts"
        self.proposed.pop(victim.request_id, None)
        assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
        assert victim.request_id not in self.bm.block_tables
        assert self.scheduler.waiting[0] is victim and victim not in self.scheduler.running
        self.admitted.remove(victim)
        self.queue.insert(0, victim)
        self.num_preemptions += 1
        self.preemptions_of[victim.request_id] = self.preemptions_of.get(victim.request_id, 0) + 1

    def fork(self, parent: Request) -> list[Request]:
        group = self.group_of(parent)
        if parent is not group.seqs[0] or not group.pending_forks:
            return []
        children, group.pending_forks = group.pending_forks, []
        for child in children:
            self.bm.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.admit_forked(child)
            self.admitted.append(child)
        return children

    def verify(self, seq: Request, drafts: list[int]) -> None:
        """The engine's verification: the sequence's tokens by the next-token rule, one per
        draft it matches plus one; the rejected drafts rolled back and their pages returned;
        then its drafts for the next step."""
        seq.spec_token_ids = []
        seq.num_computed_tokens -= len(drafts)  # each accepted draft counts again below
        self.num_draft_tokens += len(drafts)
        for j in range(len(drafts) + 1):
            accepted = j < len(drafts) and self.next_token(seq) == drafts[j]
            self.sample(seq)
            if seq.status.finished:
                return
            if not accepted:
                break
            seq.num_computed_tokens += 1
            self.num_accepted_tokens += 1
        self.bm.trim(seq)
        assert len(self.bm.get_block_table(seq.request_id)) <= -(-seq.num_tokens // self.block_size)
        self.propose(seq)

    def propose(self, seq: Request) -> None:
        """Up to ``num_speculative_tokens`` drafts: the true continuation, wrong from a
        position that depends on the step (some steps all right, some none)."""
        room = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
        k = min((self.step_count + len(seq.request_id)) % (self.num_speculative_tokens + 1), room)
        wrong_from = (self.step_count * 5 + seq.num_tokens) % (self.num_speculative_tokens + 2)
        drafts = []
        for i in range(max(k, 0)):
            token = ((seq.num_tokens + i) * 7 + seq.num_output_tokens + i) % 3
            drafts.append(token if i < wrong_from else (token + 1) % 3)
        seq.spec_token_ids = drafts
        self.proposed[seq.request_id] = len(drafts)

    def sample(self, seq: Request) -> None:
        seq.append_output_token(self.next_token(seq))
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            self.scheduler.finish_request(seq, RequestStatus.FINISHED_LENGTH)
            assert seq not in self.scheduler.running and seq.request_id not in self.bm.block_tables
            self._forget(seq)

    def next_token(self, seq: Request) -> int:
        """A deterministic token, shared by siblings at first so that prefixes repeat."""
        return (seq.num_tokens * 7 + seq.num_output_tokens) % 3

    # ---- bookkeeping

    def arrivals_now(self) -> list[Arrival]:
        return [a for a in self.pending_arrivals if a.step == self.step_count]

    def group_of(self, seq: Request) -> Group:
        return next(g for g in self.groups if seq in g.seqs)

    def lose(self, seq: Request, num_computed: int) -> None:
        """A preemption freed ``seq``'s ``num_computed`` computed tokens: it computes them again."""
        self.lost[seq.request_id] = max(self.lost.get(seq.request_id, 0), num_computed)

    def _forget(self, seq: Request) -> None:
        if seq in self.admitted:
            self.admitted.remove(seq)
        if seq in self.queue:
            self.queue.remove(seq)

    def run(self, arrivals: list[Arrival]) -> None:
        """Step until every request has finished; a request that starves fails the bound."""
        self.pending_arrivals = arrivals
        last_arrival = max(a.step for a in arrivals)
        max_steps = self.step_bound(arrivals)
        while self.step_count <= last_arrival or self.scheduler.has_unfinished_requests():
            assert self.step_count < max_steps, (
                f"a request starved: not finished after {max_steps} steps: running "
                f"{[r.request_id for r in self.scheduler.running]}, waiting "
                f"{[r.request_id for r in self.scheduler.waiting]}"
            )
            self.step()

    # ---- the checks, on every SchedulerOutput

    def check(
        self, out: SchedulerOutput, running_before: list[Request], swapped_before: set[int]
    ) -> None:
        sched = self.scheduler
        budget = self.max_num_batched_tokens
        assert len(sched.running) <= self.max_num_seqs, "more running than max_num_seqs"
        assert len(out.scheduled) <= self.max_num_seqs, "more scheduled than max_num_seqs"
        assert out.total_num_scheduled_tokens == spent_tokens(out) <= budget, "budget exceeded"
        assert out.is_empty == (not out.scheduled)
        # copy-on-write copies and swaps go to the runner with the step that needs them
        assert not self.bm.pending_copies, "copy-on-write copies left behind"
        assert self.bm.take_pending_swaps() == ([], []), "page moves left behind"
        written = {p for sr in out.scheduled for p in sr.block_table}
        assert isinstance(out.page_copies, list)
        assert all(dst in written for _, dst in out.page_copies)
        assert all(dst in written for _, dst in out.swap_in)
        if out.preempted:
            assert not out.swap_in, "a step that preempts swaps nothing in"
        if self.bm.host is None:
            assert not out.swap_out and not out.swap_in
        assert len({id(s.request) for s in out.scheduled}) == len(out.scheduled)
        self.check_preemptions(out, running_before)
        survivors = [r for r in running_before if r not in out.preempted]
        scheduled = [s.request for s in out.scheduled]
        num_old = sum(r in survivors for r in scheduled)
        assert scheduled[:num_old] == survivors[:num_old], "running requests go first, in order"
        admitted_now = scheduled[num_old:]
        assert admitted_now == self.queue[: len(admitted_now)], "admission out of queue order"
        if out.preempted:
            assert not admitted_now, "admitted a waiting request in a step that preempted"
        self.check_tokens(out)
        self.check_work_conserving(out, scheduled)
        self.check_recomputed(out)
        for r in admitted_now:
            self.queue.remove(r)
            self.admitted.append(r)
            if id(r) in swapped_before:  # came back by copy, its computed tokens kept
                assert not self.bm.is_swapped(r)
                continue
            assert r.num_cached_tokens == r.num_computed_tokens, "prefix hit not recorded"
            if r.sampling_params.prompt_logprobs is not None:
                assert r.num_cached_tokens == 0, "cached positions would have no prompt logprobs"
            elif self.enable_prefix_caching:  # each admission's lookup counts once
                self.prefix_lookups[0] += r.num_tokens
                self.prefix_lookups[1] += r.num_cached_tokens
            assert r.num_computed_tokens % self.block_size == 0
            if r.num_preemptions == 0 and r is self.group_of(r).seqs[0]:
                self.first_admissions.append(r)
                assert r.first_scheduled_time is not None
                self.first_scheduled[r.request_id] = r.first_scheduled_time
        assert [self.bm.prefix_cache_queries, self.bm.prefix_cache_hits] == self.prefix_lookups
        assert self.admitted == sched.running
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            assert r.num_preemptions == self.preemptions_of.get(r.request_id, 0)
            if r.request_id in self.first_scheduled:  # kept across preemptions
                assert r.first_scheduled_time == self.first_scheduled[r.request_id]
        for r in sched.waiting:
            assert r.status in (
                RequestStatus.WAITING,
                RequestStatus.PREEMPTED,
                RequestStatus.SWAPPED,
            )
            assert (r.status is RequestStatus.SWAPPED) == self.bm.is_swapped(r)

    def check_preemptions(self, out: SchedulerOutput, running_before: list[Request]) -> None:
        """Each victim is the most recently admitted request still running at that moment."""
        newest_first = list(reversed(running_before))
        assert out.preempted == newest_first[: len(out.preempted)], (
            f"preempted {[r.request_id for r in out.preempted]}, but the most recently admitted "
            f"were {[r.request_id for r in newest_first]}"
        )
        for victim in out.preempted:
            assert not victim.spec_token_ids, "a preempted request keeps its drafts"
            self.proposed.pop(victim.request_id, None)
            assert victim.request_id not in self.bm.block_tables
            if victim.status is RequestStatus.SWAPPED:
                assert self.preemption_mode != "recompute" and self.bm.is_swapped(victim)
                assert victim.num_computed_tokens > 0
            else:
                assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
                self.lose(victim, self.computed_before[victim.request_id])
            self.admitted.remove(victim)
            self.queue.insert(0, victim)
            self.num_preemptions += 1
            self.preemptions_of[victim.request_id] = (
                self.preemptions_of.get(victim.request_id, 0) + 1
            )

    def check_tokens(self, out: SchedulerOutput) -> None:
        """Each request gets at least one token, no more than it lacks, and pages for all."""
        spent = 0
        for i, s in enumerate(out.scheduled):
            req = s.request
            proposed = self.proposed.pop(req.request_id, 0)
            lacking = req.num_tokens + proposed - req.num_computed_tokens
            assert 1 <= s.num_new_tokens <= lacking, (req.request_id, s.num_new_tokens, lacking)
            assert s.spec_token_ids == req.spec_token_ids
            assert req.num_computed_tokens + s.num_new_tokens == req.num_tokens + len(
                s.spec_token_ids
            ) or (not s.spec_token_ids and not s.completes_sequence), "drafts without their token"
            spent += s.num_new_tokens
            if s.num_new_tokens < lacking:  # cut short: only by the end of the token budget
                assert spent == self.max_num_batched_tokens, "a request was cut short needlessly"
                assert i == len(out.scheduled) - 1, "scheduled more after the budget ran out"
            needed = -(-(req.num_computed_tokens + s.num_new_tokens) // self.block_size)
            assert s.block_table == self.bm.get_block_table(req.request_id)
            assert len(s.block_table) >= needed, "scheduled tokens without pages for them"

    def check_recomputed(self, out: SchedulerOutput) -> None:
        """The scheduler counts the positions it schedules below what a preemption lost."""
        for s in out.scheduled:
            start, lost = s.request.num_computed_tokens, self.lost.get(s.request.request_id, 0)
            positions = range(start, start + s.num_new_tokens)
            self.num_recomputed_tokens += sum(1 for pos in positions if pos < lost)
        assert self.scheduler.num_recomputed_tokens == self.num_recomputed_tokens

    def check_work_conserving(self, out: SchedulerOutput, scheduled: list[Request]) -> None:
        """Budget left over while requests lacked tokens: only when pages or seats ran out."""
        if out.total_num_scheduled_tokens == self.max_num_batched_tokens or out.preempted:
            return
        unscheduled = [r for r in self.scheduler.running if r not in scheduled]
        assert not unscheduled, "a running request was left out with budget to spare"
        if not self.scheduler.waiting:
            return
        head = self.scheduler.waiting[0]
        free_seats = self.max_num_seqs - sum(self.seats(r) for r in self.scheduler.running)
        if self.seats(head) > free_seats:
            return
        trial = copy.deepcopy(self.bm)  # the head must not fit the pages left
        left = self.max_num_batched_tokens - spent_tokens(out)
        if head.status is RequestStatus.SWAPPED:
            chunk = min(head.num_tokens - head.num_computed_tokens, left)
            assert not trial.swap_in(head, chunk), "the swapped-out head was left waiting"
            return
        pages, num_hit = [], 0
        if head.sampling_params.prompt_logprobs is None:
            pages, num_hit = trial.get_computed_blocks(head)
        chunk = min(head.num_tokens - num_hit, left)
        assert not trial.allocate_slots(head, chunk, pages), "the queue's head was left waiting"

    def seats(self, seq: Request) -> int:
        """An n > 1 request that has not forked yet will bring its siblings into the batch."""
        group = self.group_of(seq)
        return 1 + len(group.pending_forks) if seq is group.seqs[0] else 1

    # ---- the checks at the end

    def check_finished(self) -> None:
        for group in self.groups:
            assert group.finished, group.seqs[0].request_id
            if not group.aborted:
                for seq in group.seqs:
                    assert seq.status is RequestStatus.FINISHED_LENGTH
                    assert seq.num_output_tokens == group.arrival.max_tokens
        assert not self.scheduler.running and not self.scheduler.waiting
        assert not self.bm.block_tables
        assert self.bm.num_free_pages == self.num_pages
        assert self.bm.allocator.ref_counts == [0] * self.num_pages
        assert self.scheduler.num_preemptions == self.num_preemptions
        host = self.bm.host
        if host is not None:
            assert not host.block_tables and host.num_swapped_frames == 0
            assert host.allocator.num_free_pages == host.num_frames and host.usage == 0.0
        assert self.bm.check_invariants() == []
        if self.preemption_mode == "recompute":
            assert self.scheduler.num_swapped_preemptions == 0

    def step_bound(self, arrivals: list[Arrival]) -> int:
        """The oldest running request is never preempted (it fits the pool alone) and gets
        tokens every step, so each sequence needs at most its own length in steps at the head."""
        last_arrival = max(a.step for a in arrivals)
        lengths = [len(a.prompt) + a.max_tokens for a in arrivals]
        work = sum(a.n * n for a, n in zip(arrivals, lengths))
        faults = len(self.fault_steps) + len(self.host_fault_steps)
        return last_arrival + work + 1 + faults * max(lengths)  # a fault: redo


def spent_tokens(out: SchedulerOutput) -> int:
    return sum(s.num_new_tokens for s in out.scheduled)


# ---- workloads


PREEMPTION_MODES = ("recompute", "swap", "auto")


@st.composite
def workloads(
    draw,
    prefix_caching: bool | None = None,
    preemption_mode: str | None = None,
    speculative: int | None = None,
):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_num_seqs = draw(st.integers(1, 5))
    budget = draw(st.integers(1, 24))
    prefix = draw(st.lists(st.integers(0, 2), max_size=12))
    arrivals = []
    for _ in range(draw(st.integers(1, 8))):
        shared = prefix[: draw(st.integers(0, len(prefix)))]
        tail = draw(st.lists(st.integers(0, 2), min_size=1, max_size=30))
        arrivals.append(
            Arrival(
                step=draw(st.integers(0, 12)),
                prompt=shared + tail,
                max_tokens=draw(st.integers(1, 10)),
                n=draw(st.integers(1, max_num_seqs).map(lambda k: min(k, 3))),
                abort_step=draw(st.none() | st.integers(0, 40)),
                prompt_logprobs=draw(st.booleans()),
            )
        )
    # the engine rejects a request that cannot fit the whole pool alone
    needed = max(-(-(len(a.prompt) + a.max_tokens) // block_size) for a in arrivals)
    num_pages = draw(st.integers(needed, needed + 24))
    caching = draw(st.booleans()) if prefix_caching is None else prefix_caching
    faults = draw(st.frozensets(st.integers(0, 30), max_size=2))
    mode = draw(st.sampled_from(PREEMPTION_MODES)) if preemption_mode is None else preemption_mode
    num_speculative_tokens = draw(st.integers(0, 4)) if speculative is None else speculative
    swap_frames = draw(st.integers(0, 2 * num_pages)) if mode != "recompute" else 0
    driver = Driver(
        max_num_seqs,
        budget,
        num_pages,
        block_size,
        caching,
        faults,
        preemption_mode=mode,
        num_swap_frames=swap_frames,
        num_host_cache_frames=draw(st.integers(0, 16)),
        host_fault_steps=draw(st.frozensets(st.integers(0, 30), max_size=2)),
        num_speculative_tokens=num_speculative_tokens,
    )
    return driver, arrivals


PROPERTY_SETTINGS = settings(max_examples=300, deadline=None)


@PROPERTY_SETTINGS
@given(workloads())
def test_every_step_respects_the_limits_and_every_request_finishes(workload):
    driver, arrivals = workload
    driver.run(arrivals)
    driver.check_finished()
    # no later arrival is admitted before an earlier one (ties: the order they were added)
    order = [driver.groups.index(driver.group_of(r)) for r in driver.first_admissions]
    arrival_order = sorted(order, key=lambda g: driver.groups[g].arrival.step)
    assert [driver.groups[g].arrival.step for g in order] == [
        driver.groups[g].arrival.step for g in arrival_order
    ]


@PROPERTY_SETTINGS
@given(workloads(speculative=3))
def test_with_drafts_every_step_respects_the_limits_and_every_page_returns(workload):
    driver, arrivals = workload
    driver.run(arrivals)
    driver.check_finished()


def test_drafts_are_scheduled_under_the_budget_and_rejected_ones_rolled_back():
    driver = Driver(2, 6, 64, 2, num_speculative_tokens=3)
    run(driver, [Arrival(0, [1, 2, 0] * 3, max_tokens=12), Arrival(0, [2] * 5, max_tokens=9)])
    with_drafts = [s for out in driver.outputs for s in out.scheduled if s.spec_token_ids]
    assert with_drafts, "no step verified drafts"
    assert 0 < driver.num_accepted_tokens < driver.num_draft_tokens
    # fewer steps than one token a step would take
    assert len(driver.outputs) < 1 + 12 + 1


@settings(max_examples=100, deadline=None)
@given(workloads(prefix_caching=False))
def test_pool_large_enough_for_everything_never_preempts(workload):
    driver, arrivals = workload
    total = sum(a.n * -(-(len(a.prompt) + a.max_tokens) // driver.block_size) for a in arrivals)
    driver = Driver(driver.max_num_seqs, driver.max_num_batched_tokens, total, driver.block_size)
    driver.run(arrivals)
    assert driver.num_preemptions == 0
    driver.check_finished()


def test_tight_pool_preempts_and_still_finishes_everything():
    """The smallest pool that holds the longest request alone: preemption is the common case."""
    preemptions = []

    @settings(max_examples=100, deadline=None)
    @given(workloads())
    def run(workload):
        driver, arrivals = workload
        needed = max(-(-(len(a.prompt) + a.max_tokens) // driver.block_size) for a in arrivals)
        driver = Driver(
            driver.max_num_seqs,
            driver.max_num_batched_tokens,
            needed,
            driver.block_size,
            driver.enable_prefix_caching,
        )
        driver.run(arrivals)
        driver.check_finished()
        preemptions.append(driver.num_preemptions)

    run()
    assert sum(1 for n in preemptions if n) >= len(preemptions) // 2, preemptions


# ---- the same rules on hand-made cases


def run(driver: Driver, arrivals: list[Arrival]) -> Driver:
    driver.run(arrivals)
    driver.check_finished()
    return driver


def test_prompt_longer_than_the_budget_is_chunked_over_steps():
    driver = run(Driver(4, 8, 64, 4), [Arrival(0, list(range(3)) * 7, max_tokens=1)])
    assert [o.total_num_scheduled_tokens for o in driver.outputs] == [8, 8, 5]
    assert [len(sampled) for sampled in driver.samplers] == [0, 0, 1]


def test_running_requests_share_the_budget_first_come_first_served():
    driver = Driver(4, 6, 64, 4)
    run(driver, [Arrival(0, [1] * 4, max_tokens=3), Arrival(0, [2] * 9, max_tokens=2)])
    first = driver.outputs[0]
    assert [s.num_new_tokens for s in first.scheduled] == [4, 2]
    assert [s.num_new_tokens for s in driver.outputs[1].scheduled] == [1, 5]


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3])
def test_no_more_than_max_num_seqs_run_at_once(max_num_seqs):
    driver = run(Driver(max_num_seqs, 64, 64, 4), [Arrival(0, [1, 2], 4) for _ in range(5)])
    assert max(len(o.scheduled) for o in driver.outputs) == max_num_seqs


def test_out_of_pages_preempts_the_most_recently_admitted():
    # 3 pages of 2 tokens: three 1-token prompts each need a second page at their third token;
    # r0 gets r2's page, then r1, the newest left, gives way to r0 too
    driver = Driver(4, 64, 3, 2, enable_prefix_caching=False)
    run(driver, [Arrival(0, [i], max_tokens=3) for i in range(3)])
    preempted = [[r.request_id for r in o.preempted] for o in driver.outputs if o.preempted]
    assert preempted[0] == ["r2", "r1"]


@pytest.mark.parametrize("copy_is_cheaper", [True, False])
def test_auto_swaps_a_victim_while_measured_copies_are_cheaper_and_recomputes_it_if_not(
    copy_is_cheaper,
):
    driver = Driver(4, 64, 3, 2, False, preemption_mode="auto", num_swap_frames=8)
    fast, slow = 1e-6, 1e-3
    copy, prefill = (fast, slow) if copy_is_cheaper else (slow, fast)
    driver.scheduler.costs = PreemptionCosts(copy, prefill)  # seconds a page, a token
    run(driver, [Arrival(0, [i], max_tokens=3) for i in range(3)])
    assert driver.num_preemptions > 0
    swapped = driver.scheduler.num_swapped_preemptions
    assert swapped == (driver.num_preemptions if copy_is_cheaper else 0)


def test_siblings_of_an_n_request_count_against_max_num_seqs():
    """An ``n = 3`` request admitted beside another must not fork past ``max_num_seqs``."""
    driver = Driver(3, 64, 64, 4)
    run(driver, [Arrival(0, [1, 2, 3], max_tokens=3), Arrival(0, [4, 5], max_tokens=2, n=3)])
    assert max(len(o.scheduled) for o in driver.outputs) <= 3


def test_finishing_with_a_status_that_is_not_final_asserts():
    driver = Driver(2, 8, 8, 4)
    driver.add(Arrival(0, [1, 2, 3], max_tokens=2))
    req = driver.groups[0].seqs[0]
    with pytest.raises(AssertionError):
        driver.scheduler.finish_request(req, RequestStatus.RUNNING)
    assert driver.scheduler.waiting[0] is req


def test_a_request_waiting_for_its_grammar_keeps_its_place_and_others_pass_it():
    """vLLM's WAITING_FOR_FSM: a request whose grammar is still compiling is not scheduled, the
    requests behind it are, and it is admitted, first in line, once its grammar is ready."""
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    grammar = SimpleNamespace(ready=False)  # the one field the scheduler reads
    reqs = [Request(f"r{i}", [i + 1] * 3, SamplingParams(max_tokens=2)) for i in range(4)]
    reqs[1].structured_output = grammar
    for req in reqs:
        scheduler.add_request(req)

    first = scheduler.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["r0", "r2", "r3"]
    assert list(scheduler.waiting) == [reqs[1]]

    grammar.ready = True
    second = scheduler.schedule()
    assert "r1" in [s.request.request_id for s in second.scheduled]
    assert not scheduler.waiting


def test_a_request_waiting_for_its_grammar_keeps_its_place_when_the_next_does_not_fit():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    running = Request("r0", [1] * 12, SamplingParams(max_tokens=2))
    scheduler.add_request(running)
    assert [s.request for s in scheduler.schedule().scheduled] == [running]
    running.num_computed_tokens = 12
    running.append_output_token(1)  # its next token takes the last free page
    compiling = Request("r1", [2] * 3, SamplingParams(max_tokens=2))
    compiling.structured_output = SimpleNamespace(ready=False)
    pageless = Request("r2", [3] * 3, SamplingParams(max_tokens=2))
    for req in (compiling, pageless):
        scheduler.add_request(req)
    assert [s.request for s in scheduler.schedule().scheduled] == [running]
    assert list(scheduler.waiting) == [compiling, pageless]


def test_requests_waiting_for_grammars_keep_their_order():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    reqs = [Request(f"r{i}", [i + 1] * 3, SamplingParams(max_tokens=2)) for i in range(3)]
    for req in reqs:
        req.structured_output = SimpleNamespace(ready=False)
        scheduler.add_request(req)
    assert scheduler.schedule().scheduled == []
    assert list(scheduler.waiting) == reqs


@settings(max_examples=100, deadline=None)
@given(workloads(preemption_mode="swap"))
def test_swap_space_for_every_page_swaps_every_victim_and_recomputes_nothing(workload):
    driver, arrivals = workload
    total = sum(a.n * -(-(len(a.prompt) + a.max_tokens) // driver.block_size) for a in arrivals)
    driver = Driver(
        driver.max_num_seqs,
        driver.max_num_batched_tokens,
        driver.num_pages,
        driver.block_size,
        driver.enable_prefix_caching,
        preemption_mode="swap",
        num_swap_frames=total,
        num_host_cache_frames=driver.num_host_cache_frames,
    )
    driver.run(arrivals)
    driver.check_finished()
    assert driver.scheduler.num_swapped_preemptions == driver.num_preemptions
    assert driver.scheduler.num_recomputed_tokens == 0
