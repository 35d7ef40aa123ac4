"""The HTTP process's engine client (AsyncLLMEngine) against a stand-in for the engine core: what
it sends (requests, aborts, utility calls, pause and resume), how it reads each of the core's
messages (outputs, statistics, replies, errors, DEAD, a message it cannot read), the figures
/health and /metrics read from them, and its lifetime. No engine runs: each test is the core."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import types
import uuid

import pytest
import zmq

from pagedserve.engine import async_engine
from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from pagedserve.engine.core_client import SHUTDOWN_TIMEOUT_S, CoreClient
from pagedserve.engine.limits import EngineLimits
from pagedserve.engine.messages import (
    ABORT,
    ADD,
    DEAD,
    OUTPUTS,
    UTILITY,
    decode,
    encode,
    params_from_wire,
)
from pagedserve.presets import demo_model_dir
from pagedserve.sampling_params import SamplingParams
from tests.helpers import aio
from tests.helpers.aio import collect

until = functools.partial(aio.until, timeout=10)  # a stand-in core answers at once
PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LIMITS = EngineLimits(
    max_model_len=128, vocab_size=320, num_kv_pages=64, block_size=16, max_num_seqs=4
)
INFO = {
    "model": "stand-in",
    "limits": LIMITS.to_dict(),
    "describe": "a stand-in engine core",
    "tokenizer_dir": None,
    "worker_pids": [11, 12],
}


class StandInCore(CoreClient):
    """A core client whose engine core is the test: it reads what the client sent (``sent``) and
    sends the core's messages (``step``, ``die``)."""

    def __init__(self, info: dict | None = None):
        name = uuid.uuid4().hex
        super().__init__(
            zmq.Context.instance(), f"inproc://standin-{name}-in", f"inproc://standin-{name}-out"
        )
        self.info = INFO if info is None else info
        ctx = zmq.Context.instance()
        self.core_in, self.core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        self.core_in.connect(self.input_address)
        self.core_out.connect(self.output_address)
        self.running = True
        self.starts, self.watchers, self.shutdowns = 0, [], []

    def start(self) -> None:
        self.starts += 1

    def watch(self, loop, on_dead) -> None:
        self.watchers.append((loop, on_dead))

    def is_running(self) -> bool:
        return self.running

    def shutdown(self, timeout: float) -> None:
        self.shutdowns.append(timeout)
        self.running = False
        self._close_sockets()
        self.core_in.close(linger=0)
        self.core_out.close(linger=0)

    def sent(self) -> list[list]:
        """What the client sent since the last look, in order."""
        messages = []
        while self.core_in.poll(50):
            messages.append(decode(self.core_in.recv()))
        return messages

    async def receive(self, n: int) -> list[list]:
        """The next ``n`` messages the client sends, once they are all here."""
        messages = []

        def arrived() -> bool:
            while len(messages) < n and self.core_in.poll(0):
                messages.append(decode(self.core_in.recv()))
            return len(messages) == n

        await until(arrived, f"{n} messages from the client")
        return messages

    def step(self, outputs=(), stats=None, utility_results=(), errors=(), step=1) -> None:
        payload = [step, list(outputs), stats or {}, list(utility_results), list(errors)]
        self.core_out.send(encode([OUTPUTS, payload]))

    def die(self, reason: str) -> None:
        self.core_out.send(encode([DEAD, reason]))


def output(request_id, token_ids, finish_reason=None, index=0, first=None):
    """One sequence's tokens of a step, as the core sends them."""
    return [request_id, index, list(token_ids), None, finish_reason, None, first]


def run(body, info=None, tokenizer=None, **kwargs):
    """``body(engine, core)`` on a fresh event loop with a started client over a stand-in core;
    a body still waiting after 30 s (on a reply or an output that never comes) fails."""

    async def main():
        core = StandInCore(info)
        engine = AsyncLLMEngine(core, tokenizer=tokenizer, **kwargs)
        engine.start()
        try:
            return await asyncio.wait_for(body(engine, core), 30)
        finally:
            engine.shutdown()

    return asyncio.run(main())


