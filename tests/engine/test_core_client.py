"""The HTTP side's channel to an engine core, without spawning one: the client's two sockets (what
it sends arrives, nothing is dropped or blocks on a burst, a closed client sends nothing), the
in-process core's thread, and the engine core process's lifetime (its socket directory, its
start, READY or FAILED, its exit seen and reported, a bounded shutdown that kills a core that
does not stop) against a stand-in for the process."""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
import threading
import types
import uuid

import pytest
import zmq

from pagedserve.engine import core_client
from pagedserve.engine.core_client import CoreClient, InprocCoreClient, MPCoreClient
from pagedserve.engine.messages import FAILED, OUTPUTS, READY, SHUTDOWN, decode, encode

BURST = 3000  # more than zmq's default high-water mark of 1000 messages


class FakeProcess:
    """A stand-in for the engine core process: a sentinel that becomes readable when it exits."""

    def __init__(self, stops_when_told: bool = True):
        self.sentinel, self._exit_pipe = os.pipe()
        self.stops_when_told = stops_when_told
        self.alive, self.exitcode, self.pid = True, None, 4321
        self.joins: list[float | None] = []
        self.killed = False

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        self.joins.append(timeout)
        if self.stops_when_told and self.alive:
            self.exit(0)

    def kill(self) -> None:
        self.killed = True
        self.exit(-9)

    def exit(self, code: int) -> None:
        self.alive, self.exitcode = False, code
        os.close(self._exit_pipe)


def _addresses() -> tuple[str, str]:
    name = uuid.uuid4().hex
    return f"inproc://test-{name}-input", f"inproc://test-{name}-output"


@pytest.fixture
def client():
    client = CoreClient(zmq.Context.instance(), *_addresses())
    yield client
    client._close_sockets()


@pytest.fixture
def core_end(client):
    """The engine core's end of the client's sockets: it pulls the input, pushes the output."""
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(client.input_address)
    push.connect(client.output_address)
    yield pull, push
    pull.close(linger=0)
    push.close(linger=0)


def _mp_client(process: FakeProcess | None = None) -> MPCoreClient:
    """An MPCoreClient whose sockets are bound and whose process is ``process``, not started."""
    mp = MPCoreClient.__new__(MPCoreClient)
    mp._make_ipc_dir()
    CoreClient.__init__(mp, zmq.Context.instance(), *_addresses())
    mp.proc = process
    return mp


