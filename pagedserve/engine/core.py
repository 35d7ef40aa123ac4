"""The engine core, as vLLM v1's EngineCore: scheduling and the model in a busy loop of its own.

``EngineCore`` is an ``LLMEngine`` without detokenization behind a message interface: requests
and aborts in, per-step token ids out. ``EngineCoreProc`` runs it over two ZeroMQ sockets: it
steps while there is work, blocks on the input socket while there is none, and sends one message
per iteration (outputs, statistics, utility replies; a heartbeat every ``HEARTBEAT_S`` when idle).
``pagedserve serve`` runs it in a process of its own (``run_engine_core``); ``build_app(engine)``
in a thread beside the HTTP event loop.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from pathlib import Path

import zmq

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.messages import (
    ABORT,
    ADD,
    DEAD,
    FAILED,
    OUTPUTS,
    READY,
    SHUTDOWN,
    UTILITY,
    EngineCoreOutput,
    decode,
    encode,
    params_from_wire,
)
from pagedserve.engine.request_group import RequestGroup
from pagedserve.hal.faults import UnrecoverableFaultError
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class EngineCore:
    """An ``LLMEngine`` whose outputs are token ids: the HTTP process detokenizes them and
    matches stop strings (it aborts a sequence whose stop string it found)."""

    # what the HTTP process may call by name (``[UTILITY, call_id, name, args]``)
    UTILITIES = frozenset(
        {
            "get_stats",
            "get_device_stats",
            "get_page_map",
            "reset_prefix_cache",
            "pause",
            "resume",
            "scrub_weights",
            "check_invariants",
            "inject_fault",
            "load_lora_adapter",
            "unload_lora_adapter",
        }
    )

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        engine.detokenize = False
        self.num_steps = 0
        self.num_adds = 0  # add requests received, held ones included
        self.paused = False
        self.held: list[tuple] = []  # requests received while paused
        self.errors: list[list] = []  # [request_id, kind, message] since the last message

    # ---- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.num_adds += 1
        request = (request_id, prompt_token_ids, params, arrival_time, lora_name)
        if self.paused:
            self.held.append(request)
        else:
            self._admit(*request)

    def _admit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None,
        lora_name: str | None = None,
    ) -> None:
        try:
            lora = self._lora_request(lora_name)
            self.engine.add_request(
                request_id, prompt_token_ids, params, arrival_time=arrival_time, lora_request=lora
            )
        except ValueError as e:
            self.errors.append([request_id, "rejected", str(e)])

    def _lora_request(self, lora_name: str | None):
        """The loaded adapter of that name (unloaded since the HTTP process checked: refused)."""
        if lora_name is None:
            return None
        registry = self.engine.lora_registry
        request = registry.by_name(lora_name) if registry is not None else None
        if request is None:
            raise ValueError(f"LoRA adapter {lora_name!r} is not loaded (unloaded just now?)")
        return request

    def abort(self, targets: list[list]) -> None:
        """``targets``: [request_id, sequence index or None for the whole request]."""
        for request_id, index in targets:
            if index is None:
                self.held = [h for h in self.held if h[0] != request_id]
                self.engine.abort_request(request_id)
            else:
                self.engine.abort_sequence(request_id, index)

    def has_work(self) -> bool:
        return not self.paused and self.engine.has_unfinished_requests()

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """One engine step. A failed forward pass ends that step's requests (the engine says
        which); a failure anywhere else aborts every request in flight; the loop goes on, but
        for an unrecoverable device fault."""
        try:
            advanced = self.engine.execute_step()
        except UnrecoverableFaultError:
            raise  # the loop dies and says why; /health turns 503
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
            logger.exception("engine step failed; aborting the requests in flight")
            self._fail_in_flight(e)
            return []
        self.num_steps += 1
        self.errors.extend([rid, "rejected", why] for rid, why in self.engine.take_rejected())
        self.errors.extend([rid, "step_failed", why] for rid, why in self.engine.take_failed())
        return [_output(group, index, num_new) for group, index, num_new in advanced]

    def step_encoded(self) -> bytes:
        """A step and its message, as the loop sends it (what benchmarks/step_overhead.py times)."""
        outputs = self.step()
        return encode([OUTPUTS, [self.num_steps, outputs, self.get_stats(), [], []]])

    def _fail_in_flight(self, error: Exception) -> None:
        request_ids = list(self.engine.groups)
        self.engine.abort_request(request_ids)
        message = f"the engine failed on this request: {error!r}"
        self.errors.extend([rid, "step_failed", message] for rid in request_ids)

    def take_errors(self) -> list[list]:
        errors, self.errors = self.errors, []
        return errors

    # ---- utility calls ------------------------------------------------------------------------
    def get_stats(self) -> dict:
        return {
            **self.engine.get_stats(),
            "num_steps": self.num_steps,
            "num_adds": self.num_adds,
            "num_held": len(self.held),
        }

    def get_device_stats(self) -> dict:
        return self.engine.get_device_stats()

    def get_page_map(self) -> dict:
        return self.engine.get_page_map()

    def scrub_weights(self) -> dict:
        """Verify every weight page now; corrupted ones are restored from the checkpoint."""
        restored = self.engine.scrub_weights()
        return {"pages_verified": self.engine.device.num_weight_pages, "pages_restored": restored}

    def check_invariants(self) -> dict:
        """The KV pool's consistency and what is in flight (a soak's end-of-run check)."""
        stats = self.engine.get_stats()
        return {
            "problems": self.engine.check_invariants(),
            "num_requests_running": stats["num_requests_running"],
            "num_requests_waiting": stats["num_requests_waiting"],
            "num_groups": self.engine.get_num_unfinished_requests(),
            "kv_cache_usage_perc": stats["kv_cache_usage_perc"],
            "num_kv_pages_in_use": stats["num_kv_pages"] - stats["num_free_kv_pages"],
        }

    def inject_fault(self, kind: str, tag: str | None = None, page: int | None = None) -> dict:
        return self.engine.inject_fault(kind, tag, page)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """vLLM's POST /v1/load_lora_adapter, between two steps: the adapter read, checked and
        kept in host memory under a new id; ``{"error": why}`` when it does not fit."""
        registry = self.engine.lora_registry
        if registry is None:
            return {"error": "LoRA is off; start the server with --enable-lora"}
        if registry.by_name(lora_name) is not None:
            return {"error": f"the LoRA adapter {lora_name!r} has already been loaded"}
        from pagedserve.lora.request import LoRARequest

        request = LoRARequest(lora_name, registry.next_id(), lora_path)
        try:
            self.engine.add_lora(request)
        except ValueError as e:
            return {"error": str(e)}
        return {"adapter": _adapter_info(request)}

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """vLLM's POST /v1/unload_lora_adapter: refused, naming them, while requests use it."""
        registry = self.engine.lora_registry
        request = registry.by_name(lora_name) if registry is not None else None
        if request is None:
            return {"error": f"the LoRA adapter {lora_name!r} is not loaded", "not_found": True}
        try:
            self.engine.remove_lora(request.lora_int_id)
        except ValueError as e:
            return {"error": str(e), "in_use": True}
        return {}

    def reset_prefix_cache(self) -> bool:
        self.engine.block_manager.reset_prefix_cache()
        return True

    def pause(self) -> None:
        """Stop stepping and hold new requests (aborts and calls still run) until ``resume()``."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        held, self.held = self.held, []
        for request in held:
            self._admit(*request)

    def info(self) -> dict:
        """What the HTTP process needs to know of this engine (sent once, when it is ready)."""
        engine = self.engine
        tokenizer_dir = Path(engine.config.model.tokenizer or engine.model_path)
        has_tokenizer = engine.tokenizer is not None
        return {
            "model": engine.config.model.model,
            "limits": engine.limits.to_dict(),
            "describe": engine.describe(),
            "tokenizer_dir": str(tokenizer_dir) if has_tokenizer else None,
            "worker_pids": engine.executor.worker_pids,
            "lora_enabled": engine.lora_registry is not None,
            "lora_adapters": [_adapter_info(r) for r in _loaded_loras(engine)],
        }


def _loaded_loras(engine: LLMEngine) -> list:
    registry = engine.lora_registry
    return [] if registry is None else list(registry.requests.values())


def _adapter_info(request) -> dict:
    """A LoRA adapter as the HTTP process lists it (``/v1/models``)."""
    return {
        "name": request.lora_name,
        "id": request.lora_int_id,
        "path": request.lora_path,
        "base_model_name": request.base_model_name,
    }


def _output(group: RequestGroup, index: int, num_new: int) -> EngineCoreOutput:
    """A sequence's ``num_new`` tokens of this step (more than one: accepted drafts)."""
    seq = group.seqs[index]
    logprobs = seq.logprobs[-num_new:] if seq.sampling_params.logprobs is not None else None
    first = None
    if index == 0 and seq.num_output_tokens == num_new:
        first = [
            group.prompt_logprobs,
            seq.num_cached_tokens,
            seq.first_scheduled_time,
            seq.first_token_time,
        ]
    return EngineCoreOutput(
        group.request_id,
        index,
        seq.output_token_ids[-num_new:],
        logprobs,
        seq.status.finish_reason,
        seq.stop_reason,
        first,
    )


