"""Turns a ``SchedulerOutput`` into one flat, unpadded batch, runs the model and samples.

Only the last position of each sequence that completes this step goes through ``lm_head`` (plus the
prompt positions of requests that asked for prompt logprobs); a sequence with drafts sends its
last ``1 + k`` positions (its next token, then one after each of its ``k`` drafts), and
``sampler.verify_drafts`` keeps the drafts the model agrees with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.engine.request import Request
from pagedserve.engine.sampler import Sampler, SamplingMetadata, accept_drafts
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.hal import AttentionMetadata, Device
from pagedserve.lora.slots import LoRASlots
from pagedserve.models.glm4 import GlmForCausalLM


@dataclass(slots=True)
class ModelInput:
    """One step's flat batch as plain integers: what rank 0 sends the other tensor-parallel ranks
    (``to_tensor``), and all that any rank needs to run the step."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    block_tables: list[list[int]]  # [B, max_blocks], padded with 0
    logits_rows: list[int]  # rows whose logits this step needs: prompt logprobs, then samplers
    page_copies: list[tuple[int, int]]  # copy-on-write (source page, destination page)
    # moves between the KV tier and the host tier, done first: every rank holds the same pages
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (KV page, host frame)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host frame, KV page)
    # LoRA: each sequence's adapter slot (-1: the base model), and the adapters to move into
    # their slots first (slot, adapter id); empty without adapters
    lora_slots: list[int] = field(default_factory=list)  # [B] or []
    lora_loads: list[tuple[int, int]] = field(default_factory=list)

    def to_tensor(self) -> torch.Tensor:
        """One int64 tensor: the sizes, then every field flattened."""
        tables = [p for row in self.block_tables for p in row]
        pairs = [self.page_copies, self.swap_out, self.swap_in, self.lora_loads]
        max_blocks = len(self.block_tables[0]) if self.block_tables else 0
        sizes = [len(self.input_ids), len(self.seq_lens), max_blocks, len(self.logits_rows)]
        sizes += [len(self.lora_slots)] + [len(p) for p in pairs]
        fields = [self.input_ids, self.positions, self.slot_mapping, self.query_start_loc]
        fields += [self.seq_lens, tables, self.logits_rows, self.lora_slots]
        fields += [[x for pair in p for x in pair] for p in pairs]
        return torch.tensor(sizes + [x for f in fields for x in f], dtype=torch.long)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> ModelInput:
        values = t.tolist()
        T, B, max_blocks, R, L, C, SO, SI, LL = values[:9]
        lengths = [T, T, T, B + 1, B, B * max_blocks, R, L, 2 * C, 2 * SO, 2 * SI, 2 * LL]
        fields, at = [], 9
        for n in lengths:
            fields.append(values[at : at + n])
            at += n
        ids, pos, slots, qsl, lens, tables, rows, lora_slots, *flat_pairs = fields
        table_rows = [tables[i * max_blocks : (i + 1) * max_blocks] for i in range(B)]
        copies, swap_out, swap_in, lora_loads = (list(zip(f[::2], f[1::2])) for f in flat_pairs)
        return cls(
            ids, pos, slots, qsl, lens, table_rows, rows, copies, swap_out, swap_in, lora_slots,
            lora_loads,
        )  # fmt: skip


@dataclass(slots=True)
class StepTiming:
    """What one step cost on this rank: its page moves between the tiers, its forward pass (the
    rates ``swap_policy`` decides by)."""

    num_pages_moved: int = 0
    move_seconds: float = 0.0
    num_tokens: int = 0
    forward_seconds: float = 0.0


@dataclass
class ModelRunnerOutput:
    # request id -> its new tokens: one, or with drafts the accepted ones and the model's next
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]] | None] = field(default_factory=dict)  # per token
    # request id -> (first prompt position predicted, logprobs of the following prompt tokens)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    timing: StepTiming = field(default_factory=StepTiming)


