"""``POST /v1/chat/completions`` in this process on the demo model (FastAPI's TestClient, no
socket): the response's shape and usage, logprobs, stop strings and stop_reason, streaming (the
role first, deltas that add up to the whole answer, the usage chunk), tool calls (named,
required, auto, without parallel_tool_calls, tool_choice none), the reasoning parser, and the
request's parsing (its grammar after the thinking, special tokens kept for the parsers and hidden
from the client). test_server.py and test_tools.py check the same endpoint over HTTP with the
openai client; this file is fast enough for mutation testing of chat.py."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace

import pytest

from pagedserve.models.tokenizer import Tokenizer
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.chat import _chat_stream, chat_output_parsers
from pagedserve.server.chat_output import ChatOutputParser
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.reasoning_parsers import Glm4ReasoningParser
from pagedserve.server.tool_parsers import Glm4ToolParser
from pagedserve.server.tools import tool_request
from tests.helpers.apps import AUTH, demo_engine, served
from tests.helpers.models import SPECIAL_TOKENS, build_tiny_tokenizer
from tests.server.test_tool_grammar import _accepts as accepts

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


def test_a_chat_completion_for_another_model_is_a_404_naming_the_served_one(client):
    r = client.post(
        "/v1/chat/completions", json={"messages": CHAT, "model": "gpt-4o"}, headers=AUTH
    )
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert "'demo'" in error["message"]
    assert chat(client, model="demo", **SEEDED)["model"] == "demo"


def test_a_stop_string_ends_the_answer_before_it_and_is_its_stop_reason(client):
    (choice,) = chat(client, logprobs=True, **SEEDED)["choices"]
    whole, tokens = choice["message"]["content"], choice["logprobs"]["content"]
    assert choice["stop_reason"] is None  # ended by max_tokens
    stop = tokens[2]["token"]
    (choice,) = chat(client, stop=[stop], **SEEDED)["choices"]
    shown = whole[: whole.index(stop)]
    assert choice["message"]["content"] == shown
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    chunks = stream(client, stop=[stop], **SEEDED)[:-1]
    assert joined(chunks, "content") == shown
    ends = [(c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"]) for c in chunks]
    assert ends[-1] == ("stop", stop) and set(ends[:-1]) == {(None, None)}


def test_chat_completions_at_once_each_run_as_an_engine_request_of_their_own(client):
    """The second request arrives while the first one runs: each has its own engine request
    (an id in use is refused), and the same seed gives both the same answer."""
    requests = client.app.state.serving.engine.output_processor.requests
    body = {"messages": CHAT, **SEEDED, "max_tokens": 48}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.post, "/v1/chat/completions", json=body, headers=AUTH)
        deadline = time.monotonic() + 60
        while not requests and time.monotonic() < deadline:
            time.sleep(0.001)
        second = client.post("/v1/chat/completions", json=body, headers=AUTH)
        first = first.result()
    assert (first.status_code, second.status_code) == (200, 200), second.text
    first, second = first.json(), second.json()
    assert first["id"] != second["id"]
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert second["usage"]["completion_tokens"] == 48


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


def test_one_call_only_without_parallel_tool_calls(engine, client):
    # the bias towards <|assistant|>, which opens a further call, makes the model want several
    # on any kernels; get_weather's enum keeps a call short (get_time's open object, sampled,
    # could outgrow max_tokens and be no call at all)
    further_call = engine.tokenizer.token_to_id("<|assistant|>")
    body = dict(tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=40, temperature=0)
    body |= {"logit_bias": {str(further_call): 100}, "tools": [WEATHER]}
    (several,) = chat(client, **body)["choices"]
    assert len(several["message"]["tool_calls"]) > 1
    (choice,) = chat(client, **body, parallel_tool_calls=False)["choices"]
    assert len(choice["message"]["tool_calls"]) == 1
    assert choice["finish_reason"] == "tool_calls"


def test_tool_choice_none_shows_the_tools_and_reads_no_calls(client):
    out = chat(client, tools=[WEATHER], tool_choice="none", **SEEDED)
    assert out["choices"][0]["message"]["tool_calls"] == []
    assert out["choices"][0]["finish_reason"] == "length"
    plain = client.post("/tokenize", json={"messages": CHAT}, headers=AUTH).json()["count"]
    assert out["usage"]["prompt_tokens"] > plain  # the tools are in the prompt


# answers in GLM-4's form of calls, which a structured output makes the demo model write
PARIS = '{"city": "Paris"}'
WEATHER_CALL, CLOCK_CALL = f"get_weather\n{PARIS}", "get_time\n{}"
ONE_CALL = {"guided_regex": r'get_weather\n\{"city": "Paris"\}'}
TWO_CALLS = {  # <|assistant|>, the special token, opens the second call
    "guided_grammar": f"start: {json.dumps(WEATHER_CALL)} <|assistant|> {json.dumps(CLOCK_CALL)}"
}


def test_tool_choice_none_leaves_an_answer_in_a_calls_form_as_text(client):
    out = chat(client, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=64, **ONE_CALL)
    (choice,) = out["choices"]
    assert choice["message"]["tool_calls"] == []
    assert (choice["message"]["content"], choice["finish_reason"]) == (WEATHER_CALL, "stop")


@pytest.fixture
def auto(client, monkeypatch):
    """The client's server started with --enable-auto-tool-choice --tool-call-parser glm4."""
    serving = client.app.state.serving
    monkeypatch.setattr(serving, "enable_auto_tool_choice", True)
    monkeypatch.setattr(serving, "tool_parser", Glm4ToolParser)


