"""The engine core (EngineCore, its busy loop EngineCoreProc) and the HTTP side's core client, in
this process over in-process sockets: token ids out per step, pause holding requests (an abort
while paused drops the held one), rejections and failed steps reported per request, utility
calls answered (an unknown one refused by name), and when the loop dies every pending call and
request fails at once."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import types
import uuid

import pytest
import zmq

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.core import HEARTBEAT_S, LOG_FORMAT, EngineCore, EngineCoreProc
from pagedserve.engine.core_client import InprocCoreClient
from pagedserve.engine.messages import (
    ABORT,
    ADD,
    DEAD,
    FAILED,
    OUTPUTS,
    READY,
    SHUTDOWN,
    UTILITY,
    decode,
    encode,
    outputs_from_wire,
    params_to_wire,
)
from pagedserve.engine.output_processor import EngineDeadError
from pagedserve.hal.faults import UnrecoverableFaultError
from pagedserve.presets import demo_model_dir
from pagedserve.sampling_params import SamplingParams
from tests.helpers.models import tiny_engine

PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    """The demo model (it ships with the package: nothing to build, no transformers import)."""
    return tiny_engine(demo_model_dir(), num_kv_pages=64, max_model_len=128, max_num_seqs=4)


@pytest.fixture
def core(engine):
    """A fresh core over the module's engine, which every test leaves drained."""
    core = EngineCore(engine)
    yield core
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0


def run(core: EngineCore) -> list:
    outputs = []
    while core.has_work():
        outputs += core.step()
    return outputs


def reference(engine, params=GREEDY) -> list[int]:
    engine.block_manager.reset_prefix_cache()
    core = EngineCore(engine)
    core.add_request("ref", PROMPT, params)
    return [o.new_token_ids[0] for o in run(core)]


# ---- EngineCore ---------------------------------------------------------------------------------
def test_each_step_sends_one_token_id_per_sequence_and_the_first_carries_its_info(core):
    core.add_request("a", PROMPT, GREEDY, arrival_time=1.5)
    outputs = run(core)
    assert [o.request_id for o in outputs] == ["a"] * 4
    assert [len(o.new_token_ids) for o in outputs] == [1] * 4
    assert [o.finish_reason for o in outputs] == [None, None, None, "length"]
    prompt_logprobs, num_cached, scheduled, first_token = outputs[0].first
    assert prompt_logprobs is None and num_cached == 0 and scheduled <= first_token
    assert all(o.first is None for o in outputs[1:])
    assert all(o.new_logprobs is None and o.stop_reason is None for o in outputs)  # none asked
    assert core.num_steps == 4 and core.get_stats()["num_adds"] == 1


def test_the_core_leaves_detokenizing_to_the_http_process(core):
    core.add_request("a", PROMPT, GREEDY)
    assert core.engine.groups["a"].detokenizers == [None]
    run(core)


def test_outputs_carry_each_steps_logprobs_when_asked_and_the_stop_token_that_ended_them(core):
    expected = reference(core.engine)
    stop = expected[2]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, stop_token_ids=[stop])
    core.add_request("a", PROMPT, params)
    outputs = run(core)
    assert [o.new_token_ids[0] for o in outputs] == expected[: expected.index(stop) + 1]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop
    for o in outputs:
        (chosen,) = o.new_token_ids
        (top,) = o.new_logprobs  # this step's token's, not the sequence's so far
        assert len(top) == 2 and max(top, key=top.get) == chosen  # greedy: the top one


def test_a_requests_arrival_time_reaches_the_engine_held_or_not(core):
    core.add_request("a", PROMPT, GREEDY, arrival_time=1.5)
    core.pause()
    core.add_request("held", PROMPT, GREEDY, arrival_time=2.5)
    core.resume()
    assert core.engine.groups["a"].seqs[0].arrival_time == 1.5
    assert core.engine.groups["held"].seqs[0].arrival_time == 2.5
    ctx = zmq.Context.instance()
    sockets = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        EngineCoreProc(core, *sockets)._handle(
            [ADD, "wire", PROMPT, params_to_wire(GREEDY), 3.5, None]
        )
    finally:
        for s in sockets:
            s.close(linger=0)
    assert core.engine.groups["wire"].seqs[0].arrival_time == 3.5
    run(core)


