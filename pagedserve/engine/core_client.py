"""The HTTP process's end of the channel to one engine core: its sockets and its lifetime.

``MPCoreClient`` spawns the engine core process (multiprocessing's "spawn": torch must not be
forked) and talks to it over IPC sockets; ``InprocCoreClient`` runs the same loop in a thread
of this process over in-process sockets (tests, embedding). The HTTP process binds both sockets:
PUSH for input, PULL for output.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from pagedserve.engine.messages import FAILED, READY, SHUTDOWN, decode, encode

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0  # how long a shutdown waits for the core to stop (then kills a process)


class CoreClient:
    """The HTTP side of the channel to an engine core. Every client shares the process's one
    ZeroMQ context (``zmq.Context.instance()``, as zmq advises): a context of its own would be
    terminated by the garbage collector, which blocks for as long as any of its sockets is open
    in another thread (an engine thread that has not stopped yet)."""

    info: dict  # what the core says of itself once it has loaded: each client sets it

    def __init__(self, ctx: zmq.Context, input_address: str, output_address: str):
        self.ctx = ctx
        self.input_address, self.output_address = input_address, output_address
        self._send_lock = threading.Lock()  # the event loop and a test thread may both send
        self.closed = False
        self.input_socket = ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.bind(input_address)
        self.output_socket = ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(output_address)

    def send(self, message: list, block: bool = True) -> None:
        data = encode(message)
        with self._send_lock:
            if self.closed:
                return
            try:
                self.input_socket.send(data, 0 if block else zmq.NOBLOCK, copy=False)
            except zmq.Again:  # no engine core connected any more: nobody to tell
                pass

    def async_output_socket(self) -> zmq.asyncio.Socket:
        """The output socket for the running event loop."""
        return zmq.asyncio.Socket.from_socket(self.output_socket)

    def start(self) -> None:
        pass

    def watch(self, loop: asyncio.AbstractEventLoop, on_dead: Callable[[str], None]) -> None:
        """Call ``on_dead(reason)`` on ``loop`` when the engine core is gone."""

    def is_running(self) -> bool:
        raise NotImplementedError

    def exit_reason(self) -> str:
        """Why the engine core is not running, as far as this side can tell."""
        return "it is not running"

    def shutdown(self, timeout: float) -> None:
        raise NotImplementedError

    def _close_sockets(self) -> None:
        with self._send_lock:
            self.closed = True
            self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)


def _run_engine_core(*args) -> None:
    """The engine core process's entry point (torch is imported there, not in this process)."""
    from pagedserve.engine.core import run_engine_core

    run_engine_core(*args)


# A Unix socket's path has at most 107 bytes (sockaddr_un's sun_path, less its NUL), and the longest
# one bound here is <parent>/pagedserve-<16 hex digits>/output.
SOCKET_PATH_MAX = 107
_LONGEST_SOCKET = os.path.join("pagedserve-" + "0" * 16, "output")


def ipc_parent_dir() -> str:
    """Where the engine core's socket directory goes: the temporary directory (``TMPDIR``), or
    ``/tmp`` where that one's path is too long for a socket (a deeply nested ``TMPDIR``, as test
    runners and macOS make them)."""
    for parent in dict.fromkeys([tempfile.gettempdir(), "/tmp"]):
        fits = len(os.path.join(parent, _LONGEST_SOCKET).encode()) <= SOCKET_PATH_MAX
        if fits and os.access(parent, os.W_OK | os.X_OK):
            return parent
    raise RuntimeError(
        f"the temporary directory {tempfile.gettempdir()!r} is too long for the engine's sockets "
        f"(a socket path has at most {SOCKET_PATH_MAX} bytes) and /tmp is not writable: set "
        "TMPDIR to a shorter directory"
    )