async def stepped(engine, core, step: int, **message) -> None:
    """The core's message of step ``step``, once the client has read it."""
    core.step(step=step, **message)
    await until(lambda: engine.num_steps == step, f"step {step}")


async def added(engine, core, request_id="a", prompt=PROMPT, params=GREEDY):
    """A stream whose request reached the core (its first read sends it)."""
    stream = engine.generate(request_id, prompt, params)
    num_unfinished = engine.num_unfinished
    first = asyncio.ensure_future(stream.__anext__())
    await until(lambda: engine.num_unfinished > num_unfinished, "the request's send")
    return stream, first


# ---- the client's identity and lifetime -----------------------------------------------------
def test_the_client_takes_the_model_its_limits_and_description_from_the_core():
    engine = AsyncLLMEngine(StandInCore())
    assert engine.model == "stand-in" and engine.description == "a stand-in engine core"
    assert engine.limits == LIMITS and engine.max_model_len == 128
    assert engine.tokenizer is None and engine.max_queue_len is None and not engine.draining
    engine.shutdown()


def test_the_client_loads_the_tokenizer_the_core_names_and_keeps_one_it_is_given():
    info = {**INFO, "tokenizer_dir": str(demo_model_dir())}
    loaded = AsyncLLMEngine(StandInCore(info))
    ids = loaded.tokenizer.encode("hello world", add_special_tokens=False)
    assert loaded.tokenizer.decode(ids) == "hello world"
    given = object()
    assert AsyncLLMEngine(StandInCore(info), tokenizer=given).tokenizer is given
    loaded.shutdown()


def test_a_client_from_a_config_starts_a_core_process_logging_at_info_by_default(monkeypatch):
    started = []
    monkeypatch.setattr(async_engine, "MPCoreClient", lambda *args: started.append(args) or core)
    core, config = StandInCore(), types.SimpleNamespace()
    engine = AsyncLLMEngine.from_config(config, max_queue_len=3)
    ((got_config, log_level),) = started
    assert got_config is config and engine.client is core and engine.max_queue_len == 3
    assert logging.getLevelName(log_level.upper()) == logging.INFO
    AsyncLLMEngine.from_config(config, None, "debug")
    assert started[-1] == (config, "debug")
    engine.shutdown()


def test_a_client_from_an_engine_runs_its_core_in_a_thread_with_the_engines_tokenizer():
    from pagedserve.engine.core_client import InprocCoreClient

    limits = types.SimpleNamespace(to_dict=LIMITS.to_dict)
    engine = types.SimpleNamespace(
        config=types.SimpleNamespace(model=types.SimpleNamespace(model="m", tokenizer=None)),
        model_path=demo_model_dir(),
        tokenizer=object(),
        limits=limits,
        describe=lambda: "an engine",
        executor=types.SimpleNamespace(worker_pids=[]),
        lora_registry=None,  # LoRA off
    )
    client = AsyncLLMEngine.from_engine(engine, max_queue_len=5)
    assert isinstance(client.client, InprocCoreClient) and client.client.core.engine is engine
    assert client.tokenizer is engine.tokenizer and client.max_queue_len == 5
    assert client.model == "m" and client.description == "an engine"
    client.shutdown()


def test_start_starts_the_core_and_watches_it_once():
    async def body(engine, core):
        engine.start()  # again: already reading
        ((loop, on_dead),) = core.watchers
        assert core.starts == 1 and loop is asyncio.get_running_loop()
        on_dead("the engine core process exited with code 9")
        return engine.dead_error, engine.is_alive

    assert run(body) == ("the engine core process exited with code 9", False)


def test_shutdown_stops_the_core_within_the_core_clients_own_bound_once():
    async def body(engine, core):
        engine.shutdown()
        engine.shutdown()
        engine.shutdown(3.0)
        return core.shutdowns

    assert run(body) == [SHUTDOWN_TIMEOUT_S]
    engine = AsyncLLMEngine(StandInCore())
    engine.shutdown(3.0)
    assert engine.client.shutdowns == [3.0]


