"""OpenAI function calling against ``pagedserve serve`` on the demo model, with the official
openai client: the agent loop (a call the grammar makes valid, its result sent back, an answer
in text), streamed and not; OpenAI's rules for tool_choice; a 400 naming the field for bad
tools; and a thinking model's reasoning split from its answer (``--reasoning-parser glm4``)."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.models.chat_templates import builtin_chat_template
from pagedserve.presets import demo_model_dir
from pagedserve.server.app import build_app
from pagedserve.testing import serve, serve_app
from tests.helpers.glm_formats import CONVERSATIONS, PUBLISHED, published_template, render_published

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time",
        "parameters": {"type": "object", "properties": {}},
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def server_url():
    """``pagedserve serve`` on the demo model with vLLM's tool flags."""
    flags = ["--device", "cpu", "--enable-auto-tool-choice", "--tool-call-parser", "glm4"]
    with serve(*flags, "--max-model-len", "1024", "--num-kv-pages", "256") as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _valid(call, tool=WEATHER) -> dict:
    assert call.type == "function" and call.id and call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def _result_turns(message, result: dict) -> list[dict]:
    call = message.tool_calls[0]
    return [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]


# ---- the agent loop ---------------------------------------------------------------------------
def test_agent_loop_a_valid_call_its_result_then_an_answer_in_text(client):
    first = client.chat.completions.create(
        model="demo", messages=QUESTION, tools=[WEATHER], tool_choice="required", **GREEDY
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid(call)
    messages = QUESTION + _result_turns(choice.message, {"temperature": 21, "unit": "celsius"})
    second = client.chat.completions.create(
        model="demo", messages=messages, tools=[WEATHER], **GREEDY
    )
    answer = second.choices[0]
    assert answer.message.tool_calls in (None, []) and answer.message.content.strip()
    assert answer.finish_reason in ("stop", "length")


def test_agent_loop_streamed_reassembles_to_the_same_calls(client):
    whole = client.chat.completions.create(
        model="demo", messages=QUESTION, tools=[WEATHER], tool_choice="required", **GREEDY
    )
    fragments = []
    with client.chat.completions.stream(
        model="demo", messages=QUESTION, tools=[WEATHER], tool_choice="required", **GREEDY
    ) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
        streamed = stream.get_final_completion()
    choice = streamed.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == (
        whole.choices[0].message.tool_calls[0].function.name,
        whole.choices[0].message.tool_calls[0].function.arguments,
    )
    _valid(call)
    assert len(fragments) > 2, "the arguments came at once, not as they were generated"
    messages = QUESTION + _result_turns(choice.message, {"temperature": 21, "unit": "celsius"})
    with client.chat.completions.stream(
        model="demo", messages=messages, tools=[WEATHER], **GREEDY
    ) as stream:
        for _ in stream:  # (get_final_completion refuses an answer cut by max_tokens)
            pass
        answer = stream.current_completion_snapshot.choices[0]
    assert not answer.message.tool_calls and answer.message.content.strip()


def test_stream_sends_id_type_and_name_first_then_only_arguments(server_url):
    body = {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "required", **GREEDY}
    pieces = []
    with httpx.stream(
        "POST", server_url + "/v1/chat/completions", json={**body, "stream": True}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces += delta.get("tool_calls") or []
    assert pieces[0].keys() == {"index", "id", "type", "function"}
    assert pieces[0]["type"] == "function" and pieces[0]["function"]["name"] == "get_weather"
    assert all(p.keys() == {"index", "function"} for p in pieces[1:])
    assert all(p["function"].keys() == {"arguments"} for p in pieces[1:])
    _valid_json = json.loads("".join(p["function"].get("arguments", "") for p in pieces))
    jsonschema.validate(_valid_json, WEATHER["function"]["parameters"])


def test_the_tools_and_the_results_reach_the_prompt(server_url):
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    r = httpx.post(server_url + "/tokenize", json={"messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "<|system|>\n# 可用工具\n\n## get_weather\n\n{\n" in prompt
    assert prompt.endswith(
        '<|assistant|>\nget_weather\n{"city": "Paris"}<|observation|>\n21<|assistant|>\n'
    )


@pytest.mark.parametrize("published", list(PUBLISHED))
def test_a_checkpoint_with_a_published_glm_template_renders_openai_tool_messages(
    tiny_glm4, tmp_path, published
):
    """The published templates render a call only in GLM's own message shape; a checkpoint that
    ships one is served with its built-in counterpart, so OpenAI's tool messages reach the prompt
    as the published template renders the same turns in GLM's shape."""
    model_dir = shutil.copytree(tiny_glm4[0], tmp_path / "model")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = published_template(published)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    engine = LLMEngine(
        EngineConfig.from_kwargs(model=str(model_dir), device="cpu", num_kv_pages=64)
    )
    _, messages, tools = next(c for c in CONVERSATIONS if c[0] == "two calls in one turn")
    with serve_app(build_app(engine, "tiny")) as url:
        r = httpx.post(url + "/tokenize", json={"messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == render_published(published, messages, tools)


# ---- tool_choice --------------------------------------------------------------------------------
def test_a_named_function_is_called_and_finishes_with_stop(client):
    out = client.chat.completions.create(
        model="demo",
        messages=QUESTION,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        **GREEDY,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's rule for a named function
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    _valid(choice.message.tool_calls[0], CLOCK)


def test_required_without_parallel_tool_calls_makes_exactly_one_call(client):
    out = client.chat.completions.create(
        model="demo",
        messages=QUESTION,
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY,
    )
    (call,) = out.choices[0].message.tool_calls
    _valid(call, WEATHER if call.function.name == "get_weather" else CLOCK)


def test_none_shows_the_tools_but_reads_no_calls(client):
    out = client.chat.completions.create(
        model="demo",
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="none",
        extra_body={"guided_regex": r'get_weather\n\{"city": "Paris", "unit": "celsius"\}'},
        **GREEDY,
    )
    choice = out.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert choice.message.content == 'get_weather\n{"city": "Paris", "unit": "celsius"}'


def test_auto_holds_a_strict_tool_to_its_schema(client):
    """With a strict tool the model answers in text or calls it validly, nothing between
    (tests/server/test_tool_grammar.py holds the grammar to that)."""
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    out = client.chat.completions.create(model="demo", messages=QUESTION, tools=[strict], **GREEDY)
    message = out.choices[0].message
    if message.tool_calls:
        _valid(message.tool_calls[0], strict)
    else:
        assert not message.content.lstrip().startswith("get_weather\n")


def test_auto_reads_a_call_the_model_writes(client):
    """Without a constraint, what the model writes in GLM-4's form is a call (here the model is
    made to write one with a regular expression)."""
    call = 'get_weather\n{"city": "Rome", "unit": "celsius"}'
    for stream in (False, True):
        kwargs = {"extra_body": {"guided_regex": call.replace("{", r"\{").replace("}", r"\}")}}
        if stream:
            with client.chat.completions.stream(
                model="demo", messages=QUESTION, tools=[WEATHER], **kwargs, **GREEDY
            ) as s:
                choice = s.get_final_completion().choices[0]
        else:
            choice = client.chat.completions.create(
                model="demo", messages=QUESTION, tools=[WEATHER], **kwargs, **GREEDY
            ).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert _valid(choice.message.tool_calls[0]) == {"city": "Rome", "unit": "celsius"}


def test_a_malformed_call_is_text_never_a_500(server_url):
    regex = r'get_weather\n\{"city": Rome\}'
    body = {"messages": QUESTION, "tools": [WEATHER], "guided_regex": regex, **GREEDY}
    r = httpx.post(server_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"] == [] and message["content"] == 'get_weather\n{"city": Rome}'
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    with httpx.stream(
        "POST", server_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)


# ---- bad input: a 400 naming the field ---------------------------------------------------------
def _bad(server_url, param: str, **body) -> str:
    body = {"messages": QUESTION, "max_tokens": 4, **body}
    r = httpx.post(server_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


def test_a_tool_with_an_invalid_schema_is_a_400_naming_it(server_url):
    broken = {**CLOCK, "function": {**CLOCK["function"], "parameters": {"type": "strng"}}}
    message = _bad(server_url, "tools.1.function.parameters", tools=[WEATHER, broken])
    assert "get_time" in message and "strng" in message


def test_parameters_that_are_not_an_object_schema_are_a_400(server_url):
    """A call's arguments are a JSON object, as OpenAI's API requires of a function's schema."""
    array = {**CLOCK, "function": {**CLOCK["function"], "parameters": {"type": "array"}}}
    message = _bad(server_url, "tools.0.function.parameters", tools=[array], tool_choice="none")
    assert "'array'" in message and "'object'" in message


def test_a_schema_no_grammar_can_hold_is_refused_only_where_one_must(server_url):
    unusual = {"type": "object", "not": {"required": ["x"]}}
    tool = {**CLOCK, "function": {**CLOCK["function"], "parameters": unusual}}
    ok = {"messages": QUESTION, "tools": [tool], "max_tokens": 2}
    assert httpx.post(server_url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200
    message = _bad(server_url, "tools.0.function.parameters", tools=[tool], tool_choice="required")
    assert "not" in message


def test_a_named_tool_choice_not_among_the_tools_is_a_400(server_url):
    choice = {"type": "function", "function": {"name": "get_stock"}}
    message = _bad(server_url, "tool_choice", tools=[WEATHER], tool_choice=choice)
    assert "get_stock" in message and "get_weather" in message


def test_tool_choice_without_tools_is_a_400(server_url):
    assert "needs tools" in _bad(server_url, "tool_choice", tool_choice="required")


def test_other_bad_tools_are_400s(server_url):
    assert "empty" in _bad(server_url, "tools", tools=[])
    assert "two tools" in _bad(server_url, "tools", tools=[WEATHER, WEATHER])
    bad_name = {**CLOCK, "function": {**CLOCK["function"], "name": "get time"}}
    _bad(server_url, "tools.0.function.name", tools=[bad_name])
    _bad(
        server_url,
        "tool_choice",
        tools=[WEATHER],
        tool_choice="required",
        response_format={"type": "json_object"},
    )


def test_auto_needs_the_servers_flag(live_server):
    r = httpx.post(
        live_server.url + "/v1/chat/completions",
        json={"messages": QUESTION, "tools": [WEATHER]},
        headers={"Authorization": f"Bearer {live_server.api_key}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


# ---- reasoning ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinking_client():
    """The demo model behind GLM-Z1's template (it opens <think>) and the glm4 reasoning parser."""
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(demo_model_dir()), device="cpu", num_kv_pages=128, max_model_len=1024
        )
    )
    app = build_app(
        engine,
        "demo",
        reasoning_parser="glm4",
        tool_call_parser="glm4",
        chat_template=builtin_chat_template("glm-z1-0414"),
    )
    with serve_app(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_reasoning_content_is_the_thinking_and_content_the_answer(thinking_client):
    regex = r"[a-z ]{3,12}</think>\nFour\."  # the demo model cannot think: a regex makes it
    kwargs = {"model": "demo", "messages": [{"role": "user", "content": "2+2?"}], **GREEDY}
    whole = thinking_client.chat.completions.create(**kwargs, extra_body={"guided_regex": regex})
    message = whole.choices[0].message
    assert message.content == "\nFour." and message.reasoning_content.strip()
    assert message.reasoning == message.reasoning_content and "</think>" not in message.content
    chunks = list(
        thinking_client.chat.completions.create(
            **kwargs, extra_body={"guided_regex": regex}, stream=True
        )
    )
    thinking = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (thinking, answer) == (message.reasoning_content, message.content)


def test_unfinished_thinking_is_all_reasoning(thinking_client):
    out = thinking_client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "2+2?"}],
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert message.content is None and message.reasoning_content