class EngineCoreProc:
    """The busy loop over the sockets: the HTTP process binds them, the core connects."""

    def __init__(
        self,
        core: EngineCore,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        parent_pid: int | None = None,
    ):
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.utility_results: list[list] = []
        self.stopping = False
        self.parent_gone = False

    def run_busy_loop(self) -> None:
        try:
            while not self.stopping:
                self._process_input(block=not self.core.has_work())
                self.core.engine.check_health()  # a lost tensor-parallel rank ends the loop
                outputs = self.core.step() if self.core.has_work() else []
                self._send_outputs(outputs)
        except BaseException as e:  # the HTTP process must hear why, then this loop is gone
            logger.exception("the engine loop died")
            self.output_socket.send(encode([DEAD, f"the engine loop died: {e!r}"]))
            raise

    def _process_input(self, block: bool) -> None:
        if block and not self.poller.poll(HEARTBEAT_S * 1000):
            self._check_parent()
            return
        while True:
            try:
                message = self.input_socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._handle(decode(message.buffer))
        self._check_parent()

    def _check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            logger.warning("the HTTP process is gone; the engine core stops")
            self.stopping = self.parent_gone = True

    def _handle(self, message: list) -> None:
        kind = message[0]
        if kind == ADD:
            _, request_id, prompt_token_ids, params, arrival_time, lora_name = message
            self.core.add_request(
                request_id, prompt_token_ids, params_from_wire(params), arrival_time, lora_name
            )
        elif kind == ABORT:
            self.core.abort(message[1])
        elif kind == UTILITY:
            self._call_utility(*message[1:])
        elif kind == SHUTDOWN:
            self.stopping = True
        else:
            logger.error("unknown message %r from the HTTP process", kind)

    def _call_utility(self, call_id: int, name: str, args: list) -> None:
        if name not in EngineCore.UTILITIES:
            self.utility_results.append([call_id, False, f"no utility call {name!r}"])
            return
        try:
            result = getattr(self.core, name)(*args)
        except UnrecoverableFaultError:
            raise  # e.g. a scrub on demand that cannot restore a page: the loop dies
        except Exception as e:  # noqa: BLE001 - handed back to the caller
            message = str(e) if isinstance(e, ValueError) else repr(e)  # a caller's mistake
            self.utility_results.append([call_id, False, message])
            return
        self.utility_results.append([call_id, True, result])

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        results, self.utility_results = self.utility_results, []
        payload = [
            self.core.num_steps,
            outputs,
            self.core.get_stats(),
            results,
            self.core.take_errors(),
        ]
        self.output_socket.send(encode([OUTPUTS, payload]), copy=False)