def test_a_core_that_dies_while_shutting_down_fails_nothing_and_tells_no_one():
    async def body(engine, core):
        deaths = []
        engine.on_dead(deaths.append)
        engine.shutdown()
        engine._on_dead("the engine core process exited with code 0")
        return deaths, engine.dead_error

    assert run(body) == ([], None)


# ---- requests -------------------------------------------------------------------------------
def test_a_request_is_sent_on_its_first_read_with_its_params_and_arrival_time():
    async def body(engine, core):
        stream = engine.generate("a", PROMPT, GREEDY)
        assert core.sent() == []  # not read yet: not sent
        before = asyncio.get_running_loop().time()
        first = asyncio.ensure_future(stream.__anext__())
        await until(lambda: engine.num_unfinished, "the send")
        ((kind, request_id, prompt, params, arrival, lora_name),) = core.sent()
        assert (kind, request_id, prompt, lora_name) == (ADD, "a", PROMPT, None)
        assert params_from_wire(params) == GREEDY and before <= arrival
        core.step([output("a", [7, 8, 9, 10], "length")])
        return (await first).outputs[0].token_ids, await collect(stream)

    assert run(body) == ([7, 8, 9, 10], [])


def test_a_stream_yields_each_step_until_its_request_finishes_then_stops_counting_it():
    async def body(engine, core):
        stream, first = await added(engine, core)
        core.step([output("a", [7])])
        assert (await first).outputs[0].token_ids == [7] and not (await first).finished
        assert engine.num_unfinished == 1
        core.step([output("a", [8], "length")])
        (last,) = await collect(stream)
        assert last.finished and last.outputs[0].token_ids == [7, 8]
        assert last.outputs[0].finish_reason == "length"
        return engine.num_unfinished, [m[0] for m in core.sent()]

    assert run(body) == (0, [ADD])  # a finished request is not aborted


def test_a_consumer_that_leaves_early_aborts_its_request_in_the_core():
    async def body(engine, core):
        stream, first = await added(engine, core)
        core.sent()
        core.step([output("a", [7])])
        await first
        await stream.aclose()
        return core.sent(), engine.num_unfinished, dict(engine.output_processor.requests)

    assert run(body) == ([[ABORT, [["a", None]]]], 0, {})  # nothing kept for its late outputs


def test_a_stream_dropped_unread_sends_nothing_and_stops_counting_as_waiting():
    async def body(engine, core):
        stream = engine.generate("unread", PROMPT, GREEDY)
        counted = engine.num_waiting
        del stream
        gc.collect()
        return counted, engine.num_waiting, core.sent()

    assert run(body) == (1, 0, [])


def test_a_stream_read_then_dropped_is_not_uncounted_twice():
    async def body(engine, core):
        stream, first = await added(engine, core)
        core.step([output("a", [7], "length")], stats={"num_adds": 1})
        await first
        await collect(stream)
        del stream, first
        gc.collect()
        return engine.num_waiting

    assert run(body) == 0


def test_a_request_to_a_dead_engine_fails_before_it_is_sent():
    async def body(engine, core):
        core.running = False
        with pytest.raises(EngineDeadError, match="^the engine loop is not running$"):
            await collect(engine.generate("a", PROMPT, GREEDY))
        return core.sent(), engine.num_waiting

    assert run(body) == ([], 0)


def test_an_abort_after_the_engine_died_is_not_sent():
    async def body(engine, core):
        stream, first = await added(engine, core)
        core.sent()
        core.die("the engine loop died: boom")
        with pytest.raises(EngineDeadError, match="the engine loop is not running: .*boom"):
            await first
        engine.abort("a")
        return core.sent()

    assert run(body) == []


