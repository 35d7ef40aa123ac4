"""``POST /v1/chat/completions`` in this process on the demo model (FastAPI's TestClient, no
socket): the response's shape and usage, logprobs, streaming (the role first, deltas that add up
to the whole answer, the usage chunk), a named tool call, one call without parallel_tool_calls,
and tool_choice none. test_server.py and test_tools.py check the same endpoint over HTTP with the
openai client; this file is fast enough for mutation testing of chat.py. Still to come here:
calls the grammar forces (required, streamed), auto, the reasoning parser, and the errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.chat import _chat_stream
from pagedserve.server.chat_output import ChatOutputParser
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.reasoning_parsers import Glm4ReasoningParser
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


def test_required_calls_finish_with_tool_calls_whole_and_streamed(client):
    body = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 32}
    body |= {"temperature": 1.0, "seed": 3}  # the same call whole and streamed
    (choice,) = chat(client, **body)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]["function"]
    chunks = stream(client, **body)[:-1]
    assert not joined(chunks, "content")  # no text: the call's name, before it, is held back
    first = next(i for i, c in enumerate(chunks) if c["choices"][0]["delta"]["tool_calls"])
    assert all(c["choices"][0]["delta"]["content"] is None for c in chunks[first:])
    deltas = [d for c in chunks for d in c["choices"][0]["delta"]["tool_calls"] or []]
    assert deltas[0]["function"]["name"] == call["name"]
    assert "".join(d["function"]["arguments"] or "" for d in deltas) == call["arguments"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


def test_chat_logit_bias_steers_toward_any_token_of_the_vocabulary(client):
    tokens = client.post(
        "/tokenize", json={"prompt": "Hello world, the quick brown fox"}, headers=AUTH
    )
    token = max(tokens.json()["tokens"])  # not a special token
    out = chat(client, logit_bias={str(token): 100}, max_tokens=3)
    shown = client.post("/detokenize", json={"tokens": [token] * 3}, headers=AUTH).json()
    assert out["choices"][0]["message"]["content"] == shown["prompt"]


def test_top_logprobs_over_the_servers_max_logprobs_are_a_400_naming_it(engine):
    with served(engine, started=False, max_logprobs=2) as c:
        body = {"messages": CHAT, "logprobs": True, "top_logprobs": 3}
        r = c.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["message"]) == (
        "top_logprobs",
        "top_logprobs=3 must be in [0, 2] (this server's --max-logprobs)",
    )


def test_messages_longer_than_the_context_are_a_400_naming_messages(client):
    long = [{"role": "user", "content": "a " * 600}]
    r = client.post("/v1/chat/completions", json={"messages": long}, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")


def test_without_the_generation_prompt_the_prompt_ends_with_the_last_message(client):
    with_it = chat(client, **SEEDED)["usage"]["prompt_tokens"]
    without = chat(client, add_generation_prompt=False, **SEEDED)["usage"]["prompt_tokens"]
    rendered = client.post(
        "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}, headers=AUTH
    ).json()
    assert without == rendered["count"] < with_it


# ---- a thinking model's reasoning (--reasoning-parser glm4) -------------------------------------
THINKING = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|><think>"


@pytest.fixture
def thinking(client, monkeypatch):
    """The client's server with GLM-Z1's reasoning parser and a template that opens the
    thinking: a short answer is all thinking; and the text the same request gets without the
    parser."""
    serving = client.app.state.serving
    monkeypatch.setattr(serving.tokenizer, "chat_template", THINKING)
    plain = chat(client, **SEEDED)["choices"][0]["message"]["content"]
    monkeypatch.setattr(serving, "reasoning_parser", Glm4ReasoningParser)
    return plain


def test_an_output_that_never_ends_its_thinking_is_all_reasoning(client, thinking):
    message = chat(client, **SEEDED)["choices"][0]["message"]
    assert message["content"] is None
    assert message["reasoning_content"] == message["reasoning"] == thinking
    chunks = stream(client, **SEEDED)[:-1]
    assert joined(chunks, "reasoning_content") == joined(chunks, "reasoning") == thinking
    assert not joined(chunks[1:], "content")


def test_include_reasoning_false_leaves_the_thinking_out(client, thinking):
    message = chat(client, include_reasoning=False, **SEEDED)["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"] is None


# ---- the stream, from a stand-in engine's outputs -------------------------------------------------
def outputs(*steps) -> RequestOutput:
    """One output of a request of two sequences: each step (text, token ids, finish reason)."""
    choices = [
        CompletionOutput(i, text, list(ids), logprobs=[{t: -1.0} for t in ids], finish_reason=why)
        for i, (text, ids, why) in enumerate(steps)
    ]
    return RequestOutput("r-0", "Hi", [1, 2], choices, finished=all(c[2] for c in steps))


def streamed(client, outs: list[RequestOutput], **body) -> list[list[dict]]:
    """The choices of each chunk ``_chat_stream`` makes of ``outs`` (the role's chunk left out),
    and the usage chunk's, if any, as the last."""

    async def engine_outputs():
        for out in outs:
            yield out

    async def chunks():
        request = ChatCompletionRequest(messages=CHAT, n=2, **body)
        stream = _chat_stream(
            client.app.state.serving,
            request,
            None,
            ChatOutputParser,
            "chatcmpl-1",
            ("Hi", [1, 2]),
            engine_outputs(),
        )
        return [json.loads(c.removeprefix("data: ")) async for c in stream]

    events = asyncio.run(chunks())
    assert [c["delta"]["role"] for c in events[0]["choices"]] == ["assistant", "assistant"]
    return [e["choices"] or [e["usage"]] for e in events[1:]]


def test_each_chat_output_sends_what_it_adds_to_each_choice_as_it_comes(client):
    chunks = streamed(
        client,
        [
            outputs(("He", [5], None), ("Wo", [7], None)),
            outputs(("He", [5], None), ("Wor", [7, 8], None)),
            outputs(("Hel", [5, 9], None), ("Wor", [7, 8, 6], None)),
        ],
        logprobs=True,
    )
    sent = [(c["index"], c["delta"]["content"]) for chunk in chunks for c in chunk]
    assert sent == [(0, "He"), (1, "Wo"), (1, "r"), (0, "l"), (1, "")]
    counts = [len(c["logprobs"]["content"]) for chunk in chunks for c in chunk]
    assert counts == [1, 1, 1, 1, 1]  # a held-back token too, as it comes


def test_a_finished_chat_choice_ends_once_while_the_other_goes_on(client):
    chunks = streamed(
        client,
        [
            outputs(("He", [5], "stop"), ("Wo", [7], None)),
            outputs(("He", [5], "stop"), ("Wor", [7, 8], None)),
            outputs(("He", [5], "stop"), ("Worl", [7, 8, 9], "length")),
        ],
        stream_options={"include_usage": True},
    )
    *chunks, (usage,) = chunks
    sent = [(c["index"], c["delta"]["content"], c["finish_reason"]) for ch in chunks for c in ch]
    assert sent == [(0, "He", "stop"), (1, "Wo", None), (1, "r", None), (1, "l", "length")]
    assert usage == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


def test_a_chat_stream_ended_before_any_output_sends_only_the_roles(client):
    assert streamed(client, [], stream_options={"include_usage": True}) == []