def test_requests_sent_while_paused_are_held_and_an_abort_drops_the_held_one(core):
    expected = reference(core.engine)
    core.pause()
    core.add_request("kept", PROMPT, GREEDY)
    core.add_request("dropped", PROMPT, GREEDY)
    assert not core.has_work()
    assert core.get_stats()["num_held"] == 2 and not core.engine.has_unfinished_requests()
    core.abort([["dropped", None]])
    assert core.get_stats()["num_held"] == 1
    core.resume()
    outputs = run(core)
    assert {o.request_id for o in outputs} == {"kept"}
    assert [o.new_token_ids[0] for o in outputs] == expected
    assert core.get_stats()["num_adds"] == 2


def test_a_request_the_engine_refuses_is_reported_by_id(core):
    core.add_request("huge", list(range(5, 300)), GREEDY)
    (error,) = core.take_errors()
    assert error[:2] == ["huge", "rejected"] and "max_model_len" in error[2]
    assert core.take_errors() == [] and not core.has_work()


def test_requests_the_engine_ends_in_a_step_are_reported_by_id_and_kind(core, monkeypatch):
    monkeypatch.setattr(core.engine, "take_rejected", lambda: [("r", "no room for it")])
    monkeypatch.setattr(core.engine, "take_failed", lambda: [("f", "its forward pass failed")])
    assert core.step() == []
    assert core.take_errors() == [
        ["r", "rejected", "no room for it"],
        ["f", "step_failed", "its forward pass failed"],
    ]


def test_a_step_that_fails_outside_the_forward_pass_fails_every_request_in_flight(
    core, monkeypatch
):
    core.add_request("a", PROMPT, GREEDY)
    core.add_request("b", PROMPT, GREEDY)

    def broken():
        raise KeyError("scheduler bug")

    monkeypatch.setattr(core.engine, "execute_step", broken)
    assert core.step() == []
    errors = core.take_errors()
    assert [e[:2] for e in errors] == [["a", "step_failed"], ["b", "step_failed"]]
    assert all("KeyError('scheduler bug')" in e[2] for e in errors)
    monkeypatch.undo()
    assert not core.has_work() and core.num_steps == 0


def test_an_unrecoverable_fault_leaves_the_step_and_the_core(core, monkeypatch):
    def unrecoverable():
        raise UnrecoverableFaultError("weight page gone")

    monkeypatch.setattr(core.engine, "execute_step", unrecoverable)
    core.add_request("a", PROMPT, GREEDY)
    with pytest.raises(UnrecoverableFaultError):
        core.step()
    core.abort([["a", None]])


def test_aborting_one_sequence_leaves_its_siblings(core):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    core.add_request("n", PROMPT, params)
    core.step()
    core.abort([["n", 1]])
    outputs = run(core)
    assert {o.index for o in outputs} == {0}


def test_the_invariant_check_reports_what_is_in_flight_and_the_pages_it_holds(core):
    idle = core.check_invariants()
    assert idle == {
        "problems": [],
        "num_requests_running": 0,
        "num_requests_waiting": 0,
        "num_groups": 0,
        "kv_cache_usage_perc": 0.0,
        "num_kv_pages_in_use": 0,
    }
    core.engine.block_manager.reset_prefix_cache()
    core.add_request("a", PROMPT, GREEDY)
    core.add_request("b", PROMPT, GREEDY)
    core.step()
    busy = core.check_invariants()
    pages = {p for rid in ("a", "b") for p in core.engine.block_manager.get_block_table(rid)}
    assert busy["problems"] == [] and busy["num_groups"] == 2
    assert busy["num_requests_running"] + busy["num_requests_waiting"] == 2
    assert busy["num_kv_pages_in_use"] == len(pages) > 0
    assert busy["kv_cache_usage_perc"] == len(pages) / core.engine.num_kv_pages
    run(core)