def test_a_rejected_request_raises_its_reason_and_a_failed_step_an_engine_step_error():
    async def body(engine, core):
        rejected, first_rejected = await added(engine, core, "r")
        failed, first_failed = await added(engine, core, "f")
        errors = [["r", "rejected", "prompt too long"], ["f", "step_failed", "a step failed"]]
        core.step(errors=errors)
        with pytest.raises(ValueError, match="^prompt too long$") as e:
            await first_rejected
        assert not isinstance(e.value, EngineStepError)
        with pytest.raises(EngineStepError, match="^a step failed$"):
            await first_failed

    run(body)


def test_a_stop_string_the_client_finds_aborts_that_sequence_in_the_core():
    from pagedserve.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(demo_model_dir())
    ids = tokenizer.encode(" stop here", add_special_tokens=False)

    async def body(engine, core):
        params = SamplingParams(temperature=0, max_tokens=50, stop=["stop"])
        stream, first = await added(engine, core, params=params)
        core.sent()
        core.step([output("a", ids)])
        out = await first
        assert out.finished and out.outputs[0].finish_reason == "stop"
        return core.sent()

    assert run(body, tokenizer=tokenizer) == [[ABORT, [["a", 0]]]]


# ---- admission ------------------------------------------------------------------------------
def test_waiting_counts_requests_unsent_in_transit_held_and_queued_in_the_core():
    async def body(engine, core):
        unsent = engine.generate("u", PROMPT, GREEDY)
        stream, first = await added(engine, core, "a")
        assert engine.num_waiting == 2  # one unread, one sent that the core has not seen
        await stepped(
            engine, core, 1, stats={"num_adds": 1, "num_held": 0, "num_requests_waiting": 1}
        )
        assert engine.num_waiting == 2  # unread, and the sent one waiting in the core
        await stepped(
            engine, core, 2, stats={"num_adds": 1, "num_held": 3, "num_requests_waiting": 1}
        )
        assert engine.num_waiting == 5
        del unsent
        core.step([output("a", [7], "length")], stats={"num_adds": 1}, step=3)
        await first
        return await collect(stream)

    run(body)


def test_the_queue_is_full_at_max_queue_len_waiting_requests_and_not_below():
    async def body(engine, core):
        streams = [engine.generate(f"r{i}", PROMPT, GREEDY) for i in range(2)]
        at_two = engine.queue_full()
        del streams[1]
        gc.collect()
        return at_two, engine.queue_full()

    assert run(body, max_queue_len=2) == (True, False)
    assert run(body, max_queue_len=1) == (True, True)
    assert run(lambda e, c: asyncio.sleep(0, e.queue_full())) is False  # no bound


# ---- utility calls --------------------------------------------------------------------------
def test_a_utility_call_is_sent_by_name_and_answered_by_its_own_reply():
    async def body(engine, core):
        first = asyncio.ensure_future(engine.call_utility("get_stats", 1, "x"))
        second = asyncio.ensure_future(engine.get_page_map())
        sent = await core.receive(2)
        assert [m[0] for m in sent] == [UTILITY, UTILITY]
        (_, id1, name1, args1), (_, id2, name2, args2) = sent
        assert (name1, args1, name2, args2) == ("get_stats", [1, "x"], "get_page_map", [])
        assert id1 != id2
        core.step(utility_results=[[id2, True, {"block_size": 16}], [id1, False, "no such"]])
        assert await second == {"block_size": 16}
        with pytest.raises(RuntimeError, match="^no such$"):
            await first
        return engine._calls

    assert run(body) == {}


def test_each_named_utility_call_asks_the_core_for_that_utility():
    async def body(engine, core):
        names = []
        for call, name in (
            (engine.get_device_stats, "get_device_stats"),
            (engine.get_page_map, "get_page_map"),
            (engine.reset_prefix_cache, "reset_prefix_cache"),
        ):
            task = asyncio.ensure_future(call())
            ((_, call_id, sent_name, args),) = await core.receive(1)
            core.step(utility_results=[[call_id, True, name]])
            assert await task == name
            names.append((sent_name, args))
        return names

    assert run(body) == [
        ("get_device_stats", []),
        ("get_page_map", []),
        ("reset_prefix_cache", []),
    ]


