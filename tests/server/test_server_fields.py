"""Every request field the server accepts reaches the engine, and does there what it does offline.

Two checks per field, on the completions and the chat endpoint:
- the mapping: the ``SamplingParams`` the engine receives (recorded at ``LLMEngine.add_request`` of
  the live server) carry the field's value, and a request without fields gets vLLM's defaults;
- the effect: the HTTP answer equals the offline ``LLM``'s answer for the same ``SamplingParams``
  on the same model (seeded, so exact), and differs from the answer without the field.
Then the fields that shape the response (logprobs counts, echo, n, stop strings, special tokens),
aborts, and the values of the prefix-cache, preemption and finish-reason metrics.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.helpers.metrics import read_metrics, wait_idle
from tests.helpers.models import SPECIAL_IDS, STOP_IDS, tiny_engine

PROMPT_IDS = [2, 4, 60, 61, 62, 63, 64, 65, 66, 67]
CHAT = [{"role": "user", "content": "The quick brown fox"}]
BASE = {"max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True}
EOS = STOP_IDS[0]


@pytest.fixture(scope="module")
def offline(live_server_settings):
    """The live server's engine settings, offline, in this process."""
    return LLM(**live_server_settings)


def request(live_server, endpoint: str, body: dict) -> httpx.Response:
    """``body`` with this file's prompt, to the completions or the chat endpoint."""
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]
    prompt = {"prompt": PROMPT_IDS} if endpoint == "completions" else {"messages": CHAT}
    return httpx.post(
        live_server.url + path,
        json={"model": live_server.model, **prompt, **body},
        headers={"Authorization": f"Bearer {live_server.api_key}"},
        timeout=60,
    )


def post(live_server, endpoint: str, body: dict) -> dict:
    r = request(live_server, endpoint, body)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


def run_offline(llm: LLM, endpoint: str, params: SamplingParams):
    if endpoint == "completions":
        return llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0]
    return llm.chat(CHAT, params, use_tqdm=False)[0]


@contextmanager
def engine_requests(live_server):
    """The (prompt ids, SamplingParams) the live server's engine is given, in order."""
    engine = live_server.serving.llm_engine
    original, seen = engine.add_request, []

    def recording(request_id, prompt_token_ids, params, **kwargs):
        seen.append((list(prompt_token_ids), params))
        return original(request_id, prompt_token_ids, params, **kwargs)

    engine.add_request = recording
    try:
        yield seen
    finally:
        del engine.add_request


