"""The HTTP side's channel to an engine core, without spawning one: the client's two sockets (what
it sends arrives, nothing is dropped or blocks on a burst, a closed client sends nothing), the
in-process core's thread, and the engine core process's lifetime (its socket directory, its
start, READY or FAILED, its exit seen and reported, a bounded shutdown that kills a core that
does not stop) against a stand-in for the process."""

from __future__ import annotations

import asyncio
import logging
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
from pagedserve.engine.messages import FAILED, OUTPUTS, READY, SHUTDOWN, UTILITY, decode, encode

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
    _within(mp._make_ipc_dir)
    CoreClient.__init__(mp, zmq.Context.instance(), *_addresses())
    mp.proc = process
    return mp


def _in_background(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _within(fn, seconds: float = 10):
    """``fn()``, failing the test if it has not returned or raised in ``seconds``: a wait that
    never ends fails its test instead of stalling the run."""
    result: dict = {}

    def call() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the test's thread
            result["error"] = e

    running = _in_background(call)
    running.join(seconds)
    assert not running.is_alive(), f"the call waited over {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def _wait_ready(mp: MPCoreClient, seconds: float = 10) -> dict:
    """``mp._wait_ready()``, failing the test if it has not returned or raised in ``seconds``."""
    return _within(mp._wait_ready, seconds)


def _recv(socket: zmq.Socket, seconds: float = 10) -> list:
    """The next message on ``socket``, failing the test if none comes in ``seconds``."""
    assert socket.poll(seconds * 1000), f"no message in {seconds} s"
    return decode(socket.recv())


# ---- the sockets --------------------------------------------------------------------------------
def test_what_the_client_sends_reaches_the_core_and_what_the_core_sends_reaches_the_client(
    client, core_end
):
    pull, push = core_end
    client.send([SHUTDOWN])
    assert _recv(pull) == [SHUTDOWN]
    push.send(encode([OUTPUTS, [1]]))
    assert _recv(client.output_socket) == [OUTPUTS, [1]]


def test_a_burst_either_way_is_queued_whole_not_dropped(client, core_end):
    """No high-water mark on the client's sockets: a core busy with a long step, or an event
    loop busy with a long response, drops no request and no output."""
    pull, push = core_end
    for i in range(BURST):
        client.send([i], block=False)
    assert [_recv(pull)[0] for _ in range(BURST)] == list(range(BURST))
    for i in range(BURST):
        push.send(encode([i]), zmq.NOBLOCK)
    assert [_recv(client.output_socket)[0] for _ in range(BURST)] == list(range(BURST))


def test_a_message_sent_before_the_core_connects_waits_for_it(client):
    sending = _in_background(lambda: client.send([SHUTDOWN]))
    sending.join(1)  # the core connects late (still loading): the send waits, dropping nothing
    assert sending.is_alive(), "the send returned with no core connected to take its message"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.connect(client.input_address)
    try:
        assert pull.poll(10_000) and decode(pull.recv()) == [SHUTDOWN]
        sending.join(10)
        assert not sending.is_alive()
    finally:
        pull.close(linger=0)


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
        return decode(await asyncio.wait_for(client.async_output_socket().recv(), 10))

    assert asyncio.run(receive()) == [READY, {}]


def test_a_client_that_runs_no_core_has_nothing_to_start_or_watch_and_no_lifetime(client):
    client.start()
    client.watch(asyncio.new_event_loop(), lambda reason: None)
    with pytest.raises(NotImplementedError):
        client.is_running()
    with pytest.raises(NotImplementedError):
        client.shutdown(10.0)
    assert client.exit_reason() == "it is not running"


# ---- the engine core process ----------------------------------------------------------------
def test_the_socket_directory_is_new_private_and_short_enough_for_a_socket_path():
    mp = MPCoreClient.__new__(MPCoreClient)
    _within(mp._make_ipc_dir)
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
    with pytest.raises(
        RuntimeError, match=r"too long for the engine's sockets.*set TMPDIR to a shorter directory$"
    ):
        core_client.ipc_parent_dir()


def test_a_tmpdir_the_client_cannot_write_to_sends_the_sockets_to_tmp(short_tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp_path))
    writable = os.access
    # as root every directory is writable: the check is asked of a stand-in that says no to it
    monkeypatch.setattr(
        os,
        "access",
        lambda path, mode: (
            writable(path, mode) and not (path == str(short_tmp_path) and mode & os.W_OK)
        ),
    )
    assert core_client.ipc_parent_dir() == "/tmp"


def test_a_socket_directory_that_exists_is_neither_taken_nor_removed(monkeypatch):
    clash, ours = uuid.uuid4(), uuid.uuid4()
    taken = os.path.join(tempfile.gettempdir(), f"pagedserve-{clash.hex[:16]}")
    os.mkdir(taken)
    names = iter([clash, ours])
    monkeypatch.setattr(core_client.uuid, "uuid4", lambda: next(names))
    mp = MPCoreClient.__new__(MPCoreClient)
    _within(mp._make_ipc_dir)
    mp.proc = None
    assert mp.ipc_dir == os.path.join(tempfile.gettempdir(), f"pagedserve-{ours.hex[:16]}")
    _within(mp.shutdown)
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
        _within(mp.shutdown)
        assert hooks == []
    assert contexts == ["spawn", "spawn"]  # torch must not be forked