# ---- the engine core process ------------------------------------------------------------------
def run_engine_core(
    config, input_address: str, output_address: str, log_level: str, parent_pid: int
) -> None:
    """The process entry point (spawned): load the engine, say READY (or FAILED), run the loop."""
    # The HTTP process owns the lifetime: a Ctrl-C or a SIGTERM to the whole process group must
    # not kill the core under a draining server; it stops on SHUTDOWN or when its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.connect(output_address)
    try:
        core = EngineCore(LLMEngine(config))
    except Exception as e:  # noqa: BLE001 - reported to the HTTP process, which prints it
        user_error = isinstance(e, (ValueError, TypeError, FileNotFoundError))
        if not user_error:
            logger.exception("the engine could not start")
        else:  # its message says it all; --log-level debug shows where
            logger.debug("the engine could not start", exc_info=True)
        output_socket.send(encode([FAILED, str(e) if user_error else repr(e), user_error]))
        output_socket.close(linger=5000)
        sys.exit(1)
    output_socket.send(encode([READY, core.info()]))
    proc = EngineCoreProc(core, input_socket, output_socket, parent_pid)
    try:
        proc.run_busy_loop()
    except BaseException:  # noqa: BLE001 - logged and reported by the loop
        core.engine.shutdown()
        output_socket.close(linger=2000)
        sys.exit(1)
    core.engine.shutdown()
    input_socket.close(linger=0)
    if proc.parent_gone:  # killed without a word (SIGKILL): nobody reads what is queued
        output_socket.close(linger=0)
        ctx.term()
        _remove_ipc_dir(input_address)  # leave no socket files behind
        logging.shutdown()
        os._exit(0)  # at once: the interpreter's teardown (torch's) can take seconds
    output_socket.close(linger=2000)
    ctx.term()


def _remove_ipc_dir(address: str) -> None:
    """The directory of an ``ipc://DIR/NAME`` socket, which the HTTP process made for this core."""
    if address.startswith("ipc://"):
        shutil.rmtree(Path(address.removeprefix("ipc://")).parent, ignore_errors=True)