def test_a_step_encoded_is_the_outputs_message_the_loop_sends(core):
    core.add_request("a", PROMPT, GREEDY)
    kind, payload = decode(core.step_encoded())
    message = outputs_from_wire(payload)
    assert kind == OUTPUTS and message.step == core.num_steps == 1
    assert [(o.request_id, len(o.new_token_ids)) for o in message.outputs] == [("a", 1)]
    assert message.stats["num_steps"] == 1 and message.utility_results == message.errors == []
    run(core)


def test_the_ready_info_names_the_model_its_limits_and_where_its_tokenizer_is(core):
    engine = core.engine
    info = core.info()
    assert info["model"] == engine.config.model.model
    assert info["limits"] == engine.limits.to_dict() and info["describe"] == engine.describe()
    assert info["tokenizer_dir"] == str(engine.model_path)  # no --tokenizer: the model's own
    assert info["worker_pids"] == engine.executor.worker_pids


def test_a_scrub_on_demand_verifies_every_weight_page(core):
    pages = core.engine.device.num_weight_pages
    assert pages > 0
    assert core.scrub_weights() == {"pages_verified": pages, "pages_restored": 0}


def test_a_fault_to_inject_is_handed_to_the_engine_as_asked(core, monkeypatch):
    asked = []
    monkeypatch.setattr(core.engine, "inject_fault", lambda *a: asked.append(a) or {"ok": 1})
    assert core.inject_fault("kv_bitflip", "layer0", 3) == {"ok": 1}
    assert core.inject_fault("weight_bitflip") == {"ok": 1}
    assert asked == [("kv_bitflip", "layer0", 3), ("weight_bitflip", None, None)]


def test_the_ready_info_of_an_engine_without_a_tokenizer_names_no_tokenizer(core, monkeypatch):
    monkeypatch.setattr(core.engine, "tokenizer", None)
    assert core.info()["tokenizer_dir"] is None


# ---- EngineCoreProc over sockets ------------------------------------------------------------
class Loop:
    """EngineCoreProc in a thread over in-process sockets; this side sends and receives."""

    def __init__(self, core: EngineCore):
        ctx = zmq.Context.instance()
        name = f"inproc://core-test-{uuid.uuid4().hex}"  # a closed socket frees its name late
        self.to_core, self.from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.to_core.bind(name + "-in")
        self.from_core.bind(name + "-out")
        core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        core_in.connect(name + "-in")
        core_out.connect(name + "-out")
        self.proc = EngineCoreProc(core, core_in, core_out)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.proc.run_busy_loop()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def send(self, message: list) -> None:
        self.to_core.send(encode(message))

    def receive_until(self, wanted) -> list:
        """Messages up to and including the first that ``wanted(message)`` accepts."""
        messages = []
        while not messages or not wanted(messages[-1]):
            assert self.from_core.poll(60_000), "the core loop sent nothing for 60 s"
            messages.append(decode(self.from_core.recv()))
        return messages

    def call(self, call_id: int, name: str, *args) -> list:
        self.send([UTILITY, call_id, name, list(args)])
        (*_, last) = self.receive_until(lambda m: m[0] == OUTPUTS and m[1][3])
        (result,) = last[1][3]
        return result

    def stop(self) -> None:
        self.send([SHUTDOWN])
        self.thread.join(30)
        assert not self.thread.is_alive()
        for s in (self.to_core, self.from_core, self.proc.input_socket, self.proc.output_socket):
            s.close(linger=0)