class ModelRunner:
    def __init__(
        self,
        model: GlmForCausalLM,
        device: Device,
        kv_cache: torch.Tensor,
        block_size: int,
        lora: LoRASlots | None = None,
    ):
        self.model = model
        self.lora = lora  # this rank's adapter slots (None: LoRA is off)
        self.device = device
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = Sampler(argmax=device.argmax, categorical=device.categorical())
        self.generators: dict[str, torch.Generator] = {}
        self.structured_output_manager = None  # the engine's, when it serves constraints
        # the engine's weight patrol (tp 1 only): True when it restored a corrupted page, so
        # that the step is computed again
        self.patrol_scrub: Callable[[], bool] | None = None
        # at tp > 1: sends each step's ModelInput to the other ranks before rank 0 runs it
        self.broadcast_step: Callable[[ModelInput], None] | None = None

    @torch.inference_mode()
    def execute_model(
        self, sched: SchedulerOutput, forks: dict[str, list[Request]] | None = None
    ) -> ModelRunnerOutput:
        """``forks`` maps a request id to the ``n > 1`` siblings that sample from its first logits."""
        samplers: list[tuple[Request, list[int]]] = []  # (sequence, the drafts it verifies)
        sample_rows: list[int] = []
        inp, prompt_rows = self.prepare_inputs(sched)
        completing = [s for s in sched.scheduled if s.completes_sequence]
        rows = iter(inp.logits_rows)
        for s in completing:
            seq_rows = [next(rows) for _ in range(1 + len(s.spec_token_ids))]
            for r in [s.request, *(forks or {}).get(s.request.request_id, [])]:
                samplers.append((r, s.spec_token_ids))
                sample_rows += seq_rows
        inp.logits_rows = [row for rows in prompt_rows.values() for row in rows] + sample_rows
        if self.broadcast_step is not None:
            self.broadcast_step(inp)
        out = ModelRunnerOutput()
        timing = out.timing
        start = time.perf_counter()
        self.move_pages(inp)
        timing.num_pages_moved = len(inp.swap_out) + len(inp.swap_in)
        timing.move_seconds = time.perf_counter() - start
        if not inp.input_ids:  # a step that only moves pages (its sequences were all preempted)
            return out
        logits = self.forward(inp)
        timing.num_tokens = len(inp.input_ids)
        timing.forward_seconds = time.perf_counter() - start - timing.move_seconds
        if self.patrol_scrub is not None and self.patrol_scrub():
            # a weight page this pass may have read was corrupted and is now restored: the
            # forward pass runs again (its KV slots rewritten) before anything is sampled; the
            # page moves are not redone, as the pass may have written the pages they read
            logits = self.forward(inp)
        at = self._compute_prompt_logprobs(sched, prompt_rows, logits, out)
        if samplers:
            self._sample(samplers, logits[at:], out)
        return out

    def _sample(
        self,
        samplers: list[tuple[Request, list[int]]],
        logits: torch.Tensor,
        out: ModelRunnerOutput,
    ) -> None:
        """Sample every row, then verify each sequence's drafts against its rows. A draft row is
        sampled as if its drafts before it were already output tokens (penalties, min_tokens),
        so that a sequence's tokens are those of one step at a time (greedy: the same ones;
        sampled: the same distribution)."""
        row_seqs, row_outputs = [], []
        for r, drafts in samplers:
            for j in range(len(drafts) + 1):
                row_seqs.append(r)
                row_outputs.append(r.output_token_ids + drafts[:j] if j else r.output_token_ids)
        result = self.sampler(logits, self._sampling_metadata(row_seqs, row_outputs))
        accepted = accept_drafts(result, [drafts for _, drafts in samplers])
        for (r, _), (tokens, logprobs) in zip(samplers, accepted):
            out.sampled_token_ids[r.request_id] = tokens
            out.logprobs[r.request_id] = logprobs

    @torch.inference_mode()
    def run_step(self, inp: ModelInput) -> torch.Tensor | None:
        """One step on this rank's shard: its page moves, then its forward pass (none when the
        step only moves pages)."""
        self.move_pages(inp)
        return self.forward(inp) if inp.input_ids else None

    def move_pages(self, inp: ModelInput) -> None:
        """The step's page moves, in the order the block manager queued them for: swap-outs,
        swap-ins, copy-on-write; then the adapters it needs into their device slots."""
        self.device.swap_out(inp.swap_out)
        self.device.swap_in(inp.swap_in)
        self.device.copy_pages(inp.page_copies)
        for slot, lora_id in inp.lora_loads:
            self.lora.activate(slot, lora_id)

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor | None:
        """The forward pass: the logits of ``inp.logits_rows`` (whole at every rank), None when
        no row needs them."""
        dev = self.device.torch_device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(inp.slot_mapping, device=dev),
            query_start_loc=inp.query_start_loc,
            seq_lens=inp.seq_lens,
            block_tables=torch.tensor(inp.block_tables, dtype=torch.long, device=dev),
            block_size=self.block_size,
        )
        input_ids = torch.tensor(inp.input_ids, device=dev)
        positions = torch.tensor(inp.positions, device=dev)
        lora = self._lora_step(inp)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache, lora)
        if not inp.logits_rows:
            return None
        return self.model.compute_logits(hidden[inp.logits_rows])

    def _lora_step(self, inp: ModelInput):
        """The step's adapter rows (each token takes its sequence's slot); None when no
        sequence has an adapter, so that the model keeps its fused decode layers."""
        if self.lora is None or not any(s >= 0 for s in inp.lora_slots):
            return None
        qsl = inp.query_start_loc
        token_slots = [s for i, s in enumerate(inp.lora_slots) for _ in range(qsl[i + 1] - qsl[i])]
        return self.lora.step(token_slots)

    def prepare_inputs(self, sched: SchedulerOutput) -> tuple[ModelInput, dict[int, list[int]]]:
        """Flatten the scheduled requests in one pass in Python; ``logits_rows`` holds each
        completing sequence's last row, and the second value the prompt rows whose logprobs
        were asked for, by position in the batch.

        At batch 1 the step's whole budget is a few milliseconds, so this avoids per-token tensor
        ops: slots are computed with integer arithmetic, and each field becomes a tensor once.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc, seq_lens, logits_rows = [0], [], []
        prompt_rows: dict[int, list[int]] = {}
        for i, s in enumerate(sched.scheduled):
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            table = s.block_table
            row0 = len(input_ids)
            if end - start == 1:  # a decode row: no slices, no comprehension
                input_ids.append(s.request.all_token_ids[start])
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                input_ids += s.request.all_token_ids[start:end]
                input_ids += s.spec_token_ids  # the drafts follow the known tokens
                positions += range(start, end)
                slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            if s.completes_sequence:
                logits_rows += range(len(input_ids) - 1 - len(s.spec_token_ids), len(input_ids))
            n = self._num_prompt_logprob_rows(s.request, start, end)
            if n:
                prompt_rows[i] = list(range(row0, row0 + n))
        max_blocks = max((len(s.block_table) for s in sched.scheduled), default=0)
        padded = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in sched.scheduled]
        inp = ModelInput(
            input_ids,
            positions,
            slot_mapping,
            query_start_loc,
            seq_lens,
            padded,
            logits_rows,
            list(sched.page_copies),
            list(sched.swap_out),
            list(sched.swap_in),
        )
        if sched.lora_slot_of:
            slot_of = sched.lora_slot_of
            inp.lora_slots = [slot_of.get(s.request.lora_int_id, -1) for s in sched.scheduled]
            inp.lora_loads = list(sched.lora_loads)
        return inp, prompt_rows

    @staticmethod
    def _num_prompt_logprob_rows(req: Request, start: int, end: int) -> int:
        """Rows of this chunk that predict a following prompt token, when prompt logprobs are on."""
        if req.sampling_params.prompt_logprobs is None:
            return 0
        return max(min(end, req.num_prompt_tokens - 1) - start, 0)

    def _sampling_metadata(
        self, requests: list[Request], output_token_ids: list[list[int]]
    ) -> SamplingMetadata:
        return SamplingMetadata(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=output_token_ids,
            generators=[self._generator(r) for r in requests],
            eos_token_ids=[r.eos_token_ids for r in requests],
            grammar_bitmask=self._grammar_bitmask(requests),
        )

    def _grammar_bitmask(self, requests: list[Request]) -> torch.Tensor | None:
        manager = self.structured_output_manager
        bitmask = manager.grammar_bitmask(requests) if manager is not None else None
        return None if bitmask is None else torch.from_numpy(bitmask)

    def _generator(self, req: Request) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        if req.request_id not in self.generators:
            self.generators[req.request_id] = torch.Generator().manual_seed(seed)
        return self.generators[req.request_id]

    def _compute_prompt_logprobs(
        self,
        sched: SchedulerOutput,
        prompt_rows: dict[int, list[int]],
        logits: torch.Tensor | None,
        out: ModelRunnerOutput,
    ) -> int:
        """Fill ``out.prompt_logprobs`` from the first rows of ``logits``; how many it used."""
        at = 0
        for i, rows in prompt_rows.items():
            req = sched.scheduled[i].request
            start = req.num_computed_tokens
            targets = req.prompt_token_ids[start + 1 : start + 1 + len(rows)]
            out.prompt_logprobs[req.request_id] = (
                start + 1,
                self.sampler.compute_prompt_logprobs(
                    logits[at : at + len(rows)], targets, req.sampling_params.prompt_logprobs
                ),
            )
            at += len(rows)
        return at

    def free_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
