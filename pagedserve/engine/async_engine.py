"""One engine loop beside the HTTP event loop.

A background thread owns the ``LLMEngine``: it drains a thread-safe command queue (new requests,
aborts, calls) between steps, runs ``engine.step()``, and hands each ``RequestOutput`` back to the
asyncio loop with ``call_soon_threadsafe`` into a per-request queue. The event loop never waits
on model compute.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
THROUGHPUT_WINDOW_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; the server can no longer generate."""


class EngineStepError(RuntimeError):
    """``engine.step()`` failed while this request was in flight; it was aborted."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_queue_len: int | None = None):
        self.engine = engine
        self.max_queue_len = max_queue_len
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._held: list[_Add] = []
        self._paused = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.dead_error: BaseException | None = None
        self.draining = False
        self._token_marks: deque[tuple[float, int]] = deque()

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued for the loop, held while paused, or waiting to be scheduled."""
        return self._commands.qsize() + len(self._held) + len(self.engine.scheduler.waiting)

    def queue_full(self) -> bool:
        return self.max_queue_len is not None and self.num_waiting >= self.max_queue_len

    def pause(self) -> None:
        """Stop stepping and hold new requests (aborts and calls still run) until ``resume()``."""
        self._commands.put(("pause",))

    def resume(self) -> None:
        self._commands.put(("resume",))

    # ---- the asyncio side ---------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; abort it if the consumer goes away."""
        if not self.is_alive:
            raise EngineDeadError("the engine loop is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._commands.put(
            ("add", _Add(request_id, prompt_token_ids, params, prompt, time.monotonic()))
        )
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the loop thread between steps (engine state is not thread-safe)."""
        if not self.is_alive:
            return fn(self.engine)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._commands.put(("call", fn, loop, future))
        return await future

    def tokens_per_second(self) -> float:
        marks = list(self._token_marks)
        if len(marks) < 2:
            return 0.0
        (t0, n0), (t1, n1) = marks[0], marks[-1]
        return (
            (n1 - n0) / max(t1 - t0, 1e-6) if time.monotonic() - t1 < THROUGHPUT_WINDOW_S else 0.0
        )

    # ---- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if self._paused or not self.engine.has_unfinished_requests():
                    self._wait_for_command()
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001 - the loop must record why it died
            logger.exception("the engine loop died")
            self.dead_error = e
            self._fail_all(EngineDeadError(f"the engine loop died: {e!r}"))

    def _wait_for_command(self) -> None:
        try:
            self._handle(self._commands.get(timeout=IDLE_POLL_S))
        except queue.Empty:
            pass

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._handle(command)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._held.append(command[1]) if self._paused else self._add(command[1])
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "call":
            self._call(*command[1:])
        elif kind == "pause":
            self._paused = True
        elif kind == "resume":
            self._paused = False
            held, self._held = self._held, []
            for add in held:
                self._add(add)

    def _add(self, add: _Add) -> None:
        stream = self._streams.get(add.request_id)
        if stream is None:  # the client left before the loop saw the request
            return
        try:
            self.engine.add_request(
                add.request_id,
                add.prompt_token_ids,
                add.params,
                prompt=add.prompt,
                arrival_time=add.arrival_time,
            )
        except ValueError as e:
            stream.put(e)

    def _abort(self, request_id: str) -> None:
        self._held = [a for a in self._held if a.request_id != request_id]
        self.engine.abort_request(request_id)

    def _call(self, fn: Callable, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as e:  # noqa: BLE001 - handed back to the caller
            loop.call_soon_threadsafe(_resolve, future, None, e)
            return
        loop.call_soon_threadsafe(_resolve, future, result, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
            logger.exception("engine.step() failed; aborting the requests in flight")
            self._fail_in_flight(e)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, deliveries in by_loop.items():  # one wake-up of the event loop per step
            loop.call_soon_threadsafe(_deliver, deliveries)
        self._mark_tokens()

    def _fail_in_flight(self, error: Exception) -> None:
        request_ids = list(self.engine.groups)
        self.engine.abort_request(request_ids)
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(EngineStepError(f"the engine failed on this request: {error!r}"))

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(error)

    def _mark_tokens(self) -> None:
        now = time.monotonic()
        self._token_marks.append((now, self.engine.stats["generation_tokens_total"]))
        while len(self._token_marks) > 2 and now - self._token_marks[0][0] > THROUGHPUT_WINDOW_S:
            self._token_marks.popleft()


def _deliver(deliveries: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, output in deliveries:
        q.put_nowait(output)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
