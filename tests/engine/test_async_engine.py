"""The HTTP process's engine client (AsyncLLMEngine) over an engine core in a thread, on the demo
model: streams that end, abort or never start, admission counting, the figures /health and
/metrics read, pause and resume, and shutdown."""

from __future__ import annotations

import asyncio
import functools
import gc

import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine, TokenRateHistory
from pagedserve.engine.core_client import InprocCoreClient
from pagedserve.presets import demo_model_dir
from pagedserve.sampling_params import SamplingParams
from tests.helpers import aio
from tests.helpers.aio import collect
from tests.helpers.models import tiny_engine

until = functools.partial(aio.until, timeout=60)  # a real engine's steps
PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(demo_model_dir(), num_kv_pages=64, max_model_len=128, max_num_seqs=4)


def run(engine, body, **kwargs):
    """``body(client)`` on a fresh event loop with a started client; the engine drained after."""

    async def main():
        client = AsyncLLMEngine(InprocCoreClient(engine), tokenizer=engine.tokenizer, **kwargs)
        client.start()
        try:
            return await body(client)
        finally:
            client.shutdown()

    result = asyncio.run(main())
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0
    return result


def test_a_stream_yields_until_finished_with_the_text_decoded(engine):
    async def body(client):
        return await collect(client.generate("a", PROMPT, GREEDY))

    outs = run(engine, body)
    last = outs[-1]
    assert last.finished and not any(o.finished for o in outs[:-1])
    assert len(last.outputs[0].token_ids) == 4 and last.outputs[0].finish_reason == "length"
    assert last.outputs[0].text == engine.tokenizer.decode(last.outputs[0].token_ids)
    assert last.prompt_token_ids == PROMPT and "first_token_time" in last.metrics


def test_a_consumer_that_leaves_aborts_its_request_in_the_core(engine):
    async def body(client):
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        stream = client.generate("long", PROMPT, params)
        await stream.__anext__()
        await stream.aclose()  # the client went away
        await until(lambda: not engine.has_unfinished_requests(), "the abort")
        return client.num_unfinished

    assert run(engine, body) == 0


def test_a_request_counts_as_waiting_from_generate_until_it_runs_or_is_dropped(engine):
    async def body(client):
        assert client.num_waiting == 0
        stream = client.generate("unread", PROMPT, GREEDY)
        counted = client.num_waiting
        del stream  # dropped unread: never sent
        gc.collect()
        return counted, client.num_waiting, client.stats.get("num_adds", 0)

    assert run(engine, body) == (1, 0, 0)


def test_a_full_queue_is_seen_before_anything_is_sent(engine):
    async def body(client):
        streams = [client.generate(f"r{i}", PROMPT, GREEDY) for i in range(2)]
        full = client.queue_full()
        for stream in streams:
            await collect(stream)
        return full, client.queue_full()

    assert run(engine, body, max_queue_len=2) == (True, False)
    assert run(engine, lambda c: asyncio.sleep(0, c.queue_full())) is False  # no bound


def test_a_request_the_engine_refuses_raises_its_reason(engine):
    async def body(client):
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(client.generate("huge", list(range(5, 300)), GREEDY))

    run(engine, body)


def test_requests_sent_while_paused_wait_and_run_after_resume(engine):
    async def body(client):
        client.pause()
        task = asyncio.ensure_future(collect(client.generate("held", PROMPT, GREEDY)))
        await until(lambda: client.stats.get("num_held") == 1, "the hold")
        waiting = client.num_waiting
        client.resume()
        outs = await task
        return waiting, outs[-1].finished

    assert run(engine, body) == (1, True)


def test_health_and_throughput_follow_the_core(engine):
    async def body(client):
        before = client.health()
        await collect(client.generate("a", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)))
        after = client.health()
        return before, after, client.tokens_per_second()

    before, after, rate = run(engine, body)
    assert after["engine"] == "alive" and after["pid"] is None  # a thread of this process
    assert after["num_steps"] >= before["num_steps"] + 8
    assert after["seconds_since_last_message"] is not None and rate > 0


def test_shutdown_stops_the_core_and_can_be_repeated(engine):
    async def body(client):
        client.shutdown()
        client.shutdown()
        return client.client.is_running()

    assert run(engine, body) is False


def test_the_token_history_counts_each_second_and_forgets_the_old():
    history = TokenRateHistory(window_s=2)
    history.record(10.5, 100)
    history.record(10.9, 104)
    history.record(11.2, 103)  # a total that went down (a restart) adds nothing
    history.record(12.0, 110)
    assert history.per_second(12.5) == [4, 0] and history.per_second(13.0) == [0, 7]
    history.record(14.0, 110)
    assert [second for second, _ in history.buckets] == [12, 14]
