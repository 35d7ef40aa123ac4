"""``OpenAIServing``, the request handling every route shares, in this process on the demo model:
admission (a dead engine, a draining server, a full queue), prompts and their 400s, the chat
template's messages, a model without a tokenizer, token text and logprobs, and collecting the
outputs (a client that goes away, an engine step that fails). Fast enough for mutation testing of
serving.py; the routes' own tests (test_chat_api.py, test_completions_api.py) cover the rest."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.output_processor import EngineDeadError, EngineStepError
from pagedserve.models.chat_templates import builtin_chat_template
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionToolsParam, ChatMessage, CompletionRequest
from pagedserve.server.serving import OpenAIServing, top_logprobs, usage_info
from pagedserve.server.tool_parsers import Glm4ToolParser
from pagedserve.server.tools import attach_tool_grammar, tool_request
from tests.helpers.apps import AUTH, demo_engine, served
from tests.helpers.glm_formats import FIXTURES, PUBLISHED
from tests.server.test_chat_api import WEATHER
from tests.server.test_tool_grammar import _accepts as accepts


@pytest.fixture(scope="module")
def engine():
    return demo_engine(max_model_len=512, num_kv_pages=64)


@pytest.fixture
def serving(engine) -> OpenAIServing:
    """A serving layer of its own over the engine (its loop not started)."""
    return OpenAIServing(engine, "demo", None)


def refused(call, *args) -> APIError:
    with pytest.raises(APIError) as e:
        call(*args)
    return e.value


# ---- admission ---------------------------------------------------------------------------------
def post(client) -> tuple[int, dict, dict]:
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=AUTH)
    return r.status_code, r.json()["error"] if r.status_code != 200 else {}, r.headers


def test_a_dead_engine_is_a_503_to_retry_later(engine):
    with served(engine, started=False) as c:
        status, error, headers = post(c)
    assert (status, error["code"], headers["retry-after"]) == (503, "engine_dead", "1")
    assert error["message"] == "the engine loop is not running; see the server log"


def test_a_draining_server_admits_no_new_request(client, monkeypatch):
    monkeypatch.setattr(client.app.state.serving.engine, "draining", True)
    status, error, headers = post(client)
    assert (status, error["code"], headers["retry-after"]) == (503, "shutting_down", "1")
    assert error["message"] == "the server is shutting down and admits no new requests"


def test_a_full_queue_is_a_503_naming_the_waiting_and_the_limit(client, monkeypatch):
    monkeypatch.setattr(client.app.state.serving.engine, "max_queue_len", 0)
    status, error, headers = post(client)
    assert (status, error["code"], headers["retry-after"]) == (503, "queue_full", "1")
    assert error["message"] == (
        "the server is busy: 0 requests are waiting (--max-queue-len 0); retry shortly"
    )
    monkeypatch.setattr(client.app.state.serving.engine, "max_queue_len", 1)
    assert post(client)[0] == 200  # below the limit


def test_an_engine_core_in_its_own_process_takes_the_servers_queue_limit(engine):
    core = AsyncLLMEngine.from_engine(engine, max_queue_len=7)
    serving = OpenAIServing(core, None, 3)
    assert (serving.engine, serving.llm_engine, core.max_queue_len) == (core, None, 3)
    assert serving.model_name == core.model
    OpenAIServing(core, None, None)
    assert core.max_queue_len == 3  # no limit given: the engine's stands
    inproc = OpenAIServing(engine, "demo", 5)
    assert inproc.llm_engine is engine and inproc.engine.max_queue_len == 5
    assert inproc.enable_auto_tool_choice is False  # auto only with --enable-auto-tool-choice


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_glm4_template_is_served_as_its_built_in_counterpart(engine, name, monkeypatch):
    published = (FIXTURES / PUBLISHED[name][0]).read_text()
    monkeypatch.setattr(engine.tokenizer, "chat_template", published)
    OpenAIServing(engine, "demo", None)
    assert engine.tokenizer.chat_template == builtin_chat_template(PUBLISHED[name][1])


def test_another_template_is_served_as_it_is(engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{{ messages[0].content }}")
    OpenAIServing(engine, "demo", None)
    assert engine.tokenizer.chat_template == "{{ messages[0].content }}"


# ---- prompts -------------------------------------------------------------------------------------
def test_prompts_of_each_shape_become_text_and_token_ids(serving):
    tok = serving.tokenizer
    assert serving.encode_prompts("Hi") == [("Hi", tok.encode("Hi"))]
    assert serving.encode_prompts(["Hi", "Yo"]) == [
        ("Hi", tok.encode("Hi")),
        ("Yo", tok.encode("Yo")),
    ]
    assert serving.encode_prompts([5, 6]) == [(None, [5, 6])]
    assert serving.encode_prompts([[5], [6, 7]]) == [(None, [5]), (None, [6, 7])]


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "prompt is an empty string; send some text"),
        (["Hi", ""], "prompt[1] is an empty string; send some text"),
        ([], "prompt is empty; send a string, a list of strings or token ids"),
    ],
    ids=["text", "second_text", "list"],
)
def test_an_empty_prompt_is_a_400(serving, prompt, message):
    e = refused(serving.encode_prompts, prompt)
    assert (e.status, e.param, e.message) == (400, "prompt", message)


def test_a_request_that_cannot_run_is_a_400_naming_the_field_at_fault(serving):
    """The prompt's field is the one the prompt came in (a chat's messages); only a request
    longer than the engine holds is context_length_exceeded."""
    vocab = serving.vocab_size
    one = SamplingParams(max_tokens=1)
    e = refused(serving.check_fits, [(None, [vocab])], one, "messages")
    assert (e.status, e.param, e.code) == (400, "messages", None)
    assert e.message == f"prompt token id {vocab} is outside the vocabulary [0, {vocab})"
    stops = SamplingParams(max_tokens=1, stop_token_ids=[vocab])
    e = refused(serving.check_fits, [(None, [1])], stops, "messages")
    assert (e.param, e.code) == ("stop_token_ids", None)
    e = refused(serving.check_fits, [(None, [1] * 600)], one)
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")
    assert e.message.startswith("this request needs 601 tokens (600 in the prompt + max_tokens 1)")


def test_messages_reach_the_template_as_hf_templates_take_them(serving, monkeypatch):
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.name %}|{{ m.name }}{% endif %}"
        "{% if m.reasoning_content %}|{{ m.reasoning_content }}{% endif %}"
        "{% if m.tool_calls %}|{{ m.tool_calls[0].function.name }}{% endif %}"
        "{% if m.tool_call_id %}|{{ m.tool_call_id }}{% endif %}"
        "{% if m.lang %}|{{ m.lang }}{% endif %};{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    monkeypatch.setattr(serving.tokenizer, "chat_template", template)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        ChatMessage(
            role="user", content=[{"type": "text", "text": t} for t in ("a", "", "b")], name="ann"
        ),
        ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning_content="hm"),
        ChatMessage(
            role="tool", content="sunny", tool_call_id="c1", lang="en"
        ),  # a field of its own
    ]
    text, ids = serving.chat_prompt(messages, True)
    assert text == "user:ab|ann;assistant:|hm|f;tool:sunny|c1|en;>"
    assert ids == serving.tokenizer.encode(text, add_special_tokens=False)
    assert serving.chat_prompt(messages[:1], False)[0] == "user:ab|ann;"


def test_a_field_a_message_was_sent_without_is_not_in_its_template_dict(serving, monkeypatch):
    template = "{% for m in messages %}{{ m.keys() | sort | join(',') }};{% endfor %}"
    monkeypatch.setattr(serving.tokenizer, "chat_template", template)
    messages = [ChatMessage(role="user", content=None), ChatMessage(role="user", name="ann")]
    assert serving.chat_prompt(messages, False)[0] == "content,role;content,name,role;"


def test_a_template_that_cannot_render_the_messages_is_a_400_naming_messages(serving, monkeypatch):
    monkeypatch.setattr(serving.tokenizer, "chat_template", "{{ raise_exception('no system') }}")
    e = refused(serving.chat_prompt, [ChatMessage(role="user", content="Hi")], True)
    assert (e.status, e.param) == (400, "messages")
    assert e.message.startswith("messages could not be rendered with the chat template: ")
    assert "no system" in e.message


def test_a_model_without_a_tokenizer_takes_token_ids_only(serving, monkeypatch):
    monkeypatch.setattr(serving, "tokenizer", None)
    e = refused(serving.encode_prompts, "Hi")
    assert (e.status, e.param) == (400, "prompt")
    assert e.message == "this model has no tokenizer.json: send token ids as the prompt"
    assert serving.encode_prompts([5, 6]) == [(None, [5, 6])]
    assert serving.token_str(5) == "token_id:5"
    assert serving.special_texts == ()
    assert serving.prompt_text((None, [5, 6])) == ""
    offsets = serving.completion_offsets([1], CompletionRequest(prompt=[1]))
    assert offsets.take([5, 6]) == [0, len("token_id:5")]


def test_a_prompt_of_ids_reads_as_its_tokens_with_the_special_ones(serving):
    tok = serving.tokenizer
    ids = tok.encode("Hi")
    assert serving.prompt_text((None, ids)) == tok.decode(ids, skip_special_tokens=False)
    assert serving.prompt_text(("Hi", ids)) == "Hi"


def test_each_prompt_token_starts_where_the_one_before_ended_in_the_echoed_prompt(serving):
    """``[gMASK]<sop>``, which the tokenizer puts before a text, take no room in it; a special
    token the text holds takes its room."""
    ids = serving.tokenizer.encode("Hi<|user|>you")
    pieces = ["[gMASK]", "<sop>", "H", "i", "<|user|>", "y", "ou"]
    assert [serving.token_str(i) for i in ids] == pieces
    assert serving.prompt_offsets(ids, "Hi<|user|>you") == [0, 0, 0, 1, 2, 10, 11]


def test_a_forced_call_is_held_to_the_parsers_form_whose_calls_a_special_token_joins(serving):
    request = tool_request([ChatCompletionToolsParam(**WEATHER)], "required", True, False)
    parser = serving.tool_parser_for(request)
    assert isinstance(parser, Glm4ToolParser)  # no --tool-call-parser: GLM-4's form
    params = SamplingParams()
    attach_tool_grammar(params, request, parser)
    two = 'get_weather\n{"city": "Paris"}<|assistant|>get_weather\n{"city": "Rome"}'
    assert accepts(serving.tokenizer, params.structured_outputs.grammar, two)
    calls = parser.extract_tool_calls(two, True).tool_calls
    assert [c.function.arguments for c in calls] == ['{"city": "Paris"}', '{"city": "Rome"}']


# ---- token text and logprobs ---------------------------------------------------------------------
def test_the_special_texts_are_the_special_tokens_longest_first(serving):
    texts = serving.special_texts
    assert set(texts) == {serving.token_str(i) for i in serving.tokenizer.all_special_ids}
    assert [len(t) for t in texts] == sorted((len(t) for t in texts), reverse=True)
    assert "<|assistant|>" in texts


def test_a_logprob_of_minus_infinity_is_shown_as_minus_9999(serving):
    (entry,) = serving.chat_logprobs([5], [{5: float("-inf"), 6: -0.5}], 2).content
    assert entry.logprob == -9999.0
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
        (serving.token_str(6), -0.5),
        (serving.token_str(5), -9999.0),
    ]


def test_a_token_without_logprobs_has_none(serving):
    out = serving.completion_logprobs([5, 6], [None, {6: -1.0, 7: -2.0}], 1, [0, 1])
    assert out.tokens == [serving.token_str(5), serving.token_str(6)]
    assert out.token_logprobs == [None, -1.0]
    assert out.top_logprobs == [None, {serving.token_str(6): -1.0}]


def test_top_logprobs_are_the_n_most_likely():
    assert top_logprobs({1: -3.0, 2: -1.0, 3: -2.0}, 2) == [(2, -1.0), (3, -2.0)]
    assert top_logprobs({1: -3.0}, 0) == []


def test_usage_counts_every_prompt_and_every_choice():
    finals = [
        RequestOutput(
            "r", None, [1], [CompletionOutput(0, "", [1, 2]), CompletionOutput(1, "", [3])]
        ),
        RequestOutput("s", None, [1], [CompletionOutput(0, "", [4])]),
    ]
    usage = usage_info([(None, [1, 2, 3]), (None, [4])], finals)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 4, 8)


# ---- running -------------------------------------------------------------------------------------
def sample(metric, suffix: str, **labels) -> float:
    """A metric's sample of that name suffix and labels (0 before any)."""
    name = metric._name + suffix
    for family in metric.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_a_request_is_timed_and_each_sequence_counted_by_its_finish_reason(client):
    metrics = client.app.state.serving.metrics
    before = [
        sample(metrics.request_success, "_total", finished_reason=r) for r in ("length", "abort")
    ]
    queued, first = sample(metrics.queue_time, "_sum"), sample(metrics.ttft, "_sum")
    body = {"prompt": "Hi", "max_tokens": 2, "n": 2, "ignore_eos": True}
    assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200
    after = [
        sample(metrics.request_success, "_total", finished_reason=r) for r in ("length", "abort")
    ]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 0]
    # queued until the engine first scheduled it, which is before its first token
    assert sample(metrics.queue_time, "_sum") - queued < sample(metrics.ttft, "_sum") - first


