"""Server-sent events and the interleaving of output streams (streaming.py), without a model: the
``data:`` lines a streamed answer is made of, how it ends (``[DONE]``, after one error event if
the engine failed), and ``merge_streams``' order, errors and aborts."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve.engine.async_engine import EngineDeadError, EngineStepError
from pagedserve.server.protocol import CompletionChoice, CompletionChunk, UsageInfo
from pagedserve.server.streaming import merge_streams, sse_chunk, sse_data, sse_response


def run(coro):
    return asyncio.run(coro)


async def body_of(response) -> str:
    return "".join([piece async for piece in response.body_iterator])


def events(text: str) -> list:
    """The events of an SSE body: each ``data:`` line's JSON, or the text ``[DONE]``."""
    assert text.endswith("\n\n")
    out = []
    for event in text.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- events -------------------------------------------------------------------------------------
def test_an_event_is_one_data_line_of_json_with_its_nulls_kept():
    usage = UsageInfo(prompt_tokens=2, completion_tokens=3, total_tokens=5)
    assert sse_data(usage) == (
        'data: {"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}\n\n'
    )
    choice = CompletionChoice(index=0, text="hi")
    assert json.loads(sse_data(choice).removeprefix("data: ")) == {
        "index": 0,
        "text": "hi",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
    }


def test_a_chunk_carries_its_id_creation_time_model_choices_and_usage():
    choices = [CompletionChoice(index=1, text="a")]
    usage = UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    (event,) = events(sse_chunk(CompletionChunk, "cmpl-1", 17, "demo", choices, usage))
    assert event == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 17,
        "model": "demo",
        "choices": [
            {"index": 1, "text": "a", "logprobs": None, "finish_reason": None, "stop_reason": None}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    (event,) = events(sse_chunk(CompletionChunk, "cmpl-1", 17, "demo", []))
    assert event["usage"] is None and event["choices"] == []


# ---- a streamed response ------------------------------------------------------------------------
async def pieces(*items):
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def test_a_stream_sends_its_chunks_then_done_uncached_as_event_stream():
    response = sse_response(pieces("data: 1\n\n", "data: 2\n\n"))
    assert response.media_type == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert run(body_of(response)) == "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


@pytest.mark.parametrize(
    "error, etype, code",
    [
        (ValueError("prompt too long"), "invalid_request_error", None),
        (EngineStepError("step failed"), "server_error", None),
        (EngineDeadError("engine gone"), "server_error", "engine_dead"),
    ],
)
def test_an_error_while_streaming_is_one_error_event_then_done(error, etype, code):
    response = sse_response(pieces("data: 1\n\n", error))
    assert events(run(body_of(response))) == [
        1,
        {"error": {"message": str(error), "type": etype, "param": None, "code": code}},
        "[DONE]",
    ]


def test_any_other_error_is_not_turned_into_an_event():
    response = sse_response(pieces("data: 1\n\n", KeyError("bug")))
    with pytest.raises(KeyError):
        run(body_of(response))


# ---- merging streams ----------------------------------------------------------------------------
async def collect(streams) -> list:
    return [item async for item in merge_streams(streams)]


class Stream:
    """An output stream that yields ``items`` (an exception is raised in its place), pausing
    ``pause`` scheduler turns before each, and records whether it was closed early."""

    def __init__(self, items, pause: int = 0):
        self.items, self.pause = items, pause
        self.closed = False
        self.done = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        try:
            for item in self.items:
                for _ in range(self.pause):
                    await asyncio.sleep(0)
                if isinstance(item, BaseException):
                    raise item
                yield item
            self.done = True
        finally:
            self.closed = not self.done


def test_one_stream_is_passed_through_as_index_zero():
    assert run(collect([Stream(["a", "b"])])) == [(0, "a"), (0, "b")]


def test_several_streams_are_interleaved_each_in_its_own_order():
    streams = [Stream(["a1", "a2", "a3"], pause=3), Stream(["b1", "b2"], pause=1), Stream([])]
    merged = run(collect(streams))
    assert sorted(merged) == [(0, "a1"), (0, "a2"), (0, "a3"), (1, "b1"), (1, "b2")]
    assert [o for i, o in merged if i == 0] == ["a1", "a2", "a3"]
    assert [o for i, o in merged if i == 1] == ["b1", "b2"]
    assert merged[0] == (1, "b1")  # the quicker stream's output comes first


def test_an_error_in_one_of_several_streams_reaches_the_consumer_and_stops_the_others():
    slow = Stream(["a"] * 50, pause=5)
    failing = Stream(["b", ValueError("bad")], pause=1)

    async def main():
        seen = []
        with pytest.raises(ValueError, match="bad"):
            async for item in merge_streams([slow, failing]):
                seen.append(item)
        await asyncio.sleep(0)
        return seen

    seen = run(main())
    assert (1, "b") in seen
    assert slow.closed


def test_closing_the_merge_aborts_every_stream():
    streams = [Stream(["a"] * 50, pause=2), Stream(["b"] * 50, pause=2)]

    async def main():
        merged = merge_streams(streams)
        first = await merged.__anext__()
        await merged.aclose()
        for _ in range(5):
            await asyncio.sleep(0)
        return first

    assert run(main())[1] in ("a", "b")
    assert all(s.closed for s in streams)