def test_the_loop_answers_utility_calls_and_refuses_an_unknown_one_by_name(core):
    loop = Loop(core)
    try:
        assert loop.call(1, "get_page_map")[:2] == [1, True]
        assert loop.call(2, "shutdown") == [2, False, "no utility call 'shutdown'"]
        assert loop.call(3, "inject_fault", "disk") == [
            3,
            False,
            "fault injection needs --device kunlun-emu, not cpu",
        ]  # a ValueError: the caller's mistake, its message as it is
        assert loop.call(4, "get_stats", "extra")[:2] == [4, False]
        assert "TypeError" in loop.call(5, "get_stats", "extra")[2]  # other errors: their repr
    finally:
        loop.stop()
    assert loop.error is None


def test_an_idle_loop_blocks_on_its_input_and_beats_each_heartbeat_without_a_step(core):
    loop = Loop(core)
    try:
        time.sleep(4 * HEARTBEAT_S)
        messages = []
        while loop.from_core.poll(0):
            messages.append(decode(loop.from_core.recv()))
    finally:
        loop.stop()
    assert 1 <= len(messages) <= 6  # a beat each HEARTBEAT_S; a loop that never blocks: thousands
    assert all(m[0] == OUTPUTS and outputs_from_wire(m[1]).outputs == [] for m in messages)
    assert core.num_steps == 0


def test_the_loop_streams_a_request_and_stops_on_shutdown(core):
    expected = reference(core.engine)
    loop = Loop(core)
    try:
        loop.send([ADD, "a", PROMPT, params_to_wire(GREEDY), 0.0, None])
        messages = loop.receive_until(lambda m: any(o[4] for o in outputs_from_wire(m[1]).outputs))
        outputs = [o for m in messages for o in outputs_from_wire(m[1]).outputs]
        assert [o.new_token_ids[0] for o in outputs] == expected
        assert outputs_from_wire(messages[-1][1]).stats["num_requests_running"] == 0
    finally:
        loop.stop()
    assert loop.error is None and not loop.thread.is_alive()


def test_the_loop_aborts_a_request_mid_generation(core):
    loop = Loop(core)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    try:
        loop.send([ADD, "long", PROMPT, params_to_wire(params), 0.0, None])
        loop.receive_until(lambda m: outputs_from_wire(m[1]).outputs)
        loop.send([ABORT, [["long", None]]])
        (*_, idle) = loop.receive_until(
            lambda m: outputs_from_wire(m[1]).stats["num_requests_running"] == 0
        )
        assert core.engine.get_num_unfinished_requests() == 0
        assert outputs_from_wire(idle[1]).stats["generation_tokens_total"] > 0
    finally:
        loop.stop()


def test_a_dying_loop_says_why_before_it_goes(core, monkeypatch):
    def unrecoverable():
        raise UnrecoverableFaultError("weight page gone")

    monkeypatch.setattr(core.engine, "scrub_weights", unrecoverable)
    loop = Loop(core)
    loop.send([UTILITY, 1, "scrub_weights", []])
    (*_, dead) = loop.receive_until(lambda m: m[0] == DEAD)
    loop.thread.join(30)
    assert "weight page gone" in dead[1] and isinstance(loop.error, UnrecoverableFaultError)
    for s in (loop.to_core, loop.from_core, loop.proc.input_socket, loop.proc.output_socket):
        s.close(linger=0)