def test_an_engine_request_carries_the_prompt_text_the_client_sent(client):
    serving = client.app.state.serving
    ids = serving.tokenizer.encode("Hi")

    async def run():
        streams = serving.start("cmpl-x", [("Hi", ids), (None, ids)], SamplingParams(max_tokens=1))
        return await serving.collect(Raw(), streams)

    text, tokens = client.portal.call(run)
    assert (text.prompt, tokens.prompt) == ("Hi", None)
    assert text.request_id == "cmpl-x-0" and tokens.request_id == "cmpl-x-1"
    assert text.prompt_token_ids == tokens.prompt_token_ids == ids


# ---- collecting the outputs ----------------------------------------------------------------------
class Raw:
    """A request whose ASGI messages are ``messages``, then its client goes away after ``after``
    seconds (never: None)."""

    def __init__(self, after: float | None = None, messages: tuple[dict, ...] = ()):
        self.after, self.messages = after, list(messages)

    async def receive(self) -> dict:
        if self.messages:
            return self.messages.pop(0)
        if self.after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.after)
        return {"type": "http.disconnect"}


def outputs_of(*steps, error: Exception | None = None):
    async def stream():
        for step in steps:
            await asyncio.sleep(0)
            yield step
        if error is not None:
            raise error

    return stream()


