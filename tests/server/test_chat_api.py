"""``POST /v1/chat/completions`` in this process on the demo model (FastAPI's TestClient, no
socket): the response's shape and usage, logprobs, streaming (the role first, deltas that add up
to the whole answer, the usage chunk), a named tool call, one call without parallel_tool_calls,
and tool_choice none. test_server.py and test_tools.py check the same endpoint over HTTP with the
openai client; this file is fast enough for mutation testing of chat.py. Still to come here:
calls the grammar forces (required, streamed), auto, the reasoning parser, and the errors."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.helpers.apps import AUTH, demo_engine, served

CHAT = [{"role": "user", "content": "Hello"}]
SEEDED = {"temperature": 1.0, "seed": 3, "ignore_eos": True, "max_tokens": 4}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def engine():
    return demo_engine(max_model_len=512, num_kv_pages=64)


@pytest.fixture(scope="module")
def client(engine) -> Iterator:
    with served(engine) as c:
        yield c


def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": CHAT, **body}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, **body) -> list:
    """The events of a streamed chat completion: each chunk's JSON, then the text ``[DONE]``."""
    body = {"messages": CHAT, **body, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def joined(chunks, field: str, index: int = 0) -> str | None:
    pieces = [
        c["choices"][0]["delta"].get(field)
        for c in chunks
        if c["choices"] and c["choices"][0]["index"] == index
    ]
    pieces = [p for p in pieces if p is not None]
    return "".join(pieces) if pieces else None


# ---- the whole answer ---------------------------------------------------------------------------
def test_a_chat_completion_has_openais_shape_and_counts_its_tokens(client):
    out = chat(client, **SEEDED)
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["model"] == "demo"
    (choice,) = out["choices"]
    assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"]
    assert message["tool_calls"] == [] and message["reasoning_content"] is None
    prompt = client.post("/tokenize", json={"messages": CHAT}, headers=AUTH).json()
    assert out["usage"] == {
        "prompt_tokens": prompt["count"],
        "completion_tokens": 4,
        "total_tokens": prompt["count"] + 4,
    }


def test_n_choices_are_numbered(client):
    out = chat(client, n=2, **SEEDED)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 8


def test_chat_logprobs_give_each_token_its_bytes_and_the_top_n(client):
    (choice,) = chat(client, logprobs=True, top_logprobs=2, **SEEDED)["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    for t in content:
        assert t["bytes"] == list(t["token"].encode()) and t["logprob"] <= 0
        assert len(t["top_logprobs"]) == 2
        assert t["top_logprobs"][0]["logprob"] >= t["top_logprobs"][1]["logprob"]
    (choice,) = chat(client, logprobs=True, **SEEDED)["choices"]
    assert all(t["top_logprobs"] == [] for t in choice["logprobs"]["content"])


def test_a_structured_output_holds_the_answer(client):
    (choice,) = chat(client, guided_choice=["yes", "no"], max_tokens=8)["choices"]
    assert choice["message"]["content"] in ("yes", "no")


# ---- streaming ----------------------------------------------------------------------------------
def test_a_stream_starts_with_the_role_and_adds_up_to_the_whole_answer(client):
    whole = chat(client, **SEEDED)["choices"][0]["message"]["content"]
    events = stream(client, **SEEDED)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "demo" for c in chunks)
    assert chunks[0]["choices"] == [
        {
            "index": 0,
            "delta": {
                "role": "assistant",
                "content": "",
                "tool_calls": None,
                "reasoning_content": None,
                "reasoning": None,
            },
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
    ]
    assert joined(chunks[1:], "role") is None
    assert joined(chunks, "content") == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["usage"] is None for c in chunks)


def test_each_streamed_choice_adds_up_to_its_whole_answer(client):
    whole = [c["message"]["content"] for c in chat(client, n=2, **SEEDED)["choices"]]
    chunks = stream(client, n=2, **SEEDED)[:-1]
    assert [c["index"] for c in chunks[0]["choices"]] == [0, 1]  # the role of each
    assert [joined(chunks, "content", i) for i in (0, 1)] == whole
    finished = [c["choices"][0]["index"] for c in chunks[1:] if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_a_stream_with_include_usage_ends_with_a_usage_chunk(client):
    *chunks, usage, done = stream(client, stream_options={"include_usage": True}, **SEEDED)
    assert done == "[DONE]" and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4
    events = stream(client, stream_options={"include_usage": False}, **SEEDED)
    assert all(e == "[DONE]" or e["choices"] for e in events)


def test_streamed_logprobs_cover_each_chunks_tokens(client):
    whole = chat(client, logprobs=True, top_logprobs=1, **SEEDED)["choices"][0]["logprobs"]
    chunks = stream(client, logprobs=True, top_logprobs=1, **SEEDED)[1:-1]
    tokens = []
    for c in chunks:
        content = c["choices"][0]["logprobs"]["content"]
        assert "".join(t["token"] for t in content) == (c["choices"][0]["delta"]["content"] or "")
        assert all(len(t["top_logprobs"]) == 1 for t in content)
        tokens += [t["token"] for t in content]
    assert tokens == [t["token"] for t in whole["content"]]
    plain = stream(client, **SEEDED)[1:-1]
    assert all(c["choices"][0]["logprobs"] is None for c in plain)


def test_a_named_call_finishes_with_stop(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=24)
    (c,) = out["choices"]
    assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == ["get_weather"]
    assert json.loads(c["message"]["tool_calls"][0]["function"]["arguments"])["city"] in (
        "Paris",
        "Rome",
    )
    assert c["finish_reason"] == "stop"


def test_one_call_only_without_parallel_tool_calls(client):
    out = chat(
        client,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=32,
    )
    assert len(out["choices"][0]["message"]["tool_calls"]) == 1


def test_tool_choice_none_shows_the_tools_and_reads_no_calls(client):
    out = chat(client, tools=[WEATHER], tool_choice="none", **SEEDED)
    assert out["choices"][0]["message"]["tool_calls"] == []
    assert out["choices"][0]["finish_reason"] == "length"
    plain = client.post("/tokenize", json={"messages": CHAT}, headers=AUTH).json()["count"]
    assert out["usage"]["prompt_tokens"] > plain  # the tools are in the prompt