def _in_background(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


# ---- the sockets --------------------------------------------------------------------------------
def test_what_the_client_sends_reaches_the_core_and_what_the_core_sends_reaches_the_client(
    client, core_end
):
    pull, push = core_end
    client.send([SHUTDOWN])
    assert decode(pull.recv()) == [SHUTDOWN]
    push.send(encode([OUTPUTS, [1]]))
    assert decode(client.output_socket.recv()) == [OUTPUTS, [1]]


def test_a_burst_either_way_is_queued_whole_not_dropped(client, core_end):
    """No high-water mark on the client's sockets: a core busy with a long step, or an event
    loop busy with a long response, drops no request and no output."""
    pull, push = core_end
    for i in range(BURST):
        client.send([i], block=False)
    assert [decode(pull.recv())[0] for _ in range(BURST)] == list(range(BURST))
    for i in range(BURST):
        push.send(encode([i]), zmq.NOBLOCK)
    assert [decode(client.output_socket.recv())[0] for _ in range(BURST)] == list(range(BURST))


def test_a_send_without_a_core_to_read_it_neither_blocks_nor_raises_unless_asked_to_block(client):
    sending = _in_background(lambda: client.send([SHUTDOWN], block=False))
    sending.join(10)
    assert not sending.is_alive()


def test_a_closed_client_sends_nothing_and_says_nothing(client, core_end):
    pull, _ = core_end
    client._close_sockets()
    client.send([SHUTDOWN])
    assert client.closed and not pull.poll(100)
    assert client.input_socket.closed and client.output_socket.closed


def test_the_output_socket_serves_the_event_loop(client, core_end):
    _, push = core_end
    push.send(encode([READY, {}]))

    async def receive():
        return decode(await client.async_output_socket().recv())

    assert asyncio.run(receive()) == [READY, {}]


def test_a_client_that_runs_no_core_has_nothing_to_start_or_watch_and_no_lifetime(client):
    client.start()
    client.watch(asyncio.new_event_loop(), lambda reason: None)
    with pytest.raises(NotImplementedError):
        client.is_running()
    with pytest.raises(NotImplementedError):
        client.shutdown()


# ---- the engine core process ----------------------------------------------------------------
def test_the_socket_directory_is_new_private_and_short_enough_for_a_socket_path():
    mp = MPCoreClient.__new__(MPCoreClient)
    mp._make_ipc_dir()
    try:
        assert os.path.dirname(mp.ipc_dir) == tempfile.gettempdir()
        assert os.path.basename(mp.ipc_dir).startswith("pagedserve-")
        assert stat.S_IMODE(os.stat(mp.ipc_dir).st_mode) == 0o700
        assert len(f"{mp.ipc_dir}/output".encode()) <= 107
    finally:
        os.rmdir(mp.ipc_dir)


def test_the_sockets_go_in_tmpdir_where_their_paths_fit_and_in_tmp_where_not(
    short_tmp_path, monkeypatch
):
    # the longest socket is <parent>/pagedserve-<16 hex>/output: 35 bytes after the parent's
    room = core_client.SOCKET_PATH_MAX - len("/pagedserve-0123456789abcdef/output")
    for length, expected in ((room, "tmpdir"), (room + 1, "/tmp")):
        tmpdir = short_tmp_path / ("d" * (length - len(str(short_tmp_path)) - 1))
        tmpdir.mkdir()
        assert len(str(tmpdir)) == length
        monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
        assert core_client.ipc_parent_dir() == (str(tmpdir) if expected == "tmpdir" else "/tmp")
    # too long, and /tmp not writable: an error that says what to set
    monkeypatch.setattr(os, "access", lambda path, mode: path != "/tmp")
    with pytest.raises(RuntimeError, match=r"too long for the engine's sockets.*set TMPDIR"):
        core_client.ipc_parent_dir()


def test_a_socket_directory_that_exists_is_neither_taken_nor_removed(monkeypatch):
    clash, ours = uuid.uuid4(), uuid.uuid4()
    taken = os.path.join(tempfile.gettempdir(), f"pagedserve-{clash.hex[:16]}")
    os.mkdir(taken)
    names = iter([clash, ours])
    monkeypatch.setattr(core_client.uuid, "uuid4", lambda: next(names))
    mp = MPCoreClient.__new__(MPCoreClient)
    mp._make_ipc_dir()
    mp.proc = None
    assert mp.ipc_dir == os.path.join(tempfile.gettempdir(), f"pagedserve-{ours.hex[:16]}")
    mp.shutdown()
    assert os.path.isdir(taken) and not os.path.exists(mp.ipc_dir)
    os.rmdir(taken)


def test_the_core_is_spawned_with_its_sockets_and_a_daemon_only_at_tensor_parallel_size_1(
    monkeypatch,
):
    started, hooks = [], []

    class Process:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def start(self):
            started.append(self.kwargs)

    contexts = []
    monkeypatch.setattr(
        core_client.multiprocessing,
        "get_context",
        lambda method: contexts.append(method) or types.SimpleNamespace(Process=Process),
    )
    monkeypatch.setattr(
        core_client, "atexit", types.SimpleNamespace(register=hooks.append, unregister=hooks.remove)
    )
    for tp, daemon in [(1, True), (2, False)]:
        config = types.SimpleNamespace(parallel=types.SimpleNamespace(tensor_parallel_size=tp))
        mp = _mp_client()
        mp._start_core(config, "debug")
        kwargs = started[-1]
        assert kwargs["target"] is core_client._run_engine_core
        assert kwargs["args"] == (
            config, mp.input_address, mp.output_address, "debug", os.getpid()
        )  # fmt: skip
        assert kwargs["name"] == "pagedserve-engine-core" and kwargs["daemon"] is daemon
        assert hooks == [mp.shutdown]  # stopped at exit, unless shut down before
        mp.proc = None
        mp.shutdown()
        assert hooks == []
    assert contexts == ["spawn", "spawn"]  # torch must not be forked


def test_the_start_waits_for_ready_and_returns_the_info(monkeypatch):
    mp = _mp_client(FakeProcess())
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(mp.output_address)
    push.send(encode([OUTPUTS, [0, [], {}, [], []]]))  # not what it waits for
    push.send(encode([READY, {"model": "demo"}]))
    assert mp._wait_ready() == {"model": "demo"}
    push.close(linger=0)
    mp.shutdown()


@pytest.mark.parametrize(
    "user_error, raised", [(True, ValueError), (False, RuntimeError)], ids=["user", "internal"]
)
def test_a_core_that_cannot_start_raises_its_reason(user_error, raised):
    """A user's mistake (a bad model path, a bad option) is a ValueError the CLI prints as such."""
    mp = _mp_client(FakeProcess())
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(mp.output_address)
    push.send(encode([FAILED, "no model at /nowhere", user_error]))
    with pytest.raises(raised, match="^no model at /nowhere$"):
        mp._wait_ready()
    push.close(linger=0)
    mp.shutdown()


def test_a_core_that_exits_while_loading_raises_naming_its_exit_code():
    process = FakeProcess()
    process.exit(3)
    mp = _mp_client(process)
    message = "the engine core process exited with code 3 while loading; see the log above"
    with pytest.raises(RuntimeError, match=f"^{message}$"):
        mp._wait_ready()
    assert process.joins == [5]
    mp.shutdown()


def test_a_start_stopped_part_way_removes_what_it_made(monkeypatch):
    made = []

    def interrupted(self, config, log_level):
        made.append(self.ipc_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(MPCoreClient, "_start_core", interrupted)
    with pytest.raises(KeyboardInterrupt):
        MPCoreClient(types.SimpleNamespace())
    assert made and not os.path.exists(made[0])


def test_shutdown_tells_the_core_to_stop_waits_then_closes_and_removes_the_sockets():
    mp = _mp_client(FakeProcess())
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.connect(mp.input_address)
    mp.shutdown(timeout=7)
    assert decode(pull.recv()) == [SHUTDOWN]
    assert mp.proc.joins == [7] and not mp.proc.killed and not mp.is_running()
    assert mp.closed and not os.path.exists(mp.ipc_dir)
    pull.close(linger=0)


def test_a_core_that_does_not_stop_in_time_is_killed():
    mp = _mp_client(FakeProcess(stops_when_told=False))
    mp.shutdown(timeout=0.5)
    assert mp.proc.killed and mp.proc.joins == [0.5, 5]


def test_shutdown_of_a_core_already_gone_sends_nothing():
    process = FakeProcess()
    process.exit(0)
    mp = _mp_client(process)
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.connect(mp.input_address)
    mp.shutdown()
    assert not pull.poll(100) and process.joins == [] and mp.closed
    pull.close(linger=0)


def test_shutdown_of_a_start_stopped_before_its_sockets_removes_the_directory():
    mp = MPCoreClient.__new__(MPCoreClient)
    mp.proc = None
    mp._make_ipc_dir()
    mp.shutdown()
    assert not os.path.exists(mp.ipc_dir)


def test_the_core_process_is_watched_and_its_exit_reported_once_with_its_code():
    process = FakeProcess()
    mp = _mp_client(process)
    reasons = []

    async def main():
        loop = asyncio.get_running_loop()
        mp.watch(loop, reasons.append)
        assert mp.is_running() and mp.pid == 4321
        process.exit(7)
        for _ in range(20):
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert reasons == ["the engine core process exited with code 7"]
    assert process.joins == [1]
    mp.shutdown()


# ---- the core in a thread of this process -----------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    from pagedserve.presets import demo_model_dir
    from tests.helpers.models import tiny_engine

    return tiny_engine(demo_model_dir(), num_kv_pages=16, max_model_len=64, max_num_seqs=2)


def test_the_inproc_core_starts_once_and_stops_on_shutdown(engine):
    inproc = InprocCoreClient(engine)
    assert inproc.info["model"] == engine.config.model.model and not inproc.is_running()
    inproc.start()
    inproc.start()  # already running: nothing to do
    assert inproc.is_running()
    inproc.shutdown(timeout=30)
    assert not inproc.is_running() and inproc.closed
    inproc.shutdown()  # again: nothing left to stop