# ---- the mapping: what the engine receives

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
GRAMMAR = 'root ::= "yes" | "no"'
# (request fields, the SamplingParams fields they must become), for both endpoints
SHARED_FIELDS = [
    ({"temperature": 0.5}, {"temperature": 0.5}),
    ({"top_p": 0.5}, {"top_p": 0.5}),
    ({"top_k": 7}, {"top_k": 7}),
    ({"min_p": 0.2}, {"min_p": 0.2}),
    ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
    ({"presence_penalty": 0.5}, {"presence_penalty": 0.5}),
    ({"frequency_penalty": -0.25}, {"frequency_penalty": -0.25}),
    ({"seed": 11}, {"seed": 11}),
    ({"logit_bias": {"5": 2.0, "7": -300}}, {"logit_bias": {5: 2.0, 7: -100.0}}),
    ({"stop": "ab"}, {"stop": ["ab"]}),
    ({"stop": ["ab", "cd"]}, {"stop": ["ab", "cd"]}),
    ({"stop_token_ids": [7, 9]}, {"stop_token_ids": [7, 9]}),
    ({"ignore_eos": True}, {"ignore_eos": True}),
    ({"min_tokens": 3}, {"min_tokens": 3}),
    ({"skip_special_tokens": False}, {"skip_special_tokens": False}),
    ({"include_stop_str_in_output": True}, {"include_stop_str_in_output": True}),
    ({"n": 2}, {"n": 2}),
]
# constraints on the output (server/structured.py: attach_structured_outputs), both endpoints
STRUCTURED_FIELDS = [
    (
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": StructuredOutputsParams(json_object=True)},
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            }
        },
        {"structured_outputs": StructuredOutputsParams(json=SCHEMA)},
    ),
    ({"guided_json": SCHEMA}, {"structured_outputs": StructuredOutputsParams(json=SCHEMA)}),
    ({"guided_regex": "[ab]+"}, {"structured_outputs": StructuredOutputsParams(regex="[ab]+")}),
    (
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": StructuredOutputsParams(choice=["yes", "no"])},
    ),
    (
        {"guided_grammar": GRAMMAR},
        {"structured_outputs": StructuredOutputsParams(grammar=GRAMMAR)},
    ),
    (
        {"structured_outputs": {"regex": "[0-9]+"}},
        {"structured_outputs": StructuredOutputsParams(regex="[0-9]+")},
    ),
]
COMPLETION_FIELDS = [
    ({"max_tokens": 5}, {"max_tokens": 5}),
    ({"logprobs": 3}, {"logprobs": 3, "prompt_logprobs": None}),
    ({"logprobs": 2, "echo": True}, {"logprobs": 2, "prompt_logprobs": 2}),
    ({"echo": True}, {"logprobs": None, "prompt_logprobs": None}),
]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_FIELDS = [
    ({"max_tokens": 5}, {"max_tokens": 5}),
    ({"max_completion_tokens": 6, "max_tokens": 5}, {"max_tokens": 6}),
    ({"logprobs": True, "top_logprobs": 2}, {"logprobs": 2}),
    ({"logprobs": True}, {"logprobs": 0}),
    ({"logprobs": False, "top_logprobs": 2}, {"logprobs": None}),
]
# the chat route's own mapping (tools.py; test_server_sampling.py maps without the route)
TOOL_FIELDS = [
    (  # a call is delimited by special tokens: the text keeps them for the parser
        {"tools": [TOOL], "tool_choice": "required"},
        {"skip_special_tokens": False},
    ),
]
# fields that do not become sampling settings, each shown by a test below or in test_server.py
NOT_SAMPLING = {"model", "stream", "stream_options", "user", "prompt", "echo", "suffix"}
NOT_SAMPLING_CHAT = {"model", "stream", "stream_options", "user", "messages"}
NOT_SAMPLING_CHAT |= {"add_generation_prompt"}
NOT_SAMPLING_CHAT |= {"parallel_tool_calls", "include_reasoning"}  # test_tools.py shows them


def mapping_cases():
    for endpoint, own in (("completions", COMPLETION_FIELDS), ("chat", CHAT_FIELDS + TOOL_FIELDS)):
        for fields, expected in SHARED_FIELDS + STRUCTURED_FIELDS + own:
            yield pytest.param(endpoint, fields, expected, id=f"{endpoint}-{'-'.join(fields)}")


