"""Turns a ``SchedulerOutput`` into one flat, unpadded batch, runs the model and samples.

Only the last position of each sequence that completes this step goes through ``lm_head`` (plus the
prompt positions of requests that asked for prompt logprobs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.engine.request import Request
from pagedserve.engine.sampler import Sampler, SamplingMetadata
from pagedserve.engine.scheduler import SchedulerOutput
from pagedserve.hal import AttentionMetadata, Device
from pagedserve.models.glm4 import GlmForCausalLM


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    logits_indices: list[int]  # one row per sequence that samples this step


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float] | None] = field(default_factory=dict)
    # request id -> (first prompt position predicted, logprobs of the following prompt tokens)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, model: GlmForCausalLM, device: Device, kv_cache: torch.Tensor, block_size: int
    ):
        self.model = model
        self.device = device
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = Sampler(argmax=device.argmax)
        self.generators: dict[str, torch.Generator] = {}
        self.structured_output_manager = None  # the engine's, when it serves constraints
        # the engine's weight patrol: True when it restored a corrupted page (recompute the step)
        self.patrol_scrub: Callable[[], bool] | None = None

    @torch.inference_mode()
    def execute_model(
        self, sched: SchedulerOutput, forks: dict[str, list[Request]] | None = None
    ) -> ModelRunnerOutput:
        """``forks`` maps a request id to the ``n > 1`` siblings that sample from its first logits."""
        self.device.copy_pages(sched.page_copies)
        inp = self.prepare_inputs(sched)
        hidden = self.model.forward(inp.input_ids, inp.positions, inp.attn_metadata, self.kv_cache)
        if self.patrol_scrub is not None and self.patrol_scrub():
            # a weight page this pass may have read was corrupted and is now restored: the
            # step is computed again (its KV slots rewritten) before anything is sampled
            hidden = self.model.forward(
                inp.input_ids, inp.positions, inp.attn_metadata, self.kv_cache
            )
        out = ModelRunnerOutput()
        self._compute_prompt_logprobs(sched, hidden, inp, out)
        samplers = [s.request for s in sched.scheduled if s.completes_sequence]
        if not samplers:
            return out
        rows, requests = [], []
        for req, row in zip(samplers, inp.logits_indices):
            for r in [req, *(forks or {}).get(req.request_id, [])]:
                rows.append(row)
                requests.append(r)
        logits = self.model.compute_logits(hidden[rows])
        result = self.sampler(logits, self._sampling_metadata(requests))
        for r, token, lp in zip(requests, result.sampled_token_ids, result.logprobs):
            out.sampled_token_ids[r.request_id] = token
            out.logprobs[r.request_id] = lp
        return out

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled requests: one pass in Python, one tensor per field.

        At batch 1 the step's whole budget is a few milliseconds, so this avoids per-token tensor
        ops: slots are computed with integer arithmetic, and each field becomes a tensor once.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc, seq_lens, logits_indices = [0], [], []
        for s in sched.scheduled:
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            table = s.block_table
            if end - start == 1:  # a decode row: no slices, no comprehension
                input_ids.append(s.request.all_token_ids[start])
                positions.append(start)
                slot_mapping.append(table[start // bs] * bs + start % bs)
            else:
                input_ids += s.request.all_token_ids[start:end]
                positions += range(start, end)
                slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            if s.completes_sequence:
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(s.block_table) for s in sched.scheduled)
        padded = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in sched.scheduled]
        dev = self.device.torch_device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, device=dev),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=torch.tensor(padded, dtype=torch.long, device=dev),
            block_size=bs,
        )
        return ModelInput(
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            meta,
            logits_indices,
        )

    def _sampling_metadata(self, requests: list[Request]) -> SamplingMetadata:
        return SamplingMetadata(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
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
        self, sched: SchedulerOutput, hidden: torch.Tensor, inp: ModelInput, out: ModelRunnerOutput
    ) -> None:
        for i, s in enumerate(sched.scheduled):
            req, top_n = s.request, s.request.sampling_params.prompt_logprobs
            start = req.num_computed_tokens
            end = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)
            if top_n is None or end <= start:
                continue
            row0 = inp.attn_metadata.query_start_loc[i]
            logits = self.model.compute_logits(hidden[row0 : row0 + end - start])
            targets = req.prompt_token_ids[start + 1 : end + 1]
            out.prompt_logprobs[req.request_id] = (
                start + 1,
                self.sampler.compute_prompt_logprobs(logits, targets, top_n),
            )

    def free_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