# ---- the engine core process's entry point, in a thread of this one --------------------------
class CoreProcess:
    """``run_engine_core`` as the spawned process runs it, in a thread, over ipc sockets that this
    side (the HTTP process) binds: its signals, logging, exits and engine are stand-ins."""

    def __init__(self, tmp_dir, monkeypatch, load, parent_pid: int | None = None):
        from pagedserve.engine import core as core_module

        self.dir = tmp_dir / "sockets"
        self.dir.mkdir()
        self.input_address, self.output_address = (f"ipc://{self.dir}/{n}" for n in ("in", "out"))
        ctx = zmq.Context.instance()
        self.to_core, self.from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.to_core.bind(self.input_address)
        self.from_core.bind(self.output_address)
        self.signals, self.log_config, self.loaded, self.logging_shut = [], [], [], []
        monkeypatch.setattr(
            core_module, "signal", types.SimpleNamespace(
                signal=lambda *a: self.signals.append(a), SIGINT=signal.SIGINT,
                SIGTERM=signal.SIGTERM, SIG_IGN=signal.SIG_IGN,
            ),
        )  # fmt: skip
        monkeypatch.setattr(
            core_module.logging, "basicConfig", lambda **kw: self.log_config.append(kw)
        )
        monkeypatch.setattr(core_module.logging, "shutdown", lambda: self.logging_shut.append(1))
        monkeypatch.setattr(core_module.os, "_exit", self._exit)
        monkeypatch.setattr(
            core_module, "LLMEngine", lambda config: self.loaded.append(config) or load()
        )
        self.config = types.SimpleNamespace()
        self.parent_pid = os.getppid() if parent_pid is None else parent_pid
        self.exit: dict = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @staticmethod
    def _exit(code: int) -> None:
        raise SystemExit(code)

    def _run(self) -> None:
        from pagedserve.engine.core import run_engine_core

        try:
            run_engine_core(
                self.config, self.input_address, self.output_address, "debug", self.parent_pid
            )
            self.exit["returned"] = True
        except SystemExit as e:
            self.exit["code"] = e.code
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.exit["error"] = e

    def receive(self) -> list:
        assert self.from_core.poll(30_000), "the engine core sent nothing for 30 s"
        return decode(self.from_core.recv())

    def join(self) -> dict:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the engine core did not end in 30 s"
        return self.exit

    def close(self) -> None:
        self.to_core.close(linger=0)
        self.from_core.close(linger=0)


@pytest.fixture
def shutdowns(engine, monkeypatch) -> list:
    """The module engine's shutdowns, which only count here (a core process shuts its engine
    down as it ends)."""
    calls: list = []
    monkeypatch.setattr(engine, "shutdown", lambda: calls.append(1))
    return calls


def test_the_core_process_ignores_signals_says_ready_and_stops_on_shutdown(
    engine, shutdowns, short_tmp_path, monkeypatch
):
    """A Ctrl-C or SIGTERM to the process group must not kill the core under a draining server."""
    proc = CoreProcess(short_tmp_path, monkeypatch, lambda: engine)
    try:
        kind, info = proc.receive()
        assert kind == READY and info == EngineCore(engine).info()
        proc.to_core.send(encode([SHUTDOWN]))
        assert proc.join() == {"returned": True}
        assert proc.receive()[0] == OUTPUTS  # the last iteration's message is still delivered
    finally:
        proc.close()
    assert proc.loaded == [proc.config] and shutdowns == [1]
    assert proc.signals == [(signal.SIGINT, signal.SIG_IGN), (signal.SIGTERM, signal.SIG_IGN)]
    assert proc.log_config == [{"level": "DEBUG", "format": LOG_FORMAT}]
    assert proc.dir.is_dir() and proc.logging_shut == []  # the HTTP process removes its sockets


@pytest.mark.parametrize(
    "error, user_error",
    [
        (ValueError("no model at /nowhere"), True),
        (TypeError("max_model_len must be an int"), True),
        (FileNotFoundError("/nowhere/config.json"), True),
        (RuntimeError("out of memory"), False),
        (KeyError("layers"), False),
    ],
    ids=["value", "type", "file", "runtime", "key"],
)
def test_a_core_that_cannot_load_says_why_and_exits_1(
    error, user_error, short_tmp_path, monkeypatch, caplog
):
    """A user's mistake (a bad path, a bad option) is sent as its message, to be printed as it is;
    anything else as its repr, a bug to report."""

    def load():
        raise error

    proc = CoreProcess(short_tmp_path, monkeypatch, load)
    try:
        assert proc.receive() == [FAILED, str(error) if user_error else repr(error), user_error]
        assert proc.join() == {"code": 1}
    finally:
        proc.close()
    # a bug's traceback is logged here; a user's mistake is only printed by the HTTP process
    logged = [r for r in caplog.records if r.getMessage() == "the engine could not start"]
    assert len(logged) == (0 if user_error else 1)