@pytest.mark.parametrize("endpoint, fields, expected", list(mapping_cases()))
def test_each_field_reaches_the_engines_sampling_params(live_server, endpoint, fields, expected):
    body = {"max_tokens": 4, **fields}
    with engine_requests(live_server) as seen:
        post(live_server, endpoint, body)
    (_, params), *_ = seen
    for name, value in expected.items():
        assert getattr(params, name) == value, name


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_request_without_fields_gets_vllms_defaults(live_server, endpoint):
    with engine_requests(live_server) as seen:
        post(live_server, endpoint, {})
    (_, params), *_ = seen
    max_tokens = 16 if endpoint == "completions" else None  # chat: up to max_model_len
    assert dataclasses.asdict(params) == dataclasses.asdict(SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize(
    "model, cases, others",
    [
        (CompletionRequest, SHARED_FIELDS + STRUCTURED_FIELDS + COMPLETION_FIELDS, NOT_SAMPLING),
        (
            ChatCompletionRequest,
            SHARED_FIELDS + STRUCTURED_FIELDS + CHAT_FIELDS + TOOL_FIELDS,
            NOT_SAMPLING_CHAT,
        ),
    ],
)
def test_every_request_field_has_a_mapping_case(model, cases, others):
    covered = {name for fields, _ in cases for name in fields}
    assert set(model.model_fields) == covered | others


# ---- the effect: the same answer as the offline engine, and not the answer without the field

# (request fields, the same as SamplingParams fields)
EFFECTS = {
    "temperature": ({"temperature": 0.4}, {"temperature": 0.4}),
    "top_k": ({"top_k": 2}, {"top_k": 2}),
    "top_p": ({"top_p": 0.3}, {"top_p": 0.3}),
    "min_p": ({"min_p": 0.6}, {"min_p": 0.6}),
    "repetition_penalty": ({"repetition_penalty": 3.0}, {"repetition_penalty": 3.0}),
    "presence_penalty": ({"presence_penalty": 2.0}, {"presence_penalty": 2.0}),
    "frequency_penalty": ({"frequency_penalty": 2.0}, {"frequency_penalty": 2.0}),
    "logit_bias": ({"logit_bias": {"70": 8.0}}, {"logit_bias": {70: 8.0}}),
    "seed": ({"seed": 6}, {"seed": 6}),
    "max_tokens": ({"max_tokens": 5}, {"max_tokens": 5}),
    "min_tokens": (
        {"min_tokens": 4, "ignore_eos": False, "logit_bias": {str(EOS): 100}},
        {"min_tokens": 4, "ignore_eos": False, "logit_bias": {EOS: 100}},
    ),
}


def effect_cases():
    for endpoint in ("completions", "chat"):
        for name in EFFECTS:
            yield pytest.param(endpoint, name, id=f"{endpoint}-{name}")


@pytest.fixture(scope="module")
def baseline_texts(live_server):
    return {e: text_of(post(live_server, e, BASE)["choices"][0]) for e in ("completions", "chat")}


@pytest.mark.parametrize("endpoint, name", list(effect_cases()))
def test_each_field_changes_the_answer_as_it_does_offline(
    live_server, offline, baseline_texts, endpoint, name
):
    fields, params = EFFECTS[name]
    choice = post(live_server, endpoint, {**BASE, **fields})["choices"][0]
    expected = run_offline(offline, endpoint, SamplingParams(**{**BASE, **params})).outputs[0]
    assert text_of(choice) == expected.text
    assert choice["finish_reason"] == expected.finish_reason
    assert text_of(choice) != baseline_texts[endpoint], f"{name} changed nothing"


def test_top_k_1_at_temperature_1_is_the_greedy_answer(live_server):
    greedy = post(live_server, "completions", {**BASE, "temperature": 0})["choices"][0]["text"]
    for seed in (1, 2):
        body = {**BASE, "top_k": 1, "seed": seed}
        assert post(live_server, "completions", body)["choices"][0]["text"] == greedy


def test_logit_bias_forces_the_token(live_server, offline):
    choice = post(live_server, "completions", {**BASE, "logit_bias": {"70": 100}})["choices"][0]
    assert choice["text"] == offline.get_tokenizer().decode([70] * BASE["max_tokens"])


# ---- fields that shape the response


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_choices_differ_at_temperature_above_zero_and_match_offline(
    live_server, offline, endpoint
):
    out = post(live_server, endpoint, {**BASE, "n": 3})
    texts = [text_of(c) for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) == 3
    expected = run_offline(offline, endpoint, SamplingParams(**BASE, n=3))
    assert texts == [o.text for o in expected.outputs]
    assert out["usage"]["completion_tokens"] == 3 * BASE["max_tokens"]


def test_completion_logprobs_are_the_offline_engines_top_n(live_server, offline):
    """OpenAI's legacy shape keys top_logprobs by token text: tokens that decode alike (pieces of
    one UTF-8 character) share a key, which holds the most likely of them."""
    tok = offline.get_tokenizer()
    text = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    for n in (0, 1, 5):
        lp = post(live_server, "completions", {**BASE, "logprobs": n})["choices"][0]["logprobs"]
        ref = run_offline(offline, "completions", SamplingParams(**BASE, logprobs=n)).outputs[0]
        assert lp["tokens"] == [text(t) for t in ref.token_ids]
        assert lp["token_logprobs"] == pytest.approx(
            [d[t] for d, t in zip(ref.logprobs, ref.token_ids)], abs=1e-4
        )
        for top, ref_top in zip(lp["top_logprobs"], ref.logprobs, strict=True):
            expected: dict[str, float] = {}
            for t, v in sorted(ref_top.items(), key=lambda kv: -kv[1])[:n]:
                expected.setdefault(text(t), v)
            assert top == pytest.approx(expected, abs=1e-4)


def test_chat_top_logprobs_count_is_the_one_asked(live_server):
    for n in (0, 3):
        body = {**BASE, "logprobs": True, "top_logprobs": n}
        content = post(live_server, "chat", body)["choices"][0]["logprobs"]["content"]
        assert len(content) == BASE["max_tokens"]
        assert [len(t["top_logprobs"]) for t in content] == [n] * BASE["max_tokens"]
    no_logprobs = post(live_server, "chat", {**BASE, "top_logprobs": 3})["choices"][0]
    assert no_logprobs["logprobs"] is None


def test_echo_puts_the_prompt_text_before_the_completion(live_server, offline):
    prompt_text = offline.get_tokenizer().decode(PROMPT_IDS, skip_special_tokens=False)
    plain = post(live_server, "completions", BASE)["choices"][0]["text"]
    echoed = post(live_server, "completions", {**BASE, "echo": True})["choices"][0]["text"]
    assert echoed == prompt_text + plain


def test_max_completion_tokens_caps_a_chat_answer(live_server):
    out = post(live_server, "chat", {**BASE, "max_tokens": 9, "max_completion_tokens": 3})
    assert out["usage"]["completion_tokens"] == 3
    assert out["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stop_token_ids_end_the_answer_at_that_token(live_server, offline, endpoint):
    greedy = {**BASE, "temperature": 0}
    tokens = run_offline(offline, endpoint, SamplingParams(**greedy)).outputs[0].token_ids
    stop_id = tokens[4]
    out = post(live_server, endpoint, {**greedy, "stop_token_ids": [stop_id]})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert out["usage"]["completion_tokens"] == tokens.index(stop_id) + 1


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_with_and_without_include_stop_str_in_output(live_server, include):
    greedy = {**BASE, "temperature": 0}
    full = post(live_server, "completions", greedy)["choices"][0]["text"]
    assert len(full) > 6
    stop = full[4:6]
    body = {**greedy, "stop": [stop], "include_stop_str_in_output": include}
    choice = post(live_server, "completions", body)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    cut = full.index(stop)
    assert choice["text"] == (full[: cut + len(stop)] if include else full[:cut])


def test_skip_special_tokens_decides_whether_special_tokens_are_text(live_server):
    special = SPECIAL_IDS["<|assistant|>"]
    body = {**BASE, "max_tokens": 3, "logit_bias": {str(special): 100}}
    kept = post(live_server, "completions", {**body, "skip_special_tokens": False})
    skipped = post(live_server, "completions", body)
    assert kept["choices"][0]["text"] == "<|assistant|>" * 3
    assert skipped["choices"][0]["text"] == ""


def test_min_tokens_holds_back_eos_until_reached(live_server):
    body = {**BASE, "ignore_eos": False, "logit_bias": {str(EOS): 100}}
    assert post(live_server, "completions", body)["usage"]["completion_tokens"] == 1
    out = post(live_server, "completions", {**body, "min_tokens": 5})
    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["finish_reason"] == "stop"


def test_same_seed_same_answer_on_both_endpoints(live_server):
    for endpoint in ("completions", "chat"):
        first = text_of(post(live_server, endpoint, BASE)["choices"][0])
        assert text_of(post(live_server, endpoint, BASE)["choices"][0]) == first
        other = text_of(post(live_server, endpoint, {**BASE, "seed": 99})["choices"][0])
        assert other != first


def test_add_generation_prompt_ends_the_chat_prompt_with_the_assistant_tag(live_server):
    with engine_requests(live_server) as seen:
        post(live_server, "chat", {"max_tokens": 1})
        post(live_server, "chat", {"max_tokens": 1, "add_generation_prompt": False})
    (with_tag, _), (without, _) = seen
    assert with_tag == without + [SPECIAL_IDS["<|assistant|>"]]


def test_suffix_is_refused_rather_than_ignored(live_server):
    r = httpx.post(
        live_server.url + "/v1/completions",
        json={"model": live_server.model, "prompt": PROMPT_IDS, "suffix": "end"},
        headers={"Authorization": f"Bearer {live_server.api_key}"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "suffix" in r.json()["error"]["message"]


# ---- aborts and metrics values


def _metrics(live_server) -> dict[str, float]:
    return read_metrics(live_server.url)


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _success(reason: str) -> str:
    return f'pagedserve:request_success_total{{finished_reason="{reason}"}}'


def test_finish_reason_counters_count_each_finished_sequence(live_server):
    before = _metrics(live_server)
    post(live_server, "completions", {**BASE, "n": 2})  # two sequences at max_tokens
    post(live_server, "completions", {**BASE, "stop_token_ids": [70], "logit_bias": {"70": 100}})
    post(live_server, "chat", {**BASE, "max_tokens": 3})
    after = _metrics(live_server)
    assert _delta(before, after, _success("length")) == 3
    assert _delta(before, after, _success("stop")) == 1
    assert _delta(before, after, _success("abort")) == 0


def test_metrics_show_vllms_names_beside_pagedserves(live_server):
    text = httpx.get(live_server.url + "/metrics", timeout=10).text
    model, engine = live_server.model, live_server.app.state.serving.llm_engine
    limits = live_server.app.state.serving.engine.limits
    assert f'vllm:num_requests_waiting{{model_name="{model}"}} 0.0' in text
    assert f'vllm:kv_cache_usage_perc{{model_name="{model}"}}' in text
    assert f'vllm:gpu_cache_usage_perc{{model_name="{model}"}}' in text
    assert f'vllm:num_requests_running{{model_name="{model}"}}' in text
    info = f'vllm:cache_config_info{{block_size="{limits.block_size}",num_gpu_blocks="{limits.num_kv_pages}"}} 1.0'
    assert info in text
    assert limits.num_kv_pages == engine.block_manager.num_pages
    assert "pagedserve:num_requests_waiting 0.0" in text


def test_prefix_cache_counters_count_the_tokens_found(live_server):
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 can be found again
    before = _metrics(live_server)
    for _ in range(2):
        httpx.post(
            live_server.url + "/v1/completions",
            json={"model": live_server.model, "prompt": prompt, "max_tokens": 1},
            headers={"Authorization": f"Bearer {live_server.api_key}"},
            timeout=60,
        ).raise_for_status()
    after = _metrics(live_server)
    assert _delta(before, after, "pagedserve:prefix_cache_queries_total") == 2 * len(prompt)
    assert _delta(before, after, "pagedserve:prefix_cache_hits_total") == 32


def test_preemptions_are_counted_and_every_request_still_finishes(tiny_glm4):
    """Two sequences of 100 tokens on a pool of 8 pages x 16: one must give way to the other."""
    from fastapi.testclient import TestClient

    from pagedserve.server.app import build_app

    engine = tiny_engine(tiny_glm4[0], num_kv_pages=8, block_size=16, max_model_len=128)
    with TestClient(build_app(engine, "tiny")) as http:
        body = {"prompt": PROMPT_IDS, "max_tokens": 90, "n": 2, "ignore_eos": True, "seed": 1}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
        assert r.json()["usage"]["completion_tokens"] == 180
        metrics = http.get("/metrics").text
    preemptions = engine.scheduler.num_preemptions
    assert preemptions >= 1
    assert f"pagedserve:num_preemptions_total {float(preemptions)}" in metrics
    assert engine.block_manager.num_free_pages == 8


def test_an_aborted_request_leaves_the_others_untouched(live_server, offline, slow_steps):
    """A client that leaves mid-stream: its request is aborted and counted, its pages freed,
    and a request running beside it gets the answer it gets alone."""
    aborted, finished = _success("abort"), _success("length")
    before = _metrics(live_server)
    body = {**BASE, "max_tokens": 200, "stream": True}
    other: dict = {}

    def neighbour():
        other.update(post(live_server, "completions", {**BASE, "max_tokens": 40}))

    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST",
            live_server.url + "/v1/completions",
            json={"model": live_server.model, "prompt": PROMPT_IDS, **body},
            headers={"Authorization": f"Bearer {live_server.api_key}"},
        ) as r:
            lines = r.iter_lines()
            next(lines)
            thread = threading.Thread(target=neighbour)
            thread.start()
            next(lines)
    thread.join(60)
    expected = run_offline(offline, "completions", SamplingParams(**{**BASE, "max_tokens": 40}))
    assert other["choices"][0]["text"] == expected.outputs[0].text
    after = wait_idle(live_server.url)
    assert _delta(before, after, aborted) == 1
    assert _delta(before, after, finished) == 1
    assert after["pagedserve:kv_cache_usage_perc"] == 0


def test_an_aborted_n_request_counts_each_of_its_sequences_once(live_server, slow_steps):
    before = _metrics(live_server)
    body = {**BASE, "max_tokens": 200, "n": 2, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST",
            live_server.url + "/v1/completions",
            json={"model": live_server.model, "prompt": PROMPT_IDS, **body},
            headers={"Authorization": f"Bearer {live_server.api_key}"},
        ) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
    after = wait_idle(live_server.url)
    while _delta(before, after, _success("abort")) < 2:  # counted as the stream closes
        after = _metrics(live_server)
        time.sleep(0.05)
    assert _delta(before, after, _success("abort")) == 2
    assert _delta(before, after, "pagedserve:e2e_request_latency_seconds_count") == 1


# ---- bad values: a 400 naming the field and the rule


BAD_FIELDS = [
    (
        "completions",
        {"n": 17},
        "n",
        "n=17 is more than this server's --max-num-seqs 16; lower n",
    ),
    ("chat", {"n": 17}, "n", "n=17 is more than this server's --max-num-seqs 16; lower n"),
    (
        "completions",
        {"logit_bias": {"abc": 1}},
        "logit_bias",
        "logit_bias key 'abc' is not a token id in [0, 320)",
    ),
    (
        "chat",
        {"logit_bias": {"-5": 1}},
        "logit_bias",
        "logit_bias key '-5' is not a token id in [0, 320)",
    ),
    (
        "completions",
        {"logit_bias": {"320": 1}},
        "logit_bias",
        "logit_bias key '320' is not a token id in [0, 320)",
    ),
    (
        "completions",
        {"logprobs": 21},
        "logprobs",
        "logprobs=21 must be in [0, 20] (this server's --max-logprobs)",
    ),
    ("completions", {"logprobs": -1}, "logprobs", "logprobs=-1 must be >= 0"),
    (
        "chat",
        {"logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "top_logprobs=21 must be in [0, 20] (this server's --max-logprobs)",
    ),
    ("chat", {"temperature": -1}, "temperature", "temperature=-1 must be >= 0"),
    ("completions", {"top_k": 0.5}, "top_k", None),
    (
        "completions",
        {"suffix": "end"},
        "suffix",
        "suffix is not supported; put the whole text in the prompt",
    ),
    (
        "chat",
        {"max_completion_tokens": 0, "max_tokens": 5},
        "max_completion_tokens",
        "max_completion_tokens=0 must be >= 1",
    ),
    ("chat", {"max_tokens": 0}, "max_tokens", "max_tokens=0 must be >= 1"),
]


@pytest.mark.parametrize("endpoint, fields, param, message", BAD_FIELDS)
def test_bad_field_values_are_400_naming_the_field(live_server, endpoint, fields, param, message):
    r = request(live_server, endpoint, fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "")
    if message is not None:
        assert error["message"] == message


def test_logit_bias_is_clipped_to_plus_minus_100(live_server):
    with engine_requests(live_server) as seen:
        post(live_server, "completions", {"max_tokens": 1, "logit_bias": {"3": 250, "4": -1e9}})
    assert seen[0][1].logit_bias == {3: 100.0, 4: -100.0}
