"""The step loop: add requests, schedule, run the model, turn sampled tokens into outputs.

It knows nothing of devices (the HAL does), file formats (``models/`` does) or HTTP.
"""

from __future__ import annotations

import logging
import time
import weakref
from pathlib import Path

import torch

from pagedserve.config import EngineConfig, UsageContext
from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.executor import create_executor
from pagedserve.engine.fault_recovery import FaultRecovery, is_device_fault
from pagedserve.engine.limits import EngineLimits, RequestRejectedError  # noqa: F401 - re-exported
from pagedserve.engine.model_runner import ModelRunnerOutput
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.request_group import RequestGroup, make_request_output
from pagedserve.engine.scheduler import Scheduler, SchedulerOutput
from pagedserve.engine.spec_decode import DraftState, NgramProposer, SpecDecodeStats
from pagedserve.engine.start_checks import check_before_start
from pagedserve.engine.stop_checker import check_stop
from pagedserve.engine.structured_output.manager import StructuredOutputManager
from pagedserve.engine.worker import resolve_dtype  # noqa: F401 - re-exported
from pagedserve.hal.faults import UnrecoverableFaultError
from pagedserve.lora.registry import LoRARegistry
from pagedserve.lora.request import LoRARequest
from pagedserve.models import Tokenizer, resolve_model_path
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.01  # an idle step waits this long for a compiling grammar, not a busy spin


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        usage_context: UsageContext = UsageContext.OPENAI_API_SERVER,
        detokenize: bool = True,
    ):
        """``detokenize=False``: the engine core of a server, whose HTTP process turns token ids
        into text and matches stop strings; the engine still ends sequences on EOS, stop token
        ids, ``max_tokens`` and ``max_model_len``."""
        self.config = config
        self.usage_context = usage_context
        self.detokenize = detokenize
        torch.manual_seed(config.model.seed)
        self.model_path = resolve_model_path(config.model.model)
        # the node's layout, config.json, the weight files whole, the tensor-parallel split:
        # refused before any rank is spawned
        self.model_config = check_before_start(self.model_path, config, usage_context)
        self.max_model_len = config.model.max_model_len or self.model_config.max_position_embeddings
        self._check_max_model_len()
        self._check_tier_settings()
        self._check_lora_settings()
        self.tokenizer = self._load_tokenizer()
        self.executor = create_executor(config, usage_context)
        # the ranks stop however this engine ends: shutdown(), garbage collection or exit
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        try:
            self._load()
        except BaseException:
            self.shutdown()  # a start that fails part way leaves nothing running
            raise
        logger.info("%s", self.describe())

    # ---- start-up -----------------------------------------------------------------------------
    def _load(self) -> None:
        """Rank 0's card, shard and KV pages, and what schedules and samples over them."""
        config, usage_context = self.config, self.usage_context
        worker = self.executor.load()  # rank 0: this process's card, shard and KV pages
        self.dtype, self.device, self.model = worker.dtype, worker.device, worker.model
        self.device.seal_weights()  # the patrol scrub's checksums, of the weights as placed
        self.block_size = config.cache.block_size
        self.runner = worker.runner
        kv_cache = self.runner.kv_cache
        self.num_kv_pages = kv_cache.shape[2]
        self.block_manager = BlockManager(
            self.num_kv_pages,
            self.block_size,
            config.cache.enable_prefix_caching,
            worker.num_swap_frames,
            worker.num_host_cache_frames,
        )
        lora = config.lora
        self.lora_registry = LoRARegistry(lora.max_loras) if lora.enable_lora else None
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, lora.max_loras if lora.enable_lora else 0
        )
        self.fault_recovery = FaultRecovery(
            self.device,
            self.model,
            self.model_path,
            self.block_manager,
            self.scheduler,
            config.device,
        )
        if self.executor.world_size == 1:  # a restore recomputes the step on this rank alone
            self.runner.patrol_scrub = self.fault_recovery.patrol_scrub
        self.limits = EngineLimits(
            self.max_model_len,
            self.model_config.vocab_size,
            self.num_kv_pages,
            self.block_size,
            config.scheduler.max_num_seqs,
            usage_context,
        )
        self.groups: dict[str, RequestGroup] = {}
        self.eos_token_ids = frozenset(
            self.model_config.eos_token_ids
            + (self.tokenizer.eos_token_ids if self.tokenizer else [])
        )
        self.structured_output_manager = StructuredOutputManager(
            self.tokenizer.model_dir / "tokenizer.json" if self.tokenizer else None,
            self.model_config.vocab_size,
            list(self.eos_token_ids),
        )
        self.runner.structured_output_manager = self.structured_output_manager
        self.rejected: list[tuple[str, str]] = []  # (request id, why) found after admission
        self.failed: list[tuple[str, str]] = []  # (request id, why): a step failed under them
        self.step_error: Exception | None = None  # the last forward pass's bug, until taken
        self.num_step_errors = 0  # forward passes that raised for another cause than the device
        self.stats = {"prompt_tokens_total": 0, "generation_tokens_total": 0}
        spec = config.speculative
        self.proposer = NgramProposer(spec) if spec is not None else None
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)
        self.lora_requests_total: dict[str, int] = {}  # adapter name -> requests it served
        for module in lora.lora_modules:
            self._add_lora_module(module)

    def _load_tokenizer(self) -> Tokenizer | None:
        path = Path(self.config.model.tokenizer or self.model_path)
        if not (path / "tokenizer.json").is_file():
            logger.warning("no tokenizer.json in %s: only token-id prompts are accepted", path)
            return None
        return Tokenizer(path)

    def _check_max_model_len(self) -> None:
        limit, ctx = self.model_config.max_position_embeddings, self.usage_context
        if self.max_model_len > limit:
            raise ValueError(
                f"{ctx.assignment('max_model_len', self.max_model_len)} exceeds the model's "
                f"context of {limit} tokens (max_position_embeddings); use "
                f"{ctx.assignment('max_model_len', limit)} or less"
            )

    def _check_tier_settings(self) -> None:
        """Host-tier settings that cannot work together, named as the user wrote them."""
        cache, ctx = self.config.cache, self.usage_context
        if self.config.scheduler.preemption_mode == "swap" and not cache.swap_space:
            raise ValueError(
                f"{ctx.assignment('preemption_mode', 'swap')} needs host memory to swap to: "
                f"{ctx.start_with} {ctx.name_of('swap_space')} GiB as well (e.g. "
                f"{ctx.assignment('swap_space', 4)}), or use preemption mode auto or recompute"
            )
        if cache.host_prefix_cache and not cache.enable_prefix_caching:
            raise ValueError(
                f"{ctx.name_of('host_prefix_cache')} keeps prefix blocks the KV tier evicts, but "
                f"prefix caching is off; turn it on ({ctx.assignment('enable_prefix_caching', True)}) "
                f"or drop {ctx.name_of('host_prefix_cache')}"
            )

    def _check_lora_settings(self) -> None:
        lora, ctx = self.config.lora, self.usage_context
        if lora.lora_modules and not lora.enable_lora:
            raise ValueError(
                f"{ctx.name_of('lora_modules')} needs LoRA turned on: "
                f"{ctx.start_with} {ctx.assignment('enable_lora', True)} as well"
            )
        if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
            raise ValueError(
                f"{ctx.assignment('max_cpu_loras', lora.max_cpu_loras)} is less than "
                f"{ctx.assignment('max_loras', lora.max_loras)}: host memory keeps at least the "
                f"adapters of one step; raise {ctx.name_of('max_cpu_loras')} or leave it unset"
            )

    def _add_lora_module(self, module: dict) -> None:
        """An adapter of ``lora_modules``, loaded at start-up; a bad one fails the start."""
        request = LoRARequest(
            module["name"],
            self.lora_registry.next_id(),
            module["path"],
            module.get("base_model_name"),
        )
        try:
            self.add_lora(request)
        except ValueError as e:
            flag = self.usage_context.name_of("lora_modules")
            raise ValueError(f"{flag} {module['name']}={module['path']}: {e}") from None

    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token on each card (its KV heads, in the KV cache's dtype)."""
        return self.executor.worker.kv_bytes_per_token()

    def describe(self) -> str:
        max_concurrency = self.num_kv_pages * self.block_size / self.max_model_len
        tp = self.config.parallel.tensor_parallel_size
        cards = f" (rank 0 of tensor-parallel size {tp})" if tp > 1 else ""
        kv_dtype = (
            "int8 + a scale per token and head" if self._int8_kv else self._kv_cache_dtype_name
        )
        return (
            f"device {self.device.describe()}{cards}; model {self.model_path.name} "
            f"({self.model_config.architecture}, {self.dtype}); KV cache {self.num_kv_pages} pages "
            f"x {self.block_size} tokens ({kv_dtype}: {self.kv_bytes_per_token()} B per token); "
            f"{self._describe_host_tier()}max_model_len {self.max_model_len}; max concurrency at "
            f"max_model_len {max_concurrency:.2f}x"
        )

    @property
    def _int8_kv(self) -> bool:
        return self.config.cache.kv_cache_dtype == "int8"

    @property
    def _kv_cache_dtype_name(self) -> str:
        """``int8``, or the model's dtype that a 16-bit cache keeps (``bfloat16``)."""
        return "int8" if self._int8_kv else str(self.dtype).removeprefix("torch.")

    def _describe_host_tier(self) -> str:
        host = self.block_manager.host
        if host is None:
            return ""
        return (
            f"host tier {host.num_frames} page frames ({host.swap_share} swap space, "
            f"{host.cache_share} prefix cache); preemption {self.config.scheduler.preemption_mode}; "
        )

    # ---- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request, or raise ``RequestRejectedError`` saying why it can never run.
        ``lora_request``: the adapter it runs with (read and checked on its first use)."""
        if not self._finalizer.alive:
            raise RuntimeError("this engine has been shut down; start a new one")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self.check_request(prompt_token_ids, params)
        self._check_lora_request(lora_request)
        if params.structured_outputs is not None:
            try:
                self.structured_output_manager.check(params.structured_outputs)
            except ValueError as e:
                raise RequestRejectedError(str(e)) from e
        seqs = [
            self._new_seq(request_id, i, prompt_token_ids, params, arrival_time, lora_request)
            for i in range(params.n)
        ]
        if params.structured_outputs is not None:
            for seq in seqs:
                seq.structured_output = self.structured_output_manager.request(
                    params.structured_outputs
                )
        group = RequestGroup(
            request_id,
            prompt,
            params,
            seqs,
            detokenizers=[self._detokenizer(prompt_token_ids, s.sampling_params) for s in seqs],
            texts=[""] * params.n,
            pending_forks=seqs[1:],
        )
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(prompt_token_ids)
        self.groups[request_id] = group
        self.scheduler.add_request(seqs[0])
        self.stats["prompt_tokens_total"] += len(prompt_token_ids)
        if lora_request is not None:
            name = lora_request.lora_name
            self.lora_requests_total[name] = self.lora_requests_total.get(name, 0) + 1

    def _check_lora_request(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter, added on its first use; ``RequestRejectedError`` when LoRA is off
        or the adapter does not fit the base model."""
        if lora_request is None:
            return
        if self.lora_registry is None:
            ctx = self.usage_context
            raise RequestRejectedError(
                f"this request asks for LoRA adapter {lora_request.lora_name!r}, but LoRA is off; "
                f"{ctx.start_with} {ctx.assignment('enable_lora', True)}",
                param="model",
            )
        if lora_request.lora_int_id not in self.lora_registry:
            try:
                self.add_lora(lora_request)
            except ValueError as e:
                raise RequestRejectedError(
                    f"LoRA adapter {lora_request.lora_name!r}: {e}", param="model"
                ) from e

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ---------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter on every rank and keep it in host memory; raises
        ``LoRAAdapterError`` (a ``ValueError``) saying why it does not fit the base model."""
        if self.lora_registry is None:
            ctx = self.usage_context
            raise ValueError(f"LoRA is off; {ctx.start_with} {ctx.assignment('enable_lora', True)}")
        self.executor.add_lora(lora_request)
        self.lora_registry.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; a ``ValueError`` naming the requests that still run with it (they
        keep it until they finish). False when no such adapter is loaded."""
        registry = self.lora_registry
        if registry is None or lora_int_id not in registry:
            return False
        users = self.lora_users(lora_int_id)
        if users:
            name = registry.requests[lora_int_id].lora_name
            shown = ", ".join(users[:10]) + (
                f" and {len(users) - 10} more" if len(users) > 10 else ""
            )
            raise ValueError(
                f"LoRA adapter {name!r} is in use by {len(users)} request(s) ({shown}); unload "
                "it once they finish, or abort them first"
            )
        self.executor.remove_lora(lora_int_id)
        registry.remove(lora_int_id)
        return True

    def lora_users(self, lora_int_id: int) -> list[str]:
        """The unfinished requests that run with adapter ``lora_int_id``."""
        return [
            rid
            for rid, group in self.groups.items()
            if any(s.lora_int_id == lora_int_id for s in group.seqs)
        ]

    def list_loras(self) -> set[int]:
        return set(self.lora_registry.requests) if self.lora_registry is not None else set()

    def _new_seq(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        if index and params.seed is not None:
            params = SamplingParams(**{**vars(params), "seed": params.seed + index})
        seq_id = request_id if index == 0 else f"{request_id}#{index}"
        return Request(
            seq_id,
            list(prompt_token_ids),
            params,
            self.eos_token_ids,
            arrival_time=arrival_time or time.monotonic(),
            draft_state=DraftState() if self._drafts_for(params) else None,
            lora_request=lora_request,
        )

    def _drafts_for(self, params: SamplingParams) -> bool:
        """Whether a request speculates: with a proposer, and not under a grammar (its drafts
        would need the matcher advanced through them to mask each draft row; not done yet)."""
        return self.proposer is not None and params.structured_outputs is None

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams):
        if self.tokenizer is None or not self.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """The params this request runs with (``max_tokens`` filled in), or
        ``RequestRejectedError`` saying why it can never run. Changes nothing."""
        return self.limits.check_request(prompt_ids, params)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            group.pending_forks.clear()
            for seq in group.seqs:
                if not seq.status.finished:
                    self._finish_seq(seq, RequestStatus.FINISHED_ABORTED)

    def abort_sequence(self, request_id: str, index: int) -> None:
        """End one sequence of a request, e.g. one whose stop string the HTTP process matched."""
        group = self.groups.get(request_id)
        if group is None:
            return
        seq = group.seqs[index]
        if seq in group.pending_forks:
            group.pending_forks.remove(seq)
            seq.status = RequestStatus.FINISHED_ABORTED
        elif not seq.status.finished:
            self._finish_seq(seq, RequestStatus.FINISHED_ABORTED)
        if group.finished:
            del self.groups[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request one step; the outputs of those that got a token."""
        groups = {group.request_id: group for group, _, _ in self.execute_step()}
        return [make_request_output(g) for g in groups.values()]

    def execute_step(self) -> list[tuple[RequestGroup, int, int]]:
        """Schedule, run the model and append the sampled tokens: (group, sequence index, number
        of new tokens) of each sequence that got any (several: accepted drafts), in batch order.
        A group that finishes leaves ``groups`` here."""
        for req in self.fault_recovery.recover_kv_pages():
            req.release_matcher()
        self._reject_failed_grammars()
        sched = self.scheduler.schedule()
        for req in sched.preempted:
            req.release_matcher()
        if sched.is_empty and not sched.has_page_moves:
            self._wait_for_grammars()
            return []
        forks = self._forks_this_step(sched)
        self._assign_lora_slots(sched)
        try:
            result = self.executor.execute_model(sched, forks)
        except UnrecoverableFaultError:
            raise  # no step can be trusted any more: the engine stops
        except Exception as e:  # noqa: BLE001 - a device or kernel error ends this step only
            if self.executor.failed is not None:
                raise  # a tensor-parallel rank is gone: the engine stops
            self.failed += self.fault_recovery.fail_step(sched, e, self.abort_request)
            if sched.lora_loads:  # a move into a slot may not have finished: load them again
                self.lora_registry.forget_slots([slot for slot, _ in sched.lora_loads])
            if not is_device_fault(e):
                self.step_error = e
                self.num_step_errors += 1
            return []
        finally:
            self.block_manager.moves_done()
        self.fault_recovery.step_done()
        return self._update(sched, forks, result)

    def _assign_lora_slots(self, sched: SchedulerOutput) -> None:
        """The device slot of each adapter the step runs, and the moves into them."""
        if self.lora_registry is None:
            return
        lora_ids = {s.request.lora_int_id for s in sched.scheduled} - {0}
        if not lora_ids:
            return
        sched.lora_loads, sched.lora_slot_of = self.lora_registry.assign(lora_ids)
        # base rows first, then each slot's rows together: the LoRA ops take views of the batch
        # instead of gathering and scattering rows (lora/ops.py)
        slot_of = sched.lora_slot_of
        sched.scheduled.sort(key=lambda s: slot_of.get(s.request.lora_int_id, -1))

    def take_failed(self) -> list[tuple[str, str]]:
        failed, self.failed = self.failed, []
        return failed

    def take_step_error(self) -> Exception | None:
        """The exception of the last forward pass that failed for another cause than the device
        (a bug), once: ``LLM.generate`` raises it."""
        error, self.step_error = self.step_error, None
        return error

    # ---- device faults ------------------------------------------------------------------------
    def scrub_weights(self, num_pages: int | None = None) -> int:
        """Verify ``num_pages`` weight pages (None: every one) and restore each corrupted page
        from the checkpoint on disk; the number restored (``FaultRecovery.scrub_weights``)."""
        return self.fault_recovery.scrub_weights(num_pages)

    def inject_fault(self, kind: str, tag: str | None = None, page: int | None = None) -> dict:
        """Provoke a device fault on purpose (``kunlun-emu`` only; ``FaultRecovery.inject_fault``):
        what was injected, as plain data."""
        return self.fault_recovery.inject_fault(kind, tag, page)

    def check_invariants(self) -> list[str]:
        """The KV pool's consistency (``BlockManager.check_invariants``), plus: only running
        sequences hold pages."""
        bm = self.block_manager
        problems = bm.check_invariants()
        running = {r.request_id for r in self.scheduler.running}
        strays = set(bm.block_tables) - running
        if strays:
            problems.append(f"sequences that are not running hold pages: {sorted(strays)}")
        if bm.host is not None:
            swapped = {r.request_id for r in self.scheduler.swapped}
            if set(bm.host.block_tables) != swapped:
                problems.append(
                    f"host frames are held by {sorted(bm.host.block_tables)}, but the swapped-out "
                    f"sequences are {sorted(swapped)}"
                )
        return problems

    # ---- structured output --------------------------------------------------------------------
    def _reject_failed_grammars(self) -> None:
        """A constraint that passed the check but failed to compile ends its request."""
        for req in list(self.scheduler.waiting):
            so = req.structured_output
            if so is not None and so.error is not None:
                rid = req.request_id.partition("#")[0]
                if rid in self.groups:
                    self.rejected.append((rid, so.error))
                    self.abort_request(rid)

    def take_rejected(self) -> list[tuple[str, str]]:
        rejected, self.rejected = self.rejected, []
        return rejected

    def _wait_for_grammars(self) -> None:
        waiting = [r for r in self.scheduler.waiting if r.waiting_for_grammar]
        if waiting:
            self.structured_output_manager.wait_for_any(waiting, GRAMMAR_WAIT_S)

    def _forks_this_step(self, sched: SchedulerOutput) -> dict[str, list[Request]]:
        """Siblings of an ``n > 1`` request fork off its pages once its prompt is computed."""
        forks = {}
        for s in sched.scheduled:
            group = self.groups.get(s.request.request_id)
            if group and group.pending_forks and s.completes_sequence:
                forks[s.request.request_id] = group.pending_forks
        return forks

    def _update(
        self, sched: SchedulerOutput, forks: dict[str, list[Request]], result: ModelRunnerOutput
    ) -> list[tuple[RequestGroup, int, int]]:
        advanced = []
        costs, timing = self.scheduler.costs, result.timing
        costs.observe_copies(timing.num_pages_moved, timing.move_seconds)
        costs.observe_forward(timing.num_tokens, timing.forward_seconds)
        drafts = {}  # sequence id -> the drafts it verified this step
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.spec_token_ids:
                drafts[s.request.request_id] = s.spec_token_ids
        for rid, (start, entries) in result.prompt_logprobs.items():
            group = self.groups[rid]
            group.prompt_logprobs[start : start + len(entries)] = entries
        for parent_id, children in forks.items():
            parent = self.groups[parent_id].seqs[0]
            for child in children:
                self.block_manager.fork(parent, child)
                child.num_computed_tokens = parent.num_computed_tokens
                self.scheduler.admit_forked(child)
            self.groups[parent_id].pending_forks = []
        ended = []
        for seq_id, tokens in result.sampled_token_ids.items():
            group, index = self._group_of(seq_id)
            seq = group.seqs[index]
            num_drafts = len(drafts.get(seq_id, ()))
            if num_drafts:
                self._verified(seq, num_drafts, len(tokens) - 1)
            logprobs = result.logprobs[seq_id]
            num_new = 0
            for i, token in enumerate(tokens):  # nothing past a stop is appended
                num_new += 1
                if self._append_token(group, index, token, logprobs and logprobs[i]):
                    ended.append(group)
                    break
            else:
                if num_drafts > len(tokens) - 1:  # the pages only rejected drafts were written to
                    self.block_manager.trim(seq)
                self._propose_drafts(seq)
            advanced.append((group, index, num_new))
        for group in ended:
            if group.finished:
                self.groups.pop(group.request_id, None)
        return advanced

    # ---- speculative decoding -----------------------------------------------------------------
    def _verified(self, seq: Request, num_drafts: int, num_accepted: int) -> None:
        """A sequence's drafts were verified: its rejected ones are no longer computed tokens
        (the pages only they were written to go back once its new tokens are appended)."""
        seq.num_computed_tokens -= num_drafts - num_accepted
        seq.spec_token_ids = []
        self.spec_stats.observe(num_drafts, num_accepted)
        seq.draft_state.observe(num_accepted)

    def _propose_drafts(self, seq: Request) -> None:
        """Drafts for a running sequence's next step, as many as its ``max_tokens`` and the
        context length leave room for."""
        state = seq.draft_state
        if state is None:
            return
        p = seq.sampling_params
        room = min(p.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens)
        seq.spec_token_ids = self.proposer.propose(seq.all_token_ids, state, room)

    def _group_of(self, seq_id: str) -> tuple[RequestGroup, int]:
        rid, _, index = seq_id.partition("#")
        return self.groups[rid], int(index or 0)

    def _append_token(
        self, group: RequestGroup, index: int, token: int, logprobs: dict[int, float] | None
    ) -> bool:
        """Append one sampled token; True when it ends the sequence."""
        seq = group.seqs[index]
        seq.append_output_token(token)
        grammar_done = (
            seq.structured_output is not None
            and self.structured_output_manager.accept_token(seq, token)
        )
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        self.stats["generation_tokens_total"] += 1
        stop_str = None
        detok = group.detokenizers[index]
        if detok is not None:
            delta, stop_str = detok.add_token(token)
            group.texts[index] += delta
        status = check_stop(seq, token, self.max_model_len, stop_str, grammar_done)
        if status is not None:
            if detok is not None and stop_str is None:
                group.texts[index] += detok.flush()
            self._finish_seq(seq, status)
            return True
        return False

    def _finish_seq(self, seq: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(seq, status)
        self.runner.free_request(seq.request_id)
        seq.release_matcher()

    # ---- statistics ---------------------------------------------------------------------------
    def get_stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": bm.usage,
            "num_kv_pages": self.num_kv_pages,
            "num_free_kv_pages": bm.num_free_pages,
            "prefix_cache_queries_total": bm.prefix_cache_queries,
            "prefix_cache_hits_total": bm.prefix_cache_hits,
            "num_preemptions_total": self.scheduler.num_preemptions,
            "recomputed_tokens_total": self.scheduler.num_recomputed_tokens,
            **self._host_tier_stats(),
            "device_faults_total": dict(self.device.faults.detected),
            "engine_step_errors_total": self.num_step_errors,
            "collective_bytes_sent_total": self.device.collective_bytes_sent,
            **self.spec_stats.to_dict(),
            **self.stats,
            **self._lora_stats(),
        }

    def _lora_stats(self) -> dict:
        """vLLM's ``lora_requests_info``: the adapters of the running and of the waiting
        requests (by name), the slots; and the requests each adapter has served."""
        registry = self.lora_registry
        if registry is None:
            return {}
        sched = self.scheduler
        names = {i: r.lora_name for i, r in registry.requests.items()}

        def adapters(requests) -> list[str]:
            return sorted({names.get(r.lora_int_id, "?") for r in requests if r.lora_int_id})

        return {
            "lora": {
                "max_lora": registry.max_loras,
                "running_lora_adapters": adapters(sched.running),
                "waiting_lora_adapters": adapters(sched.waiting),
                "requests_total": dict(self.lora_requests_total),
                "loaded_adapters": sorted(names.values()),
                "swap_ins_total": registry.num_swap_ins,
            }
        }

    def _host_tier_stats(self) -> dict:
        """The host tier's figures (zeros without one, so that every server exports them)."""
        bm, host = self.block_manager, self.block_manager.host
        return {
            "num_requests_swapped": len(self.scheduler.swapped),
            "num_swapped_pages": host.num_swapped_frames if host else 0,
            "host_kv_cache_usage_perc": host.usage if host else 0.0,
            "num_swapped_preemptions_total": self.scheduler.num_swapped_preemptions,
            "swapped_out_pages_total": bm.num_swapped_out_pages,
            "swapped_in_pages_total": bm.num_swapped_in_pages,
            "host_prefix_cache_queries_total": bm.host_prefix_cache_queries,
            "host_prefix_cache_hits_total": bm.host_prefix_cache_hits,
        }

    def get_device_stats(self) -> dict | list[dict]:
        """What ``pagedserve smi`` shows: the device, its tiers and the KV page pool; at
        tensor-parallel size > 1, one such record per card (every card holds the same pages; the
        faults and the weight patrol are rank 0's, the only card they run on)."""
        bm, dev = self.block_manager, self.device
        cached = bm.num_cached_free_pages
        shared = {
            "kv_pages": {  # in_use + cached + free == total
                "total": bm.num_pages,
                "in_use": bm.num_pages - bm.num_free_pages,
                "cached": cached,  # free, holding a prefix block a later request may reuse
                "free": bm.num_free_pages - cached,
                "block_size": self.block_size,
                "memory_attr": dev.kv_memory_attr.value if dev.kv_memory_attr else None,
                "kv_cache_dtype": self._kv_cache_dtype_name,
                "bytes_per_token": self.kv_bytes_per_token(),
            },
            **self._host_pages(),
            "requests": {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
            },
            "generation_tokens_total": self.stats["generation_tokens_total"],
            **self._speculative_stats(),
            **self._lora_device_stats(),
            "faults_detected": dev.num_faults_detected,
            "faults": dev.faults.to_dict(),
            "weight_pages": {
                "total": dev.num_weight_pages,
                "scrubbed_total": dev.scrubber.num_pages_scrubbed if dev.scrubber else 0,
                "scrub_pages_per_step": self.config.device.weight_scrub_pages,
            },
        }
        cards = [{**card, **shared} for card in self.executor.device_stats()]
        return cards[0] if len(cards) == 1 else cards

    def _lora_device_stats(self) -> dict:
        """``lora`` for ``get_device_stats``: which adapter each device slot holds (None: empty),
        the loaded, running and waiting ones (LoRA off: no entry)."""
        registry = self.lora_registry
        if registry is None:
            return {}
        names = {i: r.lora_name for i, r in registry.requests.items()}
        info = self._lora_stats()["lora"]
        return {
            "lora": {
                "max_loras": registry.max_loras,
                "max_lora_rank": self.config.lora.max_lora_rank,
                "slots": [names.get(i) if i is not None else None for i in registry.slot_ids],
                "loaded": info["loaded_adapters"],
                "running": info["running_lora_adapters"],
                "waiting": info["waiting_lora_adapters"],
                "swap_ins_total": registry.num_swap_ins,
            }
        }

    def _speculative_stats(self) -> dict:
        """``speculative`` for ``get_device_stats``: the drafts' figures (no speculation: none)."""
        spec = self.config.speculative
        if spec is None:
            return {}
        s = self.spec_stats
        return {
            "speculative": {
                "method": spec.method,
                "num_speculative_tokens": spec.num_speculative_tokens,
                "draft_tokens": s.num_draft_tokens,
                "accepted_tokens": s.num_accepted_tokens,
                "acceptance_rate": s.acceptance_rate,
                "mean_acceptance_length": s.mean_acceptance_length,
            }
        }

    def check_health(self) -> None:
        """Raise ``RuntimeError`` when a tensor-parallel rank is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave their process group (nothing to stop
        at size 1), and the grammar compiler's thread; idempotent. Garbage collection of the
        engine and interpreter exit stop the ranks too."""
        self._finalizer()
        manager = getattr(self, "structured_output_manager", None)
        if manager is not None:
            manager.shutdown()

    def _host_pages(self) -> dict:
        """``host_pages`` for ``get_device_stats``: the host tier's frames (none: no entry)."""
        host = self.block_manager.host
        if host is None:
            return {}
        cached = len(host.frame_to_cached_block)
        return {
            "host_pages": {
                "total": host.num_frames,
                "swapped": host.num_swapped_frames,
                "cached": cached,
                "free": host.num_frames - host.num_swapped_frames - cached,
                "swap_share": host.swap_share,
                "cache_share": host.cache_share,
            }
        }

    def get_page_map(self) -> dict:
        """The KV page pool frame by frame (``BlockManager.page_map``), for the web console;
        ``host``: the host tier's frames, as a tier of their own."""
        bm = self.block_manager
        page_map = {"total": bm.num_pages, "block_size": self.block_size, **bm.page_map()}
        host = bm.host_page_map()
        if host is not None:
            page_map["host"] = host
        return page_map