def test_a_core_whose_loop_dies_says_why_shuts_its_engine_down_and_exits_1(
    engine, shutdowns, short_tmp_path, monkeypatch
):
    def lost():
        raise RuntimeError("tensor-parallel rank 1 is gone")

    monkeypatch.setattr(engine, "check_health", lost)
    proc = CoreProcess(short_tmp_path, monkeypatch, lambda: engine)
    try:
        assert proc.receive()[0] == READY
        kind, reason = proc.receive()
        assert kind == DEAD and "tensor-parallel rank 1 is gone" in reason
        assert proc.join() == {"code": 1} and shutdowns == [1]
    finally:
        proc.close()


def test_a_core_whose_parent_is_gone_removes_its_sockets_and_exits_at_once(
    engine, shutdowns, short_tmp_path, monkeypatch
):
    """Killed without a word (SIGKILL), the HTTP process leaves the core to clean up after it."""
    proc = CoreProcess(short_tmp_path, monkeypatch, lambda: engine, os.getppid() + 1)
    try:
        assert proc.receive()[0] == READY
        assert proc.join() == {"code": 0}
    finally:
        proc.close()
    assert shutdowns == [1] and proc.logging_shut == [1]
    assert not proc.dir.exists()


def test_a_busy_core_whose_parent_is_gone_stops_without_finishing_its_request(
    engine, shutdowns, short_tmp_path, monkeypatch
):
    """The parent is checked after each batch of input, not only when the core is idle."""
    before = engine.get_stats()["generation_tokens_total"]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    proc = CoreProcess(short_tmp_path, monkeypatch, lambda: engine, os.getppid() + 1)
    try:
        assert proc.receive()[0] == READY
        proc.to_core.send(encode([ADD, "long", PROMPT, params_to_wire(params), 0.0, None]))
        assert proc.join() == {"code": 0}
    finally:
        proc.close()
        if "long" in engine.groups:
            engine.abort_request("long")
    assert engine.get_stats()["generation_tokens_total"] - before < 100


def test_only_an_ipc_sockets_directory_is_removed(short_tmp_path):
    from pagedserve.engine.core import _remove_ipc_dir

    sockets = short_tmp_path / "sockets"
    sockets.mkdir()
    _remove_ipc_dir(f"tcp://{sockets}/input")
    _remove_ipc_dir(f"inproc://{sockets}/input")
    assert sockets.is_dir()
    _remove_ipc_dir(f"ipc://{sockets}/input")
    assert not sockets.exists() and short_tmp_path.is_dir()
    _remove_ipc_dir(f"ipc://{sockets}/input")  # already gone (the HTTP process got there first)


# ---- the HTTP side: AsyncLLMEngine over InprocCoreClient -----------------------------------
def test_an_unknown_utility_call_raises_naming_it_and_known_ones_answer(engine):
    async def main():
        client = AsyncLLMEngine(InprocCoreClient(engine), tokenizer=engine.tokenizer)
        client.start()
        try:
            with pytest.raises(RuntimeError, match="no utility call 'nope'"):
                await client.call_utility("nope")
            assert await client.reset_prefix_cache() is True
            assert (await client.get_page_map())["block_size"] == engine.block_size
        finally:
            client.shutdown()

    asyncio.run(main())