def test_auto_reads_each_call_of_the_answer(client, auto):
    out = chat(client, tools=[WEATHER, CLOCK], max_tokens=64, **TWO_CALLS)
    (choice,) = out["choices"]
    calls = [
        (t["function"]["name"], t["function"]["arguments"]) for t in choice["message"]["tool_calls"]
    ]
    assert calls == [("get_weather", PARIS), ("get_time", "{}")]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)


def test_auto_without_parallel_tool_calls_reads_only_the_first_call(client, auto):
    body = {"tools": [WEATHER, CLOCK], "parallel_tool_calls": False, "max_tokens": 64}
    (choice,) = chat(client, **body, **TWO_CALLS)["choices"]
    calls = [
        (t["function"]["name"], t["function"]["arguments"]) for t in choice["message"]["tool_calls"]
    ]
    assert calls == [("get_weather", PARIS)]
    chunks = stream(client, **body, **TWO_CALLS)[:-1]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"]["tool_calls"] or []]
    assert [d["index"] for d in deltas] == [0] * len(deltas)
    assert [d["function"].get("name") for d in deltas if d.get("id")] == ["get_weather"]


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


# ---- a request's parsing (chat_output_parsers) --------------------------------------------------
def parsers_of(serving, prompt: str, params: SamplingParams, **body) -> ChatOutputParser:
    """One choice's parser of a chat request of ``body`` whose chat template made ``prompt``;
    ``params`` as the request set them (the parsing may constrain and adjust them)."""
    request = ChatCompletionRequest(messages=CHAT, **body)
    tools = tool_request(request.tools, request.tool_choice, request.parallel_tool_calls, True)
    return chat_output_parsers(serving, request, tools, (prompt, [1]), params)()


def test_a_thinking_models_forced_call_comes_after_its_thinking(client, monkeypatch):
    serving = client.app.state.serving
    monkeypatch.setattr(serving, "reasoning_parser", Glm4ReasoningParser)
    params = SamplingParams()
    parser = parsers_of(
        serving, "<|assistant|><think>", params, tools=[WEATHER], tool_choice="required"
    )
    grammar = params.structured_outputs.grammar
    assert accepts(serving.tokenizer, grammar, f"I will look it up.</think>{WEATHER_CALL}")
    assert not accepts(serving.tokenizer, grammar, WEATHER_CALL)  # the thinking is still open
    parsed = parser.parse(f"I will look it up.</think>{WEATHER_CALL}")
    assert parsed.reasoning == "I will look it up." and parsed.content is None
    assert [(c.function.name, c.function.arguments) for c in parsed.tool_calls] == [
        ("get_weather", PARIS)
    ]