def test_a_reply_to_no_pending_call_is_ignored():
    async def body(engine, core):
        task = asyncio.ensure_future(engine.call_utility("get_stats"))
        ((_, call_id, _, _),) = await core.receive(1)
        core.step(utility_results=[[call_id + 100, True, "stray"], [-1, True, None]])
        core.step(utility_results=[[call_id, True, "mine"]], step=2)
        return await task

    assert run(body) == "mine"


def test_a_call_to_a_dead_engine_fails_naming_why_without_being_sent():
    async def body(engine, core):
        core.die("the engine loop died: boom")
        await until(lambda: engine.dead_error, "the death")
        with pytest.raises(EngineDeadError, match="^the engine loop is not running: .*boom$"):
            await engine.call_utility("get_stats")
        return core.sent()

    assert run(body) == []


def test_pause_and_resume_are_calls_whose_replies_answer_no_pending_call():
    async def body(engine, core):
        pending = [asyncio.ensure_future(engine.call_utility("get_stats")) for _ in range(2)]
        calls = await core.receive(2)
        engine.pause()
        engine.resume()
        (pause, resume) = await core.receive(2)
        assert pause[0] == resume[0] == UTILITY and (pause[2:], resume[2:]) == (
            ["pause", []],
            ["resume", []],
        )
        # the core answers every call it runs: these replies answer no pending call
        core.step(utility_results=[[pause[1], True, None], [resume[1], True, None]])
        core.step(utility_results=[[c[1], True, f"stats {i}"] for i, c in enumerate(calls)], step=2)
        return [await p for p in pending]

    assert run(body) == ["stats 0", "stats 1"]


# ---- the core's messages --------------------------------------------------------------------
def test_a_dead_core_fails_every_request_and_pending_call_and_tells_each_listener_once():
    async def body(engine, core):
        deaths = []
        engine.on_dead(deaths.append)
        engine.on_dead(lambda reason: deaths.append("second: " + reason))
        stream, first = await added(engine, core)
        call = asyncio.ensure_future(engine.call_utility("get_stats"))
        await core.receive(2)  # the request and the call
        core.die("the engine loop died: boom")
        core.die("the engine loop died: again")
        for pending in (first, call):
            with pytest.raises(EngineDeadError, match="^the engine loop is not running: .*boom$"):
                await pending
        await asyncio.sleep(0.05)
        health = engine.health()
        return deaths, engine.is_alive, health["engine"], engine._calls

    deaths, alive, health, calls = run(body)
    assert deaths == ["the engine loop died: boom", "second: the engine loop died: boom"]
    assert (alive, health, calls) == (False, "dead", {})


def test_a_message_the_client_cannot_read_kills_the_engine_saying_why():
    async def body(engine, core):
        stream, first = await added(engine, core)
        core.core_out.send(b"\xc1")  # not msgpack
        with pytest.raises(EngineDeadError, match="reading the engine core's messages failed"):
            await first
        return engine.dead_error

    assert run(body).startswith("reading the engine core's messages failed: ")


def test_a_message_of_an_unknown_kind_is_skipped():
    async def body(engine, core):
        core.core_out.send(encode(["NEWS", "nothing"]))
        await stepped(engine, core, 4)
        return engine.is_alive

    assert run(body) is True


# ---- health and metrics ---------------------------------------------------------------------
def test_health_before_any_message_is_alive_with_nothing_counted():
    async def body(engine, core):
        return engine.health()

    assert run(body) == {
        "engine": "alive",
        "pid": None,
        "tp_worker_pids": [11, 12],
        "num_steps": 0,
        "seconds_since_last_message": None,
        "num_requests_running": 0,
        "num_requests_waiting": 0,
    }