def test_when_the_loop_dies_pending_calls_and_requests_fail_at_once(engine, monkeypatch):
    def unrecoverable():
        raise UnrecoverableFaultError("weight page gone")

    async def main():
        client = AsyncLLMEngine(InprocCoreClient(engine), tokenizer=engine.tokenizer)
        client.start()
        deaths = []
        client.on_dead(deaths.append)
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        stream = client.generate("long", PROMPT, params)
        first = await stream.__anext__()
        assert first.outputs[0].token_ids
        monkeypatch.setattr(engine, "scrub_weights", unrecoverable)
        with pytest.raises(EngineDeadError, match="weight page gone"):
            await client.call_utility("scrub_weights")
        with pytest.raises(EngineDeadError, match="weight page gone"):
            async for _ in stream:
                pass
        assert len(deaths) == 1 and not client.is_alive
        assert client.health()["engine"] == "dead"
        with pytest.raises(EngineDeadError, match="not running"):
            await client.call_utility("get_stats")
        client.shutdown()

    asyncio.run(main())
    engine.abort_request("long")  # the dead loop left it in the engine


def test_a_dead_inproc_loop_whose_last_message_is_lost_still_fails_everything(
    engine, monkeypatch
):
    """The DEAD message is how the loop says why it died; should it never be read, the thread's
    end still fails the stream and the call in flight with that reason, as a core process's exit
    does (no request waits forever on a loop that is gone)."""
    run_busy_loop = EngineCoreProc.run_busy_loop

    def loses_its_last_message(self):
        send = self.output_socket.send

        def send_all_but_dead(data, *args, **kwargs):
            if decode(data)[0] != DEAD:
                send(data, *args, **kwargs)

        self.output_socket = types.SimpleNamespace(send=send_all_but_dead)
        run_busy_loop(self)

    def unrecoverable():
        raise UnrecoverableFaultError("weight page gone")

    monkeypatch.setattr(EngineCoreProc, "run_busy_loop", loses_its_last_message)

    async def main():
        client = AsyncLLMEngine(InprocCoreClient(engine), tokenizer=engine.tokenizer)
        client.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
            stream = client.generate("long", PROMPT, params)
            assert (await stream.__anext__()).outputs[0].token_ids
            monkeypatch.setattr(engine, "scrub_weights", unrecoverable)
            with pytest.raises(EngineDeadError, match="weight page gone"):
                await asyncio.wait_for(client.call_utility("scrub_weights"), 30)

            async def drain():
                async for _ in stream:  # (the outputs of the steps before it died, then why)
                    pass

            with pytest.raises(EngineDeadError, match="weight page gone"):
                await asyncio.wait_for(drain(), 30)
            assert client.health()["engine"] == "dead"
        finally:
            client.shutdown()

    asyncio.run(main())
    engine.abort_request("long")


# ---- the wire -------------------------------------------------------------------------------
def test_sampling_params_cross_the_wire_unchanged():
    from pagedserve.engine.messages import params_from_wire
    from pagedserve.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        n=2,
        temperature=0.7,
        seed=3,
        stop=["x"],
        logit_bias={7: -1.5, 300: 2.0},
        structured_outputs=StructuredOutputsParams(regex=r"\d+"),
    )
    back = params_from_wire(decode(encode([params_to_wire(params)]))[0])
    assert back == params and back.logit_bias == {7: -1.5, 300: 2.0}  # int keys, not strings
    assert params_from_wire(decode(encode([params_to_wire(GREEDY)]))[0]) == GREEDY


def test_strings_bytes_and_int_keyed_maps_cross_the_wire_as_they_were():
    message = ["tokenizer_dir", b"\x00\xff", {7: -1.5, 300: 2.0}, [{5: -0.25}], None]
    assert decode(encode(message)) == message


def test_an_outputs_message_becomes_named_records():
    payload = [3, [["r", 0, [5], None, "length", None, [None, 0, 1.0, 2.0]]], {"a": 1}, [], []]
    out = outputs_from_wire(decode(encode(payload)))
    assert out.step == 3 and out.stats == {"a": 1} and out.errors == []
    (o,) = out.outputs
    assert (o.request_id, o.index, o.new_token_ids, o.finish_reason) == ("r", 0, [5], "length")
    assert o.first == [None, 0, 1.0, 2.0]