@pytest.fixture(scope="module")
def think_vocab(tmp_path_factory) -> Tokenizer:
    """A tokenizer whose ``</think>`` is a special token, as in GLM-4.5's."""
    path = tmp_path_factory.mktemp("think-tokenizer")
    build_tiny_tokenizer(path, special_tokens=(*SPECIAL_TOKENS, "</think>"))
    return Tokenizer(path)


def test_marks_that_are_special_tokens_are_read_but_not_shown_unless_asked_for(think_vocab):
    """The reasoning parser needs ``</think>`` in the text, so the text keeps special tokens;
    the client, who asked for them skipped, sees none; asked for, they are shown."""
    serving = SimpleNamespace(
        tokenizer=think_vocab,
        reasoning_parser=Glm4ReasoningParser,
        special_texts=("<|endoftext|>", "</think>", "<sop>"),
    )
    params = SamplingParams()
    parser = parsers_of(serving, "<|assistant|><think>", params)
    assert params.skip_special_tokens is False
    parsed = parser.parse("hm<sop></think>4<sop>")
    assert (parsed.reasoning, parsed.content) == ("hm", "4")
    params = SamplingParams(skip_special_tokens=False)
    parsed = parsers_of(serving, "<|assistant|><think>", params).parse("hm<sop></think>4<sop>")
    assert (parsed.reasoning, parsed.content) == ("hm<sop>", "4<sop>")


# ---- the stream, from a stand-in engine's outputs -------------------------------------------------
def outputs(*steps) -> RequestOutput:
    """One output of a request of two sequences: each step (text, token ids, finish reason)."""
    choices = [
        CompletionOutput(i, text, list(ids), logprobs=[{t: -1.0} for t in ids], finish_reason=why)
        for i, (text, ids, why) in enumerate(steps)
    ]
    return RequestOutput("r-0", "Hi", [1, 2], choices, finished=all(c[2] for c in steps))


def streamed(
    client, outs: list[RequestOutput], parsers=ChatOutputParser, **body
) -> list[list[dict]]:
    """The choices of each chunk ``_chat_stream`` makes of ``outs`` (the role's chunk left out),
    and the usage chunk's, if any, as the last; ``parsers`` makes each choice's parser."""

    async def engine_outputs():
        for out in outs:
            yield out

    async def chunks():
        request = ChatCompletionRequest(messages=CHAT, n=2, **body)
        stream = _chat_stream(
            client.app.state.serving,
            request,
            None,
            parsers,
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
    tops = [t["top_logprobs"] for chunk in chunks for c in chunk for t in c["logprobs"]["content"]]
    assert tops == [[]] * 5  # no top_logprobs asked for: none


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


def test_a_choice_cut_inside_the_end_of_its_thinking_sends_its_whole_text_as_thinking(client):
    """A mark held back while it may still complete is sent once the choice is finished: the
    last chunk's delta reads the text as final, as the whole answer does."""
    tok = client.app.state.serving.tokenizer
    parsers = partial(ChatOutputParser, None, Glm4ReasoningParser(tok, "<|assistant|><think>"))
    chunks = streamed(
        client,
        [
            outputs(("hm</thi", [5, 6], None), ("ok</", [7, 8], None)),
            outputs(("hm</thi", [5, 6], "length"), ("ok</", [7, 8], "length")),
        ],
        parsers,
    )
    sent = [(c["index"], c["delta"]["reasoning"], c["finish_reason"]) for ch in chunks for c in ch]
    assert sent == [(0, "hm", None), (1, "ok", None), (0, "</thi", "length"), (1, "</", "length")]
