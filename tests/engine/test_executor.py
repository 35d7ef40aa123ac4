"""The executors in this process: tp 1's on the one card, and the tensor-parallel one's start-up,
steps, health and shutdown, against stand-ins for its rank processes, their pipes, the rendezvous
and the collectives (test_tensor_parallel.py starts real ranks: too slow to run per mutant).

Each stand-in records what the executor asked of it, so that a test states the protocol: what rank
0 tells the ranks and when, how long it waits, and what it says when a rank fails."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from datetime import timedelta
from operator import index
from types import SimpleNamespace

import pytest
import torch

from pagedserve.config import EngineConfig, UsageContext
from pagedserve.engine import executor as ex
from pagedserve.engine.executor import (
    DEVICE_STATS,
    JOIN_TIMEOUT_S,
    JOINED_KEY,
    SPAWN_HINT,
    STEP,
    STOP,
    Executor,
    MultiprocExecutor,
    RendezvousTimeoutError,
)
from pagedserve.engine.model_runner import ModelInput

# a wait that never ends (for a rank's report, the rendezvous) fails its test instead
pytestmark = pytest.mark.timeout(60)

SERVER, LLM = UsageContext.OPENAI_API_SERVER, UsageContext.LLM_CLASS


def _config(**settings) -> EngineConfig:
    return EngineConfig.from_kwargs(**{"device": "cpu", **settings})


# ---- tp 1 -----------------------------------------------------------------------------------------
def test_a_single_card_executor_loads_one_worker_with_its_pool_and_runs_its_steps(tiny_glm4):
    config = _config(model=str(tiny_glm4[0]), dtype="float32", num_kv_pages=4)
    executor = Executor(config, LLM)
    assert executor.worker is None and executor.world_size == 1 and executor.failed is None
    worker = executor.load()
    assert worker is executor.worker and worker.usage_context is LLM
    assert (worker.device.rank, worker.device.world_size) == (0, 1)
    assert executor.runner is worker.runner and worker.device.kv_cache.shape[2] == 4
    worker.runner.execute_model = lambda sched, forks: ("ran", sched, forks)
    assert executor.execute_model("sched", "forks") == ("ran", "sched", "forks")
    assert executor.device_stats() == [worker.device_stats()]
    assert executor.check_health() is None and executor.worker_pids == []
    executor.shutdown()
    assert executor.worker is worker


def test_one_rank_gets_the_single_card_executor_and_more_the_multiprocess_one(monkeypatch):
    made = []
    monkeypatch.setattr(ex, "MultiprocExecutor", lambda *args: made.append(args) or "multi")
    one = _config()
    single = ex.create_executor(one, LLM)
    assert type(single) is Executor and (single.config, single.usage_context) == (one, LLM)
    assert not made
    config = _config(tensor_parallel_size=2)
    assert ex.create_executor(config, SERVER) == "multi" and made == [(config, SERVER)]


# ---- stand-ins ------------------------------------------------------------------------------------
class _Proc:
    """A rank's process: alive until ``end``; its sentinel is a pipe's end that is ready once
    it has ended."""

    def __init__(self, pid=4321, alive=True, exitcode=None):
        self.pid, self.exitcode, self._alive = pid, exitcode, alive
        self._watch, self._end = multiprocessing.Pipe(duplex=False)
        self.sentinel = self._watch.fileno()
        self.joins, self.killed, self.started, self.stops = [], False, False, False
        if not alive:
            self.end(exitcode)

    def is_alive(self):
        return self._alive

    def end(self, exitcode):
        self._alive, self.exitcode = False, exitcode
        self._end.close()

    def join(self, timeout=None):
        self.joins.append(timeout)
        if self.stops and self._alive:  # told to stop, it ends within the join
            self.end(0)

    def kill(self):
        self.killed = True
        self.end(-9)

    def start(self):
        self.started = True


def _executor(ranks=1, **parallel) -> MultiprocExecutor:
    """A MultiprocExecutor of ``ranks`` local ranks other than 0, past its start (none ran)."""
    e = MultiprocExecutor.__new__(MultiprocExecutor)
    e.config = _config(tensor_parallel_size=ranks + 1, **parallel)
    e.usage_context = SERVER
    e.world_size = ranks + 1
    e.failed, e.joined, e.loaded, e.closed = None, False, False, False
    e.procs, e.conns, e.reports, e.ends = {}, {}, {}, {}
    for rank in range(1, ranks + 1):
        parent, child = multiprocessing.Pipe()
        e.procs[rank], e.conns[rank], e.reports[rank], e.ends[rank] = _Proc(), parent, [], child
    return e


class _Device:
    """A card whose broadcasts are recorded (rank 0's) or answered from ``incoming`` (a rank's).
    On a ``meta`` card (memory that this process cannot read, as a CUDA card's for nccl) a
    broadcast answers with what it received in a tensor of its own."""

    def __init__(self, incoming=(), fail=False, torch_device="cpu"):
        self.sent, self.incoming, self.fail = [], list(incoming), fail
        self.torch_device, self.devices = torch.device(torch_device), []

    def broadcast(self, t, src=0):
        if self.fail:
            raise RuntimeError("gloo: connection closed by peer")
        self.devices.append(t.device)
        if t.is_meta:
            self.sent.append((t, src))
            return torch.tensor(self.incoming.pop(0), dtype=t.dtype) if self.incoming else t
        if self.incoming:
            t.copy_(torch.tensor(self.incoming.pop(0), dtype=t.dtype))
        self.sent.append((t.clone(), src))
        return t


def _loaded(e: MultiprocExecutor, device=None) -> MultiprocExecutor:
    e.worker = SimpleNamespace(
        device=device or _Device(),
        device_stats=lambda: {"card": 0},
        runner=SimpleNamespace(execute_model=lambda sched, forks: ("out", sched, forks)),
    )
    e.loaded = True
    return e


@pytest.fixture
def no_atexit(monkeypatch):
    """atexit's registrations, recorded instead of made."""
    calls = []
    monkeypatch.setattr(ex.atexit, "register", lambda f: calls.append(("register", f)))
    monkeypatch.setattr(ex.atexit, "unregister", lambda f: calls.append(("unregister", f)))
    return calls


# ---- start-up -------------------------------------------------------------------------------------
def test_the_executor_checks_then_starts_its_ranks_and_joins_them(monkeypatch, no_atexit):
    calls = []
    monkeypatch.setattr(ex, "check_parallel_config", lambda c, u: calls.append(("config", c, u)))
    monkeypatch.setattr(ex, "check_main_module", lambda: calls.append(("main",)))
    monkeypatch.setattr(ex, "check_no_process_group", lambda: calls.append(("group",)))
    monkeypatch.setattr(
        MultiprocExecutor, "_start_ranks", lambda s, lv: calls.append(("start", lv))
    )
    monkeypatch.setattr(MultiprocExecutor, "_join", lambda s: calls.append(("join",)))
    monkeypatch.setattr(ex, "_free_port", lambda: 5678)
    config = _config(tensor_parallel_size=4)
    e = MultiprocExecutor(config, LLM)
    assert calls == [("config", config, LLM), ("main",), ("group",), ("start", "info"), ("join",)]
    assert (e.config, e.usage_context, e.worker) == (config, LLM, None)
    assert e.world_size == 4 and e.address == "127.0.0.1:5678" and e.failed is None
    assert e.procs == e.conns == e.reports == {}
    assert (e.joined, e.loaded, e.closed) == (False, False, False)
    assert no_atexit == [("register", e.shutdown)]
    addressed = _config(tensor_parallel_size=2, dist_init_addr="10.0.0.1:29500")
    assert MultiprocExecutor(addressed, SERVER, "debug").address == "10.0.0.1:29500"
    assert calls[-2] == ("start", "debug")


@pytest.mark.parametrize("step", ["_start_ranks", "_join"])
def test_a_start_that_fails_stops_what_it_began_and_raises(monkeypatch, no_atexit, step):
    for check in ("check_parallel_config", "check_main_module", "check_no_process_group"):
        monkeypatch.setattr(ex, check, lambda *a: None)
    monkeypatch.setattr(MultiprocExecutor, "_start_ranks", lambda s, lv: None)
    monkeypatch.setattr(MultiprocExecutor, "_join", lambda s: None)

    def fail(*args):
        raise KeyboardInterrupt  # any exception, not only Exception's

    monkeypatch.setattr(MultiprocExecutor, step, fail)
    with pytest.raises(KeyboardInterrupt):
        MultiprocExecutor(_config(tensor_parallel_size=2), SERVER)
    register, unregister = no_atexit
    assert register[0] == "register" and unregister == ("unregister", register[1])


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_each_local_rank_starts_as_a_daemon_holding_its_end_of_a_pipe(monkeypatch, method):
    """Spawned or forked from a forkserver (START_METHOD_ENV); a forked rank takes on the
    environment its engine started in, which the forkserver may not have."""
    made, preloads = [], []

    class Ctx:
        def __init__(self, method):
            self.method = method

        def set_forkserver_preload(self, modules):
            preloads.append(modules)

        def Pipe(self):
            parent, child = multiprocessing.Pipe()
            return parent, child

        def Process(self, **kwargs):
            made.append((self.method, kwargs))
            return _Proc(pid=100 + len(made))

    monkeypatch.setattr(ex.torch.multiprocessing, "get_context", Ctx)
    if method == "spawn":
        monkeypatch.delenv(ex.START_METHOD_ENV, raising=False)  # the default
    else:
        monkeypatch.setenv(ex.START_METHOD_ENV, method)
    monkeypatch.setenv("PAGEDSERVE_PROBE", "set after the forkserver may have started")
    e = _executor(0, nnodes=2, dist_init_addr="h:1")
    e.config = _config(tensor_parallel_size=6, nnodes=2, dist_init_addr="h:1")  # 3 per node
    e.address = "h:1"
    e._start_ranks("warning")
    assert [m for m, _ in made] == [method, method]
    assert preloads == ([] if method == "spawn" else [[ex.__name__]])
    for rank, (_, kwargs) in zip((1, 2), made, strict=True):
        config, r, address, child, log_level, environ = kwargs["args"]
        assert kwargs["target"] is ex.run_worker and kwargs["daemon"] is True
        assert kwargs["name"] == f"pagedserve-tp-rank-{rank}"
        assert (config, r, address, log_level) == (e.config, rank, "h:1", "warning")
        # a spawned rank inherits the environment of the moment itself
        assert environ == (None if method == "spawn" else dict(os.environ))
        assert child.closed  # the rank's end, closed here once the rank has it
        assert e.procs[rank].started and e.reports[rank] == []
        e.conns[rank].close()
    assert list(e.procs) == list(e.conns) == [1, 2]


def test_rank_0_joins_the_rendezvous_on_its_cards_backend_watching_its_ranks(monkeypatch):
    calls = []
    monkeypatch.setattr(ex, "init_distributed", lambda *a: calls.append(a))
    e = _executor(1)
    e.address = "127.0.0.1:1"
    e._join()
    ((parallel, rank, backend, address, check),) = calls
    assert (parallel, rank, backend, address) == (e.config.parallel, 0, "gloo", "127.0.0.1:1")
    assert check == e._check_starting and e.joined


@pytest.mark.parametrize("never_ran", [False, True])
def test_a_rendezvous_that_times_out_says_why_a_rank_never_ran_if_one_did_not(
    monkeypatch, never_ran
):
    timeout = RendezvousTimeoutError("only 0 of the 1 other ranks joined")

    def init(*args):
        raise timeout

    monkeypatch.setattr(ex, "init_distributed", init)
    e = _executor(1)
    e.address = "127.0.0.1:1"
    if never_ran:
        e.ends[1].send(("nothing",))  # alive, and not yet running run_worker
    else:
        e.ends[1].send(("started",))
    with pytest.raises(Exception) as raised:
        e._join()
    if never_ran:
        assert str(raised.value).startswith("tensor-parallel rank 1 (pid 4321) never ran")
        assert raised.value.__suppress_context__
    else:
        assert raised.value is timeout
    assert not e.joined


def test_loading_builds_rank_0s_worker_waits_for_the_ranks_then_takes_its_pool(monkeypatch):
    calls = []

    class FakeWorker:
        def __init__(self, *args):
            calls.append(("worker", *args))
            self.runner = SimpleNamespace()

        def init_kv_cache(self):
            calls.append(("kv",))

    monkeypatch.setattr(ex, "Worker", FakeWorker)
    monkeypatch.setattr(MultiprocExecutor, "_wait_loaded", lambda s: calls.append(("wait",)))
    e = _executor(2)
    e.usage_context = LLM
    worker = e.load()
    assert calls == [("worker", e.config, 0, 3, LLM), ("wait",), ("kv",)]
    assert worker is e.worker and e.loaded
    assert worker.runner.broadcast_step == e._broadcast_step


def test_a_load_that_fails_shuts_the_ranks_down(monkeypatch, no_atexit):
    class FakeWorker:
        def __init__(self, *args):
            self.runner = SimpleNamespace()

        def init_kv_cache(self):
            raise ValueError("no room for KV pages")

    monkeypatch.setattr(ex, "Worker", FakeWorker)
    monkeypatch.setattr(MultiprocExecutor, "_wait_loaded", lambda s: None)
    e = _executor(1)
    with pytest.raises(ValueError, match="no room"):
        e.load()
    assert e.closed and not e.loaded and e.procs == {}
    assert not hasattr(e.worker.runner, "broadcast_step")


def test_loading_waits_until_every_rank_says_it_is_ready(monkeypatch):
    e = _executor(2)
    for rank in (1, 2):
        e.ends[rank].send(("started",))
        e.ends[rank].send(("ready",))
    e._wait_loaded()
    assert e.reports == {1: [("started",), ("ready",)], 2: [("started",), ("ready",)]}


def test_loading_reads_a_ranks_reports_as_they_come():
    e = _executor(1)
    e.ends[1].send(("started",))

    def later():
        e.ends[1].send(("ready",))

    timer = threading.Timer(0.2, later)
    timer.start()
    e._wait_loaded()
    timer.join()
    assert e.reports[1] == [("started",), ("ready",)]


def test_a_rank_that_cannot_load_fails_the_load_with_its_reason():
    e = _executor(2)
    e.ends[1].send(("started",))
    e.ends[1].send(("ready",))
    e.ends[2].send(("started",))
    e.ends[2].send(("error", "cannot split this model", True))
    with pytest.raises(ValueError, match="^cannot split this model$"):
        e._wait_loaded()


def test_a_rank_that_reports_then_fails_is_not_waited_for():
    e = _executor(1)
    e.ends[1].send(("started",))

    def fail():
        e.ends[1].send(("error", "Traceback: boom", False))

    timer = threading.Timer(0.2, fail)
    timer.start()
    with pytest.raises(RuntimeError, match="rank 1 failed while starting:\nTraceback: boom"):
        e._wait_loaded()
    timer.join()


def test_a_rank_that_dies_while_loading_fails_the_load_saying_how_it_ended():
    e = _executor(1)
    e.ends[1].send(("started",))
    e.ends[1].close()
    e.procs[1].end(-9)
    with pytest.raises(RuntimeError) as raised:
        e._wait_loaded()
    assert str(raised.value) == (
        "tensor-parallel rank 1 (pid 4321) exited with code -9 while starting (see its output "
        "above)"
    )


def test_a_rank_whose_process_ends_with_its_pipe_still_open_fails_the_load():
    e = _executor(1)
    e.procs[1].end(1)  # the sentinel is ready, the pipe is not
    with pytest.raises(RuntimeError, match="exited with code 1 before it ran"):
        e._wait_loaded()


def test_while_joining_a_dead_local_rank_fails_the_start_and_live_ones_do_not():
    e = _executor(2)
    e._check_starting()
    e.procs[2].end(3)
    with pytest.raises(RuntimeError, match="^tensor-parallel rank 2 .* exited with code 3"):
        e._check_starting()


def test_reading_reports_takes_all_that_came_and_says_when_the_rank_is_gone():
    e = _executor(1)
    e.ends[1].send(("started",))
    e.ends[1].send(("ready",))
    assert e._read_reports(1) and e.reports[1] == [("started",), ("ready",)]
    assert e._read_reports(1) and len(e.reports[1]) == 2
    e.ends[1].close()
    assert not e._read_reports(1)  # EOF
    e.conns[1].close()
    assert not e._read_reports(1)  # OSError: a closed handle


def test_the_first_report_of_a_status_is_found():
    e = _executor(1)
    e.reports[1] = [("started",), ("error", "a", True), ("error", "b", False)]
    assert e._reported(1, "error") == ("error", "a", True)
    assert e._reported(1, "ready") is None


@pytest.mark.parametrize(
    "exitcode, output", [(1, "its traceback is above"), (2, "see its output above")]
)
def test_a_rank_that_never_ran_is_the_main_modules_re_import_with_the_fix(exitcode, output):
    e = _executor(1)
    e.procs[1].end(exitcode)
    error = e._start_error(1)
    assert type(error) is RuntimeError and str(error) == (
        f"tensor-parallel rank 1 (pid 4321) exited with code {exitcode} before it ran "
        f"({output}). {SPAWN_HINT}"
    )
    assert e.procs[1].joins == [JOIN_TIMEOUT_S]


def test_a_rank_gone_after_it_ran_says_so_without_the_spawn_hint():
    e = _executor(1)
    e.ends[1].send(("started",))
    e.procs[1].end(1)
    assert str(e._start_error(1)) == (
        "tensor-parallel rank 1 (pid 4321) exited with code 1 while starting (its traceback is "
        "above)"
    )


def test_a_ranks_own_error_is_its_reason_a_users_as_a_value_error():
    e = _executor(1)
    e.ends[1].send(("started",))
    e.ends[1].send(("error", "Traceback...\nOSError: disk", False))
    error = e._start_error(1)
    assert type(error) is RuntimeError
    assert (
        str(error) == "tensor-parallel rank 1 failed while starting:\nTraceback...\nOSError: disk"
    )
    e.reports[1] = [("error", "--dtype 'x' is not supported", True)]
    error = e._start_error(1)
    assert type(error) is ValueError and str(error) == "--dtype 'x' is not supported"
    assert e.procs[1].joins == []  # it said why: no wait for its end


def test_ranks_still_re_importing_at_the_timeout_are_named_with_the_fix():
    e = _executor(3, dist_timeout=2.5)
    e.procs[2].pid, e.procs[3].pid = 22, 33
    e.ends[1].send(("started",))
    assert "(pid" in str(e._never_ran_error())
    e.usage_context = LLM
    error = e._never_ran_error()
    assert str(error) == (
        "tensor-parallel rank 2 (pid 22), 3 (pid 33) never ran within 2.5 s (dist_timeout): its "
        "process is still re-importing the program's main module, as multiprocessing's spawn "
        "does first. Importing the main module must only define things: put what the program "
        'does (not only the LLM(...)) under `if __name__ == "__main__":`; on a machine that is '
        "merely busy, raise dist_timeout"
    )
    e.ends[2].close()  # gone: its own error says why
    e.ends[3].send(("started",))
    assert e._never_ran_error() is None


def test_the_timeout_names_the_servers_flag():
    e = _executor(1, dist_timeout=30)
    assert "never ran within 30 s (--dist-timeout)" in str(e._never_ran_error())


# ---- steps ----------------------------------------------------------------------------------------
def test_a_step_runs_on_rank_0_after_the_health_check():
    e = _loaded(_executor(1))
    assert e.execute_model("sched", "forks") == ("out", "sched", "forks")
    e.procs[1].end(-9)
    with pytest.raises(RuntimeError, match="exited with code -9"):
        e.execute_model("sched", "forks")


def test_a_failed_collective_fails_the_step_and_the_executor():
    e = _loaded(_executor(1))
    cause = RuntimeError("gloo: connection reset")

    def broken(sched, forks):
        raise cause

    e.worker.runner.execute_model = broken
    with pytest.raises(RuntimeError) as raised:
        e.execute_model("sched", "forks")
    assert str(raised.value) == (
        "a tensor-parallel rank failed during a step: gloo: connection reset"
    )
    assert raised.value.__cause__ is cause and e.failed == str(raised.value)
    with pytest.raises(RuntimeError, match="^a tensor-parallel rank failed during a step"):
        e.check_health()


def _step() -> ModelInput:
    return ModelInput([5, 6, 7], [0, 1, 2], [8, 9, 10], [0, 3], [3], [[1, 2]], [2], [(1, 4)])


def test_each_step_is_broadcast_from_rank_0_as_a_header_then_the_step():
    device = _Device()
    e = _loaded(_executor(1), device)
    step = _step()
    e._broadcast_step(step)
    (header, src0), (payload, src1) = device.sent
    assert header.dtype == torch.long and header.tolist() == [STEP, step.to_tensor().numel()]
    assert torch.equal(payload, step.to_tensor()) and src0 == src1 == 0


def test_a_message_without_a_payload_is_its_header_alone():
    device = _Device()
    e = _loaded(_executor(1), device)
    e._send(STOP)
    ((header, src),) = device.sent
    assert header.tolist() == [STOP, 0] and header.dtype == torch.long and src == 0


def test_device_stats_gather_every_cards_figures_at_rank_0(monkeypatch):
    device = _Device()
    e = _loaded(_executor(2), device)
    gathered = []

    def gather_object(obj, object_list, dst):
        gathered.append((obj, dst))
        object_list[:] = [obj, {"card": 1}, {"card": 2}]

    monkeypatch.setattr(ex.dist, "gather_object", gather_object)
    assert e.device_stats() == [{"card": 0}, {"card": 1}, {"card": 2}]
    assert gathered == [({"card": 0}, 0)]
    assert [h.tolist() for h, _ in device.sent] == [[DEVICE_STATS, 0]]


def test_device_stats_gather_into_a_list_of_one_entry_per_rank(monkeypatch):
    e = _loaded(_executor(2))
    sizes = []
    monkeypatch.setattr(ex.dist, "gather_object", lambda o, lst, dst: sizes.append(list(lst)))
    assert e.device_stats() == [None, None, None] and sizes == [[None, None, None]]


def test_device_stats_of_a_failed_executor_are_refused(monkeypatch):
    e = _loaded(_executor(1))
    e.failed = "gone"
    monkeypatch.setattr(ex.dist, "gather_object", lambda *a, **k: pytest.fail("gathered"))
    with pytest.raises(RuntimeError, match="^gone$"):
        e.device_stats()


# ---- health and shutdown --------------------------------------------------------------------------
def test_health_names_the_first_dead_rank_and_stays_failed():
    e = _executor(2)
    e.check_health()
    e.procs[2].pid = 77
    e.procs[2].end(-9)
    message = "tensor-parallel worker rank 2 (pid 77) exited with code -9"
    with pytest.raises(RuntimeError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        e.check_health()
    assert e.failed == message
    e.procs.clear()
    with pytest.raises(RuntimeError) as raised:
        e.check_health()
    assert str(raised.value) == message


def test_health_after_shutdown_says_the_ranks_were_shut_down():
    e = _executor(1)
    e.closed, e.failed = True, "a rank died"
    with pytest.raises(RuntimeError) as raised:
        e.check_health()
    assert str(raised.value) == "the tensor-parallel ranks were shut down"


def test_the_worker_pids_are_the_local_ranks():
    e = _executor(2)
    e.procs[1].pid, e.procs[2].pid = 11, 12
    assert e.worker_pids == [11, 12]


def test_shutdown_tells_loaded_ranks_to_stop_waits_for_them_and_leaves_the_group(
    monkeypatch, no_atexit
):
    destroyed = []
    monkeypatch.setattr(ex.dist, "destroy_process_group", lambda: destroyed.append(True))
    device = _Device()
    e = _loaded(_executor(2), device)
    e.joined = True
    procs, conns = dict(e.procs), dict(e.conns)
    procs[1].stops = True  # rank 2 ignores the STOP
    e.shutdown()
    assert [h.tolist() for h, _ in device.sent] == [[STOP, 0]]
    assert procs[1].joins == [JOIN_TIMEOUT_S] and not procs[1].killed
    assert procs[2].joins == [JOIN_TIMEOUT_S, JOIN_TIMEOUT_S] and procs[2].killed
    assert all(c.closed for c in conns.values()) and e.procs == e.conns == {}
    assert e.closed and not e.joined and destroyed == [True]
    assert no_atexit == [("unregister", e.shutdown)]
    e.shutdown()  # once only
    assert destroyed == [True] and len(no_atexit) == 1 and len(device.sent) == 1


def test_shutdown_kills_at_once_ranks_it_could_not_tell_to_stop(monkeypatch, no_atexit):
    monkeypatch.setattr(ex.dist, "destroy_process_group", lambda: pytest.fail("not in a group"))
    e = _executor(2)  # not loaded: the ranks do not wait for rank 0's messages yet
    procs = dict(e.procs)
    procs[1].end(0)
    e.shutdown()
    assert procs[1].joins == [0] and not procs[1].killed
    assert procs[2].joins == [0, JOIN_TIMEOUT_S] and procs[2].killed


def test_ranks_are_told_to_stop_only_when_all_are_loaded_alive_and_healthy():
    device = _Device()
    e = _loaded(_executor(2), device)
    assert e._tell_ranks_to_stop() and [h.tolist() for h, _ in device.sent] == [[STOP, 0]]
    e.loaded = False
    assert not e._tell_ranks_to_stop()
    e.loaded, e.failed = True, "a step failed"
    assert not e._tell_ranks_to_stop()
    e.failed = None
    e.procs[2].end(-9)
    assert not e._tell_ranks_to_stop()
    assert len(device.sent) == 1


def test_a_stop_that_cannot_be_sent_is_not_waited_for():
    e = _loaded(_executor(1), _Device(fail=True))
    assert e._tell_ranks_to_stop() is False


# ---- checks before the start ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "settings, usage, message",
    [
        (
            {"tensor_parallel_size": 3, "nnodes": 2, "dist_init_addr": "h:1"},
            SERVER,
            "--tensor-parallel-size 3 cannot be spread evenly over --nnodes 2; use a multiple of 2",
        ),
        (
            {"tensor_parallel_size": 4, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"},
            LLM,
            "node_rank=2 must be less than nnodes 2",
        ),
        (
            {"tensor_parallel_size": 4, "nnodes": 2},
            SERVER,
            "--nnodes 2 needs --dist-init-addr HOST:PORT, the address of node 0 that every node "
            "can reach",
        ),
        (
            {"tensor_parallel_size": 18, "nnodes": 2, "dist_init_addr": "h:1", "device": "kunlun-emu"},
            LLM,
            "tensor_parallel_size 9 asks for more cards than device 'kunlun-emu' has: 8 card(s) "
            "per node; use tensor_parallel_size 8 or less, or add nodes with --nnodes",
        ),
    ],
)  # fmt: skip
def test_sizes_the_node_or_the_flags_cannot_give_are_refused(settings, usage, message):
    with pytest.raises(ValueError) as raised:
        ex.check_parallel_config(_config(**settings), usage)
    assert str(raised.value) == message


def test_a_node_of_the_last_rank_with_an_address_passes_the_checks(caplog):
    config = _config(tensor_parallel_size=4, nnodes=2, node_rank=1, dist_init_addr="h:1")
    with caplog.at_level(logging.WARNING, logger=ex.__name__):
        ex.check_parallel_config(config, SERVER)
        ex.check_parallel_config(_config(tensor_parallel_size=2), SERVER)  # one node: no address
    assert caplog.records == []


def test_ranks_fewer_than_a_nodes_cards_leave_the_rest_named_in_a_warning(caplog):
    config = _config(tensor_parallel_size=6, nnodes=2, dist_init_addr="h:1", device="kunlun-emu")
    with caplog.at_level(logging.WARNING, logger=ex.__name__):
        ex.check_parallel_config(config, SERVER)
    assert [r.getMessage() for r in caplog.records] == [
        "6 ranks use 3 of the 8 cards of kunlun-emu per node; cards 3, 4, 5, 6, 7 stay unused"
    ]
    assert caplog.records[0].levelno == logging.WARNING


def test_a_process_already_in_a_group_is_refused_a_second_engine(monkeypatch):
    ex.check_no_process_group()
    monkeypatch.setattr(ex.dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError) as raised:
        ex.check_no_process_group()
    assert str(raised.value) == (
        "torch.distributed is already initialised in this process: one tensor-parallel engine "
        "per process; shut the other one down first (LLM.shutdown())"
    )


# ---- the rendezvous -------------------------------------------------------------------------------
class _Store:
    """A TCP store whose joined count is ``counts``, one per look (the last repeats)."""

    def __init__(self, counts=(0,)):
        self.counts, self.adds = list(counts), []

    def add(self, key, n):
        self.adds.append((key, n))
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]


def _rendezvous(monkeypatch, store):
    calls = []
    monkeypatch.setattr(
        ex, "_join_store", lambda p, r, a: calls.append(("store", p, r, a)) or store
    )
    monkeypatch.setattr(ex, "_wait_for_ranks", lambda *a: calls.append(("wait", *a)))
    monkeypatch.setattr(ex.dist, "init_process_group", lambda *a, **k: calls.append(("init", a, k)))
    return calls


def test_rank_0_hosts_the_store_waits_for_the_others_then_forms_the_group(monkeypatch):
    store = _Store()
    calls = _rendezvous(monkeypatch, store)
    parallel = _config(tensor_parallel_size=4).parallel
    check = object()
    ex.init_distributed(parallel, 0, "gloo", "h:1", check)
    assert calls == [
        ("store", parallel, 0, "h:1"),
        ("wait", store, parallel, "h:1", check),
        ("init", ("gloo",), {"store": store, "rank": 0, "world_size": 4, "timeout": timedelta(days=30)}),
    ]  # fmt: skip
    assert store.adds == []


def test_another_rank_counts_itself_in_then_forms_the_group(monkeypatch):
    store = _Store()
    calls = _rendezvous(monkeypatch, store)
    parallel = _config(tensor_parallel_size=2).parallel
    ex.init_distributed(parallel, 1, "nccl", "h:1")
    assert [c[0] for c in calls] == ["store", "init"] and store.adds == [(JOINED_KEY, 1)]
    assert calls[1][2] == {
        "store": store, "rank": 1, "world_size": 2, "timeout": ex.GROUP_TIMEOUT
    }  # fmt: skip


def test_no_rendezvous_is_joined_by_a_process_already_in_a_group(monkeypatch):
    calls = _rendezvous(monkeypatch, _Store())
    monkeypatch.setattr(ex.dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialised"):
        ex.init_distributed(_config(tensor_parallel_size=2).parallel, 1, "gloo", "h:1")
    assert calls == []


@pytest.mark.parametrize("rank, master", [(0, True), (1, False)])
def test_the_store_is_at_the_address_hosted_by_rank_0_for_every_rank(monkeypatch, rank, master):
    made = []
    monkeypatch.setattr(ex.dist, "TCPStore", lambda *a, **k: made.append((a, k)) or "store")
    parallel = _config(tensor_parallel_size=4, dist_timeout=7.5).parallel
    assert ex._join_store(parallel, rank, "[::1]:29500") == "store"
    assert made == [
        (
            ("[::1]", 29500, 4),
            {"is_master": master, "timeout": timedelta(seconds=7.5), "wait_for_workers": False},
        )
    ]


@pytest.mark.parametrize("error", [RuntimeError, ValueError, OSError])
@pytest.mark.parametrize(
    "rank, role", [(0, "host the rendezvous at"), (2, "reach the rendezvous at")]
)
def test_a_store_that_cannot_be_made_is_refused_naming_the_address_and_the_flags(
    monkeypatch, error, rank, role
):
    def fail(*args, **kwargs):
        raise error("connection refused")

    monkeypatch.setattr(ex.dist, "TCPStore", fail)
    parallel = _config(tensor_parallel_size=4, nnodes=2, dist_timeout=3).parallel
    with pytest.raises(ValueError) as raised:
        ex._join_store(parallel, rank, "h:29500")
    assert str(raised.value) == (
        f"tensor-parallel rank {rank} could not {role} h:29500 within 3 s (connection refused); "
        "check --dist-init-addr, that node 0 is started and that every node of --nnodes 2 joins "
        "(or raise --dist-timeout)"
    )
    assert raised.value.__suppress_context__


class _Clock:
    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += 1.0


def test_rank_0_polls_the_joined_count_checking_its_ranks_until_all_have_joined(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(ex.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(ex.time, "sleep", clock.sleep)
    store, checks = _Store([0, 1, 2, 3]), []
    parallel = _config(tensor_parallel_size=4, dist_timeout=3).parallel
    ex._wait_for_ranks(store, parallel, "h:1", lambda: checks.append(clock.now))
    assert store.adds == [(JOINED_KEY, 0)] * 4
    assert checks == [100.0, 101.0, 102.0] and clock.sleeps == [ex.JOIN_POLL_S] * 3
    ex._wait_for_ranks(_Store([0, 3]), parallel, "h:1", None)  # no check to make


def test_rank_0_gives_up_after_dist_timeout_saying_how_many_joined(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(ex.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(ex.time, "sleep", clock.sleep)
    parallel = _config(tensor_parallel_size=4, nnodes=2, dist_timeout=2).parallel
    with pytest.raises(RendezvousTimeoutError) as raised:
        ex._wait_for_ranks(_Store([0, 1]), parallel, "h:1", None)
    assert str(raised.value) == (
        "tensor-parallel rank 0 hosted the rendezvous at h:1, but only 1 of the 3 other ranks "
        "joined within 2 s; check --dist-init-addr, that node 0 is started and that every node "
        "of --nnodes 2 joins (or raise --dist-timeout)"
    )
    assert clock.now == 103.0  # looked at 100, 101, 102 (the deadline) and 103
    assert isinstance(raised.value, ValueError)


def test_a_rank_found_dead_while_waiting_ends_the_wait(monkeypatch):
    def dead():
        raise RuntimeError("rank 1 exited")

    monkeypatch.setattr(ex.time, "sleep", lambda s: pytest.fail("waited"))
    parallel = _config(tensor_parallel_size=2).parallel
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        ex._wait_for_ranks(_Store([0]), parallel, "h:1", dead)


# ---- the main module ------------------------------------------------------------------------------
def test_a_ranks_re_import_that_starts_an_engine_is_refused(monkeypatch):
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError) as raised:
        ex.check_main_module()
    assert str(raised.value) == (
        "this is a tensor-parallel rank's process re-importing the program's main module, and "
        f"the main module starts a tensor-parallel engine when imported. {SPAWN_HINT}"
    )


def _main(monkeypatch, tmp_path, path, spec=None, original_dir=None):
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__file__=path, __spec__=spec))
    monkeypatch.setattr(multiprocessing.process, "ORIGINAL_DIR", original_dir)
    monkeypatch.chdir(tmp_path)


def test_a_main_module_read_from_stdin_is_refused(monkeypatch, tmp_path):
    _main(monkeypatch, tmp_path, "<stdin>", original_dir=str(tmp_path))
    with pytest.raises(RuntimeError) as raised:
        ex.check_main_module()
    assert str(raised.value) == (
        "tensor-parallel ranks cannot start: this program's main module is '<stdin>', which a "
        f"rank's process cannot read again. {SPAWN_HINT}"
    )


def test_a_script_is_found_from_where_the_program_started(monkeypatch, tmp_path):
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "script.py").write_text("")
    _main(monkeypatch, tmp_path, "script.py", original_dir=str(tmp_path / "started"))
    ex.check_main_module()
    _main(monkeypatch, tmp_path / "started", "script.py", original_dir=None)
    ex.check_main_module()  # from the working directory, where none is recorded
    _main(monkeypatch, tmp_path, "script.py", original_dir=None)
    with pytest.raises(RuntimeError, match="main module is 'script.py'"):
        ex.check_main_module()


def test_a_module_run_by_name_or_an_interactive_session_needs_no_file(monkeypatch, tmp_path):
    _main(monkeypatch, tmp_path, "missing.py", spec=SimpleNamespace(name="app"))
    ex.check_main_module()
    _main(monkeypatch, tmp_path, None)
    ex.check_main_module()
    monkeypatch.delitem(sys.modules, "__main__")
    ex.check_main_module()


def test_a_free_port_is_an_unprivileged_port_nobody_listens_on():
    port = ex._free_port()
    assert type(port) is int and 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ---- the other ranks ------------------------------------------------------------------------------
class _Conn:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


@pytest.fixture
def rank_process(monkeypatch):
    """run_worker's surroundings, recorded: signals, logging, threads, rendezvous, worker, loop."""
    calls = []
    monkeypatch.setattr(ex.signal, "signal", lambda s, h: calls.append(("signal", s, h)))
    monkeypatch.setattr(ex.logging, "basicConfig", lambda **k: calls.append(("logging", k)))
    monkeypatch.setattr(ex, "_exit_with_parent", lambda: calls.append(("watch",)))
    monkeypatch.setattr(ex.torch, "get_num_threads", lambda: 8)
    # operator.index refuses a float, as torch.set_num_threads does
    monkeypatch.setattr(ex.torch, "set_num_threads", lambda n: calls.append(("threads", index(n))))
    monkeypatch.setattr(ex, "init_distributed", lambda *a: calls.append(("join", *a)))

    class FakeWorker:
        def __init__(self, *args):
            calls.append(("worker", *args))
            self.device = SimpleNamespace(describe=lambda: "cpu card 1")

        def init_kv_cache(self):
            calls.append(("kv",))

    monkeypatch.setattr(ex, "Worker", FakeWorker)
    monkeypatch.setattr(ex, "worker_loop", lambda w: calls.append(("loop", type(w))))
    monkeypatch.setattr(ex.dist, "destroy_process_group", lambda: calls.append(("leave",)))
    return SimpleNamespace(calls=calls, Worker=FakeWorker)


def test_a_local_rank_reports_started_joins_loads_reports_ready_then_runs_steps(
    rank_process, caplog
):
    config, conn = _config(tensor_parallel_size=3), _Conn()
    with caplog.at_level(logging.INFO, logger=ex.__name__):
        ex.run_worker(config, 2, "h:1", conn, "debug")
    assert conn.sent == [("started",), ("ready",)]
    assert rank_process.calls == [
        ("signal", signal.SIGINT, signal.SIG_IGN),
        ("signal", signal.SIGTERM, signal.SIG_IGN),
        ("logging", {"level": "DEBUG", "format": ex.LOG_FORMAT}),
        ("watch",),
        ("threads", 2),  # 8 threads shared by 3 ranks: 2 each
        ("join", config.parallel, 2, "gloo", "h:1"),
        ("worker", config, 2, 3),
        ("kv",),
        ("loop", rank_process.Worker),
        ("leave",),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        "tensor-parallel rank 2 ready on cpu card 1"
    ]


def test_a_local_ranks_logging_is_at_info_unless_told(rank_process):
    ex.run_worker(_config(tensor_parallel_size=2), 1, "h:1", _Conn())
    assert ("logging", {"level": "INFO", "format": ex.LOG_FORMAT}) in rank_process.calls


def test_a_nodes_first_rank_keeps_its_signals_and_logging_and_a_thread_at_least(rank_process):
    config = _config(tensor_parallel_size=16, nnodes=1)
    ex.run_worker(config, 0, "h:1")
    assert [c[0] for c in rank_process.calls] == [
        "watch", "threads", "join", "worker", "kv", "loop", "leave"
    ]  # fmt: skip
    assert ("threads", 1) in rank_process.calls  # 8 // 16 is 0


@pytest.mark.parametrize(
    "error, user_error", [(ValueError, True), (TypeError, True), (FileNotFoundError, True)]
)
def test_a_rank_that_cannot_start_reports_a_users_error_as_its_text(
    rank_process, monkeypatch, error, user_error
):
    def fail(*args):
        raise error("bad flag")

    monkeypatch.setattr(ex, "init_distributed", fail)
    conn = _Conn()
    with pytest.raises(SystemExit) as exited:
        ex.run_worker(_config(tensor_parallel_size=2), 1, "h:1", conn)
    assert exited.value.code == 1
    assert conn.sent == [("started",), ("error", "bad flag", user_error)]


def test_a_rank_that_fails_otherwise_reports_its_traceback(rank_process, monkeypatch):
    monkeypatch.setattr(rank_process.Worker, "__init__", lambda self, *a: 1 / 0)
    conn = _Conn()
    with pytest.raises(SystemExit):
        ex.run_worker(_config(tensor_parallel_size=2), 1, "h:1", conn)
    (_, (kind, text, user_error)) = conn.sent
    assert kind == "error" and user_error is False
    assert text.startswith("Traceback (most recent call last):")
    assert text.endswith("ZeroDivisionError: division by zero\n")
    assert ("kv",) not in rank_process.calls


def test_a_rank_without_a_pipe_raises_its_error(rank_process, monkeypatch):
    def fail(*args):
        raise ValueError("could not reach the rendezvous")

    monkeypatch.setattr(ex, "init_distributed", fail)
    with pytest.raises(ValueError, match="could not reach"):
        ex.run_worker(_config(tensor_parallel_size=2), 1, "h:1")


def test_a_rank_ends_when_the_process_that_started_it_ends(monkeypatch):
    watch, parent_end = multiprocessing.Pipe(duplex=False)
    parent = SimpleNamespace(sentinel=watch.fileno(), pid=999)
    monkeypatch.setattr(ex.multiprocessing, "parent_process", lambda: parent)
    exits, threads = [], []
    ended = threading.Event()
    monkeypatch.setattr(ex.os, "_exit", lambda code: (exits.append(code), ended.set()))

    class Thread(threading.Thread):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            threads.append(self)

    monkeypatch.setattr(ex.threading, "Thread", Thread)
    ex._exit_with_parent()
    (thread,) = threads
    assert thread.daemon and thread.is_alive() and not exits
    parent_end.close()
    assert ended.wait(10) and exits == [1]
    thread.join(10)
    watch.close()


def test_a_process_without_a_parent_watches_nothing(monkeypatch):
    monkeypatch.setattr(ex.multiprocessing, "parent_process", lambda: None)
    monkeypatch.setattr(ex.threading, "Thread", lambda **k: pytest.fail("a thread started"))
    ex._exit_with_parent()


def test_a_rank_runs_each_step_it_is_sent_answers_for_its_card_and_stops_when_told(monkeypatch):
    step = _step().to_tensor()
    device = _Device(incoming=[[STEP, step.numel()], step.tolist(), [DEVICE_STATS, 0], [STOP, 0]])
    ran, gathered = [], []
    worker = SimpleNamespace(
        device=device,
        device_stats=lambda: {"card": 1},
        runner=SimpleNamespace(run_step=ran.append),
    )
    monkeypatch.setattr(
        ex.dist, "gather_object", lambda o, lst, dst: gathered.append((o, lst, dst))
    )
    ex.worker_loop(worker)
    assert ran == [_step()] and gathered == [({"card": 1}, None, 0)]
    assert [(t.dtype, t.shape, src) for t, src in device.sent] == [
        (torch.long, (2,), 0), (torch.long, step.shape, 0), (torch.long, (2,), 0),
        (torch.long, (2,), 0),
    ]  # fmt: skip


def test_a_node_other_than_0_starts_its_ranks_and_runs_its_first_itself(monkeypatch):
    made, calls = [], []

    class Ctx:
        def __init__(self, method):
            assert method == "spawn"

        def Process(self, **kwargs):
            made.append(kwargs)
            return _Proc(pid=len(made))

    monkeypatch.setattr(ex.torch.multiprocessing, "get_context", Ctx)
    monkeypatch.setattr(ex, "check_parallel_config", lambda c, u: calls.append(("check", c, u)))
    monkeypatch.setattr(ex, "run_worker", lambda *a: calls.append(("run", *a)))
    config = _config(tensor_parallel_size=6, nnodes=2, node_rank=1, dist_init_addr="h:29500")
    assert ex.serve_node(config, "warning") == 0
    assert calls == [("check", config, SERVER), ("run", config, 3, "h:29500")]
    assert [k["args"] for k in made] == [
        (config, 4, "h:29500", None, "warning", None),
        (config, 5, "h:29500", None, "warning", None),
    ]
    assert all(k["target"] is ex.run_worker and k["daemon"] is True for k in made)


def test_a_nodes_ranks_are_started_before_its_first_and_joined_after_it(monkeypatch):
    procs, args = [], []

    class Ctx:
        def __init__(self, method):
            pass

        def Process(self, **kwargs):
            args.append(kwargs["args"])
            procs.append(_Proc())
            return procs[-1]

    monkeypatch.setattr(ex.torch.multiprocessing, "get_context", Ctx)
    monkeypatch.setattr(ex, "check_parallel_config", lambda c, u: None)
    seen = []
    monkeypatch.setattr(ex, "run_worker", lambda *a: seen.append([p.started for p in procs]))
    config = _config(tensor_parallel_size=2, nnodes=1, dist_init_addr="h:1")
    assert ex.serve_node(config) == 0
    assert seen == [[True]] and procs[0].joins == [JOIN_TIMEOUT_S]
    assert args == [(config, 1, "h:1", None, "info", None)]  # the default log level


def test_every_message_lives_in_the_cards_own_memory_on_both_ends(monkeypatch):
    """nccl moves only tensors in the card's memory: a meta card stands for one here."""
    card = _Device(torch_device="meta")
    _loaded(_executor(1), card)._broadcast_step(_step())
    step = _step().to_tensor()
    rank = _Device(incoming=[[STEP, step.numel()], step.tolist(), [STOP, 0]], torch_device="meta")
    ran = []
    ex.worker_loop(SimpleNamespace(device=rank, runner=SimpleNamespace(run_step=ran.append)))
    assert card.devices == rank.devices[:2] and ran == [_step()]
    assert {d.type for d in card.devices + rank.devices} == {"meta"} and len(rank.devices) == 3