class MPCoreClient(CoreClient):
    """The engine core in a process of its own; the constructor returns once it has loaded. A
    start that fails stops the core it started (5 s for it to stop, then a kill)."""

    def __init__(self, config, log_level: str):
        self.ipc_dir = ""
        self.proc: multiprocessing.process.BaseProcess | None = None
        try:  # whatever stops the start (an error, serve's StartInterrupted) removes what it made
            self._make_ipc_dir()
            super().__init__(
                zmq.Context.instance(),
                f"ipc://{self.ipc_dir}/input",
                f"ipc://{self.ipc_dir}/output",
            )
            self._start_core(config, log_level)
            self.info = self._wait_ready()
        except BaseException:
            self.shutdown(timeout=5)
            raise

    def _make_ipc_dir(self) -> None:
        """A directory as ``tempfile.mkdtemp`` makes it, whose name this client holds before the
        directory exists (a signal's exception from inside mkdtemp would lose it)."""
        parent = ipc_parent_dir()
        while True:
            name = f"pagedserve-{uuid.uuid4().hex[:16]}"
            self.ipc_dir = os.path.join(parent, name)
            try:
                os.mkdir(self.ipc_dir, 0o700)
                return
            except FileExistsError:  # not ours: never removed
                self.ipc_dir = ""

    def _start_core(self, config, log_level: str) -> None:
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_run_engine_core,
            args=(config, self.input_address, self.output_address, log_level, os.getpid()),
            name="pagedserve-engine-core",
            # a daemonic process may not start processes: at tensor-parallel size > 1 the core
            # starts its ranks' (it stops when this process is gone, _check_parent)
            daemon=config.parallel.tensor_parallel_size == 1,
        )
        self.proc.start()
        # after start(), which registers multiprocessing's own exit hook (importing its util) if
        # nothing did before: ours must run first, for that hook waits without end for a core
        # that is not a daemon (tp > 1) and stops only once this process is gone
        atexit.register(self.shutdown)

    def _wait_ready(self) -> dict:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self.output_socket in events:
                message = decode(self.output_socket.recv())
                if message[0] == READY:
                    return message[1]
                if message[0] == FAILED:
                    _, text, user_error = message
                    raise ValueError(text) if user_error else RuntimeError(text)
            elif self.proc.sentinel in events:
                self.proc.join(5)
                raise RuntimeError(
                    f"the engine core process exited with code {self.proc.exitcode} while "
                    "loading; see the log above"
                )

    def watch(self, loop: asyncio.AbstractEventLoop, on_dead: Callable[[str], None]) -> None:
        def exited() -> None:
            loop.remove_reader(self.proc.sentinel)
            self.proc.join(1)
            on_dead(self.exit_reason())

        loop.add_reader(self.proc.sentinel, exited)

    def is_running(self) -> bool:
        return self.proc.is_alive()

    def exit_reason(self) -> str:
        """Its exit code once the process has exited (known here before the watcher runs)."""
        if self.proc.exitcode is None:  # not started, or still running
            return super().exit_reason()
        return f"the engine core process exited with code {self.proc.exitcode}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the engine core (SHUTDOWN, a bounded wait, then a kill), close the sockets and
        remove their directory; also of a start stopped part way."""
        atexit.unregister(self.shutdown)
        proc = self.proc
        if proc is not None and proc.is_alive():  # not alive: never started, or gone
            self.send([SHUTDOWN], block=False)  # a core on its way out may read no more
            proc.join(timeout)
            if proc.is_alive():
                logger.warning("the engine core did not stop in %.0f s; killing it", timeout)
                proc.kill()
                proc.join(5)
        if hasattr(self, "output_socket"):  # a start stopped before both were bound: left to gc
            self._close_sockets()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


class InprocCoreClient(CoreClient):
    """The engine core loop in a thread of this process."""

    def __init__(self, engine: LLMEngine):
        from pagedserve.engine.core import EngineCore

        name = uuid.uuid4().hex
        super().__init__(
            zmq.Context.instance(),
            f"inproc://pagedserve-{name}-input",
            f"inproc://pagedserve-{name}-output",
        )
        self.core = EngineCore(engine)
        self.info = self.core.info()
        self.thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._death: str | None = None
        self._watchers: list[tuple[asyncio.AbstractEventLoop, Callable[[str], None]]] = []

    def start(self) -> None:
        if not self.thread.is_alive():
            self.thread.start()

    def watch(self, loop: asyncio.AbstractEventLoop, on_dead: Callable[[str], None]) -> None:
        """As the process client watches its process: the DEAD message says why the loop died,
        and this says that it did, should that message never be read."""
        self._watchers.append((loop, on_dead))

    def _run(self) -> None:
        from pagedserve.engine.core import EngineCoreProc

        input_socket = self.ctx.socket(zmq.PULL)
        input_socket.connect(self.input_address)
        output_socket = self.ctx.socket(zmq.PUSH)
        output_socket.connect(self.output_address)
        try:
            EngineCoreProc(self.core, input_socket, output_socket).run_busy_loop()
        except BaseException as e:  # noqa: BLE001 - logged and reported (DEAD) by the loop
            self._death = f"the engine loop died: {e!r}"
        finally:
            input_socket.close(linger=0)
            output_socket.close(linger=1000)
            for loop, on_dead in self._watchers:
                try:  # (after a shutdown the callback does nothing; a closed loop, nobody hears)
                    loop.call_soon_threadsafe(on_dead, self.exit_reason())
                except RuntimeError:
                    pass

    def is_running(self) -> bool:
        return self.thread.is_alive()

    def exit_reason(self) -> str:
        return self._death or super().exit_reason()

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        if self.thread.is_alive():
            # not blocking: a loop that just died may still be closing its sockets, and a
            # blocking send to a closed peer waits forever (it hung a test run for 600 s)
            self.send([SHUTDOWN], block=False)
            self.thread.join(timeout)
        self._close_sockets()