def out(text: str) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, [5])], finished=True)


def collect(serving, raw, *streams):
    return asyncio.run(serving.collect(raw, list(streams)))


def test_collect_returns_each_streams_last_output(serving):
    body = {"type": "http.request", "body": b"", "more_body": False}  # not a disconnect
    first, second, none = collect(
        serving,
        Raw(messages=(body,)),
        outputs_of(out("a"), out("ab")),
        outputs_of(out("c")),
        outputs_of(),
    )
    assert (first.outputs[0].text, second.outputs[0].text, none) == ("ab", "c", None)


def test_a_client_that_goes_away_before_the_outputs_end_is_a_499(serving, caplog):
    async def endless():
        while True:
            await asyncio.sleep(0.01)
            yield out("a")

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        e = refused(collect, serving, Raw(after=0.05), endless())
        answer = (e.status, e.message)
        del e  # its traceback holds collect's frame, and so the outputs' future
        gc.collect()  # asyncio logs an outcome never read as the future goes
    assert answer == (499, "client disconnected")
    assert caplog.records == []  # the abandoned outputs' end was read


@pytest.mark.parametrize(
    "error, status",
    [
        (EngineStepError("step 3 failed"), 500),
        (EngineDeadError("step 3 failed"), 503),
        (ValueError("step 3 failed"), 400),
    ],
)
def test_an_engine_error_is_a_500_a_dead_engine_a_503_and_a_refused_request_a_400(
    serving, error, status
):
    e = refused(collect, serving, Raw(), outputs_of(out("a"), error=error))
    assert (e.status, e.message) == (status, "step 3 failed")
    if status == 503:  # the request may be sent again once the server is back
        assert (e.code, e.headers) == ("engine_dead", {"Retry-After": "1"})