def test_health_follows_the_core_s_last_message(monkeypatch):
    async def body(engine, core):
        core.pid = 4321
        await stepped(engine, core, 7, stats={"num_requests_running": 2, "num_requests_waiting": 3})
        clock = async_engine.time.monotonic
        monkeypatch.setattr(
            async_engine, "time", types.SimpleNamespace(monotonic=lambda: clock() + 1.23456)
        )
        return engine.health(), engine.num_waiting

    health, waiting = run(body)
    assert health["pid"] == 4321 and health["num_steps"] == 7
    assert health["num_requests_running"] == 2 and health["num_requests_waiting"] == waiting == 3
    age = health["seconds_since_last_message"]
    assert 1.234 <= age < 2 and round(age, 3) == age


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_throughput_is_tokens_over_the_window_of_recent_messages(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(async_engine, "time", clock)

    async def body(engine, core):
        rates = [engine.tokens_per_second()]
        for step, (t, total) in enumerate([(1000.0, 100), (1002.0, 140), (1004.0, 180)], 1):
            clock.now = t
            await stepped(engine, core, step, stats={"generation_tokens_total": total})
            rates.append(engine.tokens_per_second())
        clock.now = 1013.5  # the last message under 10 s ago: still current
        rates.append(engine.tokens_per_second())
        clock.now = 1014.0  # 10 s after it: the figure is stale
        rates.append(engine.tokens_per_second())
        clock.now = 1020.0  # messages over 10 s after the first: the window slides
        await stepped(engine, core, 4, stats={"generation_tokens_total": 300})
        rates.append(engine.tokens_per_second())
        return rates, engine.token_rate_history.per_second(1021.0)[-21:]

    rates, history = run(body)
    assert rates == [0.0, 0.0, 20.0, 20.0, 20.0, 0.0, 120 / 16]
    assert history == [0] * 2 + [40, 0, 40] + [0] * 15 + [120]


def test_the_window_keeps_a_message_exactly_its_length_old_and_the_figure_until_then(
    monkeypatch,
):
    clock = Clock()
    monkeypatch.setattr(async_engine, "time", clock)

    async def body(engine, core):
        marks = [(1000.0, 100), (1002.0, 140), (1004.0, 180), (1012.0, 200)]
        for step, (t, total) in enumerate(marks, 1):
            clock.now = t
            await stepped(engine, core, step, stats={"generation_tokens_total": total})
        rates = [engine.tokens_per_second()]  # from 1002 (10 s before the last) to 1012
        clock.now = 1021.9
        rates.append(engine.tokens_per_second())
        clock.now = 1022.0
        rates.append(engine.tokens_per_second())
        return rates

    assert run(body) == [6.0, 6.0, 0.0]


def test_the_client_reads_a_burst_of_messages_without_pausing_between_them():
    async def body(engine, core):
        for step in range(1, 11):
            core.step(step=step)
        await until(lambda: engine.num_steps == 10, "ten messages", timeout=5)

    run(body)


def test_throughput_of_messages_at_one_instant_is_not_a_division_by_zero(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(async_engine, "time", clock)

    async def body(engine, core):
        for step, total in enumerate([100, 101], 1):
            await stepped(engine, core, step, stats={"generation_tokens_total": total})
        return engine.tokens_per_second()

    assert run(body) == pytest.approx(1e6)


def test_a_message_without_a_token_count_counts_no_tokens(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(async_engine, "time", clock)

    async def body(engine, core):
        for step, t in enumerate([1000.0, 1001.0], 1):
            clock.now = t
            await stepped(engine, core, step)
        return engine.tokens_per_second(), engine.token_rate_history.per_second(1002.0)[-2:]

    assert run(body) == (0.0, [0, 0])


def test_a_core_that_has_not_counted_tokens_yet_has_generated_none(monkeypatch):
    """A message without a token count is a total of 0: the tokens of the next count are all new."""
    clock = Clock()
    monkeypatch.setattr(async_engine, "time", clock)

    async def body(engine, core):
        for step, (t, stats) in enumerate(
            [(1000.0, {}), (1001.0, {"generation_tokens_total": 100})], 1
        ):
            clock.now = t
            await stepped(engine, core, step, stats=stats)
        return engine.tokens_per_second()

    assert run(body) == 100.0
