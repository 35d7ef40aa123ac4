"""The HTTP process's engine client, as vLLM v1's AsyncLLM.

The engine core (scheduler, block manager, model) runs its own busy loop, in a process of its own
for ``pagedserve serve`` or in a thread for ``build_app(engine)``; this side sends it requests,
aborts and utility calls, and one task on the event loop reads its per-step messages: token ids
go through the ``OutputProcessor`` (detokenization, stop strings) to each request's consumer,
statistics are kept for ``/metrics``, and every message is a heartbeat for ``/health``. The event
loop never waits on model compute, and a dead engine fails every request in flight at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.engine.core_client import (
    SHUTDOWN_TIMEOUT_S,
    CoreClient,
    InprocCoreClient,
    MPCoreClient,
)
from pagedserve.engine.limits import EngineLimits
from pagedserve.engine.messages import (
    ABORT,
    ADD,
    DEAD,
    OUTPUTS,
    UTILITY,
    EngineCoreOutputs,
    decode,
    outputs_from_wire,
    params_to_wire,
)
from pagedserve.engine.output_processor import EngineDeadError, EngineStepError, OutputProcessor
from pagedserve.engine.protocol import EngineClient
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineStepError"]

logger = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 10.0
TOKEN_RATE_HISTORY_S = 300  # the web console's tokens/s chart: the last five minutes


class TokenRateHistory:
    """Tokens generated in each whole second of the last ``window_s``, from the running total
    that every engine message carries (one comes at least every heartbeat, busy or idle)."""

    def __init__(self, window_s: int = TOKEN_RATE_HISTORY_S):
        self.window_s = window_s
        self.buckets: deque[list[int]] = deque()  # [second, tokens generated in it], in order
        self.last_total: int | None = None

    def record(self, now: float, total: int) -> None:
        new = 0 if self.last_total is None else max(total - self.last_total, 0)
        self.last_total = total
        second = int(now)
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1][1] += new
        else:
            self.buckets.append([second, new])
        while self.buckets[0][0] < second - self.window_s:
            self.buckets.popleft()

    def per_second(self, now: float) -> list[int]:
        """Tokens in each of the last ``window_s`` complete seconds, oldest first."""
        counts = dict(self.buckets)
        current = int(now)
        return [counts.get(s, 0) for s in range(current - self.window_s, current)]


class AsyncLLMEngine(EngineClient):
    def __init__(
        self,
        client: CoreClient,
        max_queue_len: int | None = None,
        tokenizer: Any = None,
    ):
        self.client = client
        info = client.info
        self.limits = EngineLimits.from_dict(info["limits"])
        self.model = info["model"]
        self.description = info["describe"]
        self.lora_enabled = info.get("lora_enabled", False)
        # LoRA adapters by name ({"name", "id", "path", "base_model_name"}): from the core at
        # start, then as load_lora_adapter / unload_lora_adapter change them
        self.lora_adapters: dict[str, dict] = {a["name"]: a for a in info.get("lora_adapters", [])}
        if tokenizer is None and info["tokenizer_dir"]:
            from pagedserve.models.tokenizer import Tokenizer

            tokenizer = Tokenizer(Path(info["tokenizer_dir"]))
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self.max_queue_len = max_queue_len
        self.draining = False
        self.dead_error: str | None = None
        self.stats: dict[str, Any] = {}
        self.num_steps = 0
        self.last_message_time: float | None = None
        self._num_adds_sent = 0
        self._num_streams = 0
        self._num_unread = 0  # streams handed out whose request is not sent yet
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._token_marks: deque[tuple[float, int]] = deque()
        self.token_rate_history = TokenRateHistory()
        self._dead_callbacks: list[Callable[[str], None]] = []
        self._output_task: asyncio.Task | None = None
        self._stopping = False

    @classmethod
    def from_engine(cls, engine: LLMEngine, max_queue_len: int | None = None) -> AsyncLLMEngine:
        """The engine core in a thread of this process (tests, embedding)."""
        return cls(InprocCoreClient(engine), max_queue_len, tokenizer=engine.tokenizer)

    @classmethod
    def from_config(
        cls, config, max_queue_len: int | None = None, log_level: str = "info"
    ) -> AsyncLLMEngine:
        """The engine core in a process of its own; returns once the engine has loaded, raises
        ``ValueError`` with the engine's message when it cannot load."""
        return cls(MPCoreClient(config, log_level), max_queue_len)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start reading the engine core's messages (call on the serving event loop)."""
        if self._output_task is not None:
            return
        loop = asyncio.get_running_loop()
        self.client.start()
        self.client.watch(loop, self._on_dead)
        self._output_task = loop.create_task(
            self._output_handler(self.client.async_output_socket())
        )

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the engine core (SHUTDOWN, then a kill after ``timeout``); idempotent."""
        self._stopping = True
        if self._output_task is not None:
            self._output_task.cancel()
        if not self.client.closed:
            self.client.shutdown(timeout)

    def fail_all(self, reason: str) -> None:
        """End every request in flight with ``EngineDeadError(reason)`` (a drain that ran past
        its --shutdown-timeout); each stream aborts its request in the engine core as it ends."""
        if self._num_streams:
            logger.warning("%s: failing the %d requests in flight", reason, self._num_streams)
        self.output_processor.fail_all(EngineDeadError(reason))

    def on_dead(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` on the event loop when the engine core dies."""
        self._dead_callbacks.append(callback)

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self.client.is_running()

    def health(self) -> dict[str, Any]:
        """Liveness figures for ``/health``: the step counter and the age of the last message."""
        age = None if self.last_message_time is None else time.monotonic() - self.last_message_time
        return {
            "engine": "alive" if self.is_alive else "dead",
            "pid": getattr(self.client, "pid", None),  # None: a thread of this process
            "tp_worker_pids": self.client.info["worker_pids"],
            "num_steps": self.num_steps,
            "seconds_since_last_message": round(age, 3) if age is not None else None,
            "num_requests_running": self.stats.get("num_requests_running", 0),
            "num_requests_waiting": self.num_waiting,
        }

    @property
    def num_unfinished(self) -> int:
        return self._num_streams

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: on their way to the engine, held while paused, or waiting
        to be scheduled (as of the engine's last message)."""
        stats = self.stats
        in_transit = self._num_unread + self._num_adds_sent - stats.get("num_adds", 0)
        return in_transit + stats.get("num_held", 0) + stats.get("num_requests_waiting", 0)

    def queue_full(self) -> bool:
        return self.max_queue_len is not None and self.num_waiting >= self.max_queue_len

    def pause(self) -> None:
        """Stop stepping and hold new requests (aborts and calls still run) until ``resume()``."""
        self.client.send([UTILITY, -1, "pause", []])

    def resume(self) -> None:
        self.client.send([UTILITY, -1, "resume", []])

    # ---- requests -----------------------------------------------------------------------------
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; aborted if the consumer goes away.
        ``lora_name``: a loaded LoRA adapter it runs with (None: the base model).

        The request is sent to the engine core when the stream is first read (a stream dropped
        unread sends nothing), but it counts as waiting from this call: admission control
        (``queue_full``) sees every request it let in, however long a response takes to start."""
        unread = [True]

        def on_drop() -> None:
            if unread[0]:
                self._num_unread -= 1

        self._num_unread += 1
        stream = self._generate(request_id, prompt_token_ids, params, prompt, unread, lora_name)
        weakref.finalize(stream, on_drop)
        return stream

    async def _generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        unread: list[bool],
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        unread[0] = False
        self._num_unread -= 1
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        arrival_time = time.monotonic()
        state = self.output_processor.add_request(
            request_id, prompt, prompt_token_ids, params, arrival_time
        )
        wire = params_to_wire(params)
        self.client.send([ADD, request_id, prompt_token_ids, wire, arrival_time, lora_name])
        self._num_adds_sent += 1
        self._num_streams += 1
        finished = False
        try:
            while not finished:
                output = await state.get()
                finished = output.finished
                yield output
        finally:
            self._num_streams -= 1
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.output_processor.abort_request(request_id)
        if self.dead_error is None:
            self.client.send([ABORT, [[request_id, None]]])

    # ---- utility calls ------------------------------------------------------------------------
    async def call_utility(self, name: str, *args: Any) -> Any:
        """Run the engine core's ``name(*args)`` between two of its steps."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running: {self.dead_error}")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self.client.send([UTILITY, call_id, name, list(args)])
        return await future

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """``{"adapter": info}``, or ``{"error": why}``; listed here once the core has it."""
        result = await self.call_utility("load_lora_adapter", lora_name, lora_path)
        if "adapter" in result:
            self.lora_adapters[lora_name] = result["adapter"]
        return result

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        """``{}``, or ``{"error": why}`` (``not_found``, or ``in_use`` naming the requests)."""
        result = await self.call_utility("unload_lora_adapter", lora_name)
        if not result.get("error"):
            self.lora_adapters.pop(lora_name, None)
        return result

    def tokens_per_second(self) -> float:
        marks = self._token_marks
        if len(marks) < 2:
            return 0.0
        (t0, n0), (t1, n1) = marks[0], marks[-1]
        recent = time.monotonic() - t1 < THROUGHPUT_WINDOW_S
        return (n1 - n0) / max(t1 - t0, 1e-6) if recent else 0.0

    # ---- the engine core's messages -----------------------------------------------------------
    async def _output_handler(self, socket) -> None:
        try:
            while True:
                frame = await socket.recv(copy=False)
                message = decode(frame.buffer)
                if message[0] == OUTPUTS:
                    self._process(outputs_from_wire(message[1]))
                elif message[0] == DEAD:
                    self._on_dead(message[1])
                await asyncio.sleep(0)  # let the consumers read this step before the next
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - without this task nothing is delivered
            logger.exception("reading the engine core's messages failed")
            self._on_dead(f"reading the engine core's messages failed: {e!r}")

    def _process(self, out: EngineCoreOutputs) -> None:
        self.num_steps = out.step
        self.last_message_time = time.monotonic()
        self.stats = out.stats
        self._mark_tokens()
        for call_id, ok, result in out.utility_results:
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                if ok:
                    future.set_result(result)
                else:
                    future.set_exception(RuntimeError(result))
        for request_id, kind, message in out.errors:
            error = ValueError(message) if kind == "rejected" else EngineStepError(message)
            self.output_processor.fail(request_id, error)
        aborts = self.output_processor.process_outputs(out.outputs)
        if aborts:
            self.client.send([ABORT, aborts])

    def _on_dead(self, reason: str) -> None:
        if self.dead_error is not None or self._stopping:
            return
        self.dead_error = reason
        logger.error("%s: failing the %d requests in flight", reason, self._num_streams)
        error = EngineDeadError(f"the engine loop is not running: {reason}")
        self.output_processor.fail_all(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        for callback in self._dead_callbacks:
            callback(reason)

    def _mark_tokens(self) -> None:
        now = time.monotonic()
        total = self.stats.get("generation_tokens_total", 0)
        self._token_marks.append((now, total))
        self.token_rate_history.record(now, total)
        while len(self._token_marks) > 2 and now - self._token_marks[0][0] > THROUGHPUT_WINDOW_S:
            self._token_marks.popleft()