def test_the_start_waits_for_ready_and_returns_the_info(monkeypatch):
    mp = _mp_client(FakeProcess())
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(mp.output_address)
    push.send(encode([OUTPUTS, [0, [], {}, [], []]]))  # not what it waits for
    push.send(encode([READY, {"model": "demo"}]))
    assert _wait_ready(mp) == {"model": "demo"}
    push.close(linger=0)
    _within(mp.shutdown)


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
        _wait_ready(mp)
    push.close(linger=0)
    _within(mp.shutdown)


def test_a_core_that_exits_while_loading_raises_naming_its_exit_code():
    process = FakeProcess()
    process.exit(3)
    mp = _mp_client(process)
    message = "the engine core process exited with code 3 while loading; see the log above"
    with pytest.raises(RuntimeError, match=f"^{message}$"):
        _wait_ready(mp)
    assert process.joins == [5]
    _within(mp.shutdown)


def test_a_start_stopped_part_way_removes_what_it_made(monkeypatch):
    made = []

    def interrupted(self, config, log_level):
        made.append(self.ipc_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(MPCoreClient, "_start_core", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _within(lambda: MPCoreClient(types.SimpleNamespace(), "info"))
    assert made and not os.path.exists(made[0])


def test_the_start_hands_the_core_its_config_and_log_level_and_keeps_the_info_it_sends(
    monkeypatch,
):
    config, started = types.SimpleNamespace(), []

    def start_core(self, config, log_level):
        started.append((config, log_level))
        self.proc = FakeProcess()

    monkeypatch.setattr(MPCoreClient, "_start_core", start_core)
    monkeypatch.setattr(MPCoreClient, "_wait_ready", lambda self: {"model": "demo"})
    mp = _within(lambda: MPCoreClient(config, "debug"))
    assert started == [(config, "debug")] and mp.info == {"model": "demo"}
    _within(mp.shutdown)


def test_a_start_that_fails_after_the_core_started_stops_it_within_a_bounded_wait(monkeypatch):
    """A core that does not stop when told (one stuck loading) is killed after 5 s, not waited
    for without end."""
    processes = []

    def start_core(self, config, log_level):
        self.proc = FakeProcess(stops_when_told=False)
        processes.append(self.proc)

    def wait_ready(self):
        raise RuntimeError("no model at /nowhere")

    monkeypatch.setattr(MPCoreClient, "_start_core", start_core)
    monkeypatch.setattr(MPCoreClient, "_wait_ready", wait_ready)
    with pytest.raises(RuntimeError, match="^no model at /nowhere$"):
        _within(lambda: MPCoreClient(types.SimpleNamespace(), "info"))
    (process,) = processes
    assert process.killed and process.joins == [5, 5]


def test_a_start_that_fails_before_making_its_socket_directory_removes_nothing(monkeypatch):
    removed = []

    def no_room():
        raise RuntimeError("the temporary directory is too long for the engine's sockets")

    monkeypatch.setattr(core_client, "ipc_parent_dir", no_room)
    monkeypatch.setattr(core_client.shutil, "rmtree", lambda path, **kw: removed.append(path))
    with pytest.raises(RuntimeError, match="too long for the engine's sockets"):
        _within(lambda: MPCoreClient(types.SimpleNamespace(), "info"))
    assert removed == []


def test_shutdown_tells_the_core_to_stop_waits_then_closes_and_removes_the_sockets():
    mp = _mp_client(FakeProcess())
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.connect(mp.input_address)
    _within(lambda: mp.shutdown(timeout=7))
    assert _recv(pull) == [SHUTDOWN]
    assert mp.proc.joins == [7] and not mp.proc.killed and not mp.is_running()
    assert mp.closed and not os.path.exists(mp.ipc_dir)
    pull.close(linger=0)


def test_a_shutdown_without_a_timeout_waits_the_shutdown_bound():
    mp = _mp_client(FakeProcess(stops_when_told=False))
    _within(mp.shutdown)
    assert mp.proc.joins == [core_client.SHUTDOWN_TIMEOUT_S, 5] and mp.proc.killed


def test_a_core_that_does_not_stop_in_time_is_killed():
    mp = _mp_client(FakeProcess(stops_when_told=False))
    _within(lambda: mp.shutdown(timeout=0.5))
    assert mp.proc.killed and mp.proc.joins == [0.5, 5]


def test_shutdown_of_a_core_already_gone_sends_nothing():
    process = FakeProcess()
    process.exit(0)
    mp = _mp_client(process)
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.connect(mp.input_address)
    _within(mp.shutdown)
    assert not pull.poll(100) and process.joins == [] and mp.closed
    pull.close(linger=0)


def test_a_start_stopped_after_a_name_clash_removes_nothing(monkeypatch):
    clash = uuid.uuid4()
    taken = os.path.join(tempfile.gettempdir(), f"pagedserve-{clash.hex[:16]}")
    os.mkdir(taken)
    names = iter([clash])

    def uuid4():
        try:
            return next(names)
        except StopIteration:
            raise KeyboardInterrupt from None  # a signal before the second try

    removed = []
    monkeypatch.setattr(core_client.uuid, "uuid4", uuid4)
    monkeypatch.setattr(core_client.shutil, "rmtree", lambda path, **kw: removed.append(path))
    try:
        with pytest.raises(KeyboardInterrupt):
            _within(lambda: MPCoreClient(types.SimpleNamespace(), "info"))
        assert removed == [] and os.path.isdir(taken)
    finally:
        os.rmdir(taken)


def test_shutdown_of_a_client_whose_socket_directory_is_gone_raises_nothing():
    """The core removes the directory itself when it outlives the HTTP process's last word."""
    mp = _mp_client(None)
    os.rmdir(mp.ipc_dir)
    _within(mp.shutdown)
    assert mp.closed


def test_shutdown_of_a_start_stopped_before_its_sockets_removes_the_directory():
    mp = MPCoreClient.__new__(MPCoreClient)
    mp.proc = None
    _within(mp._make_ipc_dir)
    _within(mp.shutdown)
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
    _within(mp.shutdown)


def test_an_exited_core_is_named_by_its_exit_code_before_the_watcher_runs():
    process = FakeProcess()
    mp = _mp_client(process)
    assert mp.exit_reason() == "it is not running"  # no exit code: still running, or not started
    process.exit(-9)
    assert mp.exit_reason() == "the engine core process exited with code -9"
    _within(mp.shutdown)


# ---- the core in a thread of this process -----------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    from pagedserve.presets import demo_model_dir
    from tests.helpers.models import tiny_engine

    return tiny_engine(demo_model_dir(), num_kv_pages=16, max_model_len=64, max_num_seqs=2)


def test_the_inproc_core_starts_once_and_stops_on_shutdown(engine):
    inproc = InprocCoreClient(engine)
    try:
        assert inproc.info["model"] == engine.config.model.model and not inproc.is_running()
        inproc.start()
        inproc.start()  # already running: nothing to do
        assert inproc.is_running()
    finally:
        _within(lambda: inproc.shutdown(timeout=30), 60)
    assert not inproc.is_running() and inproc.closed
    inproc.shutdown()  # again: nothing left to stop


def test_the_inproc_core_answers_over_the_clients_sockets(engine):
    inproc = InprocCoreClient(engine)
    inproc.start()
    try:
        # its loop's first message (a heartbeat at the latest) says its input is connected:
        # a send now cannot wait on a core that is not there
        assert inproc.output_socket.poll(30_000), "the in-process core sent nothing for 30 s"
        _within(lambda: inproc.send([UTILITY, 1, "get_stats", []]))
        replies = []
        while not replies:
            assert inproc.output_socket.poll(30_000), "the in-process core sent nothing for 30 s"
            kind, payload = decode(inproc.output_socket.recv())
            assert kind == OUTPUTS
            replies = payload[3]
        ((call_id, ok, stats),) = replies
        assert call_id == 1 and ok and stats["num_requests_running"] == 0
    finally:
        _within(lambda: inproc.shutdown(timeout=30), 60)


def test_shutdown_stops_the_inproc_core_without_its_loop_dying(engine, caplog):
    inproc = InprocCoreClient(engine)
    inproc.start()
    with caplog.at_level(logging.ERROR, logger="pagedserve.engine.core"):
        _within(lambda: inproc.shutdown(timeout=30), 60)
    assert not inproc.is_running() and caplog.records == []


def test_shutdown_gives_up_on_an_inproc_core_that_does_not_stop_after_its_timeout(engine):
    inproc = InprocCoreClient(engine)
    core_input = zmq.Context.instance().socket(zmq.PULL)  # a core stuck in a step: reads nothing
    core_input.connect(inproc.input_address)
    release = threading.Event()
    inproc.thread = _in_background(release.wait)
    stopping = _in_background(lambda: inproc.shutdown(timeout=0.1))
    stopping.join(10)
    try:
        assert not stopping.is_alive() and inproc.thread.is_alive() and inproc.closed
    finally:
        release.set()
        core_input.close(linger=0)


def test_the_inproc_core_thread_does_not_keep_the_process_from_exiting(engine):
    inproc = InprocCoreClient(engine)
    assert inproc.thread.daemon
    inproc.shutdown()


def test_in_process_cores_side_by_side_each_bind_sockets_of_their_own(engine):
    first = InprocCoreClient(engine)
    second = InprocCoreClient(engine)  # would fail to bind an address the first one holds
    assert {first.input_address, first.output_address}.isdisjoint(
        {second.input_address, second.output_address}
    )
    first.shutdown()
    second.shutdown()
