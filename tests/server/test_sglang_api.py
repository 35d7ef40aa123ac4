"""SGLang's native API (``sglang_api.py``) in this process on the demo model: ``/generate``'s
prompts, batches and per-prompt lists, its sampling_params in SGLang's names, logprobs as SGLang's
tuples, prefill-only requests, finish reasons, tools, streaming; the info routes and
``/flush_cache``; the chat template's role blocks. Fast enough for mutation testing of the module.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionToolsParam
from pagedserve.server.serving import OpenAIServing
from pagedserve.server.sglang_api import (
    DEFAULT_MAX_NEW_TOKENS,
    GenerateReqInput,
    SGLangSamplingParams,
    SGLangServing,
    chat_template_roles,
    sglang_sampling_params,
)
from tests.engine.test_structured_output import PHONE, PROMPTS, SCHEMA
from tests.helpers.apps import AUTH, demo_engine, served
from tests.server.test_chat_api import WEATHER

VOCAB = 4096  # the demo model's


@pytest.fixture(scope="module")
def engine():
    return demo_engine(max_model_len=512, num_kv_pages=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def client(client):
    """conftest's client, sending the API key with every request."""
    client.headers.update(AUTH)
    return client


@pytest.fixture
def sgl(engine) -> SGLangServing:
    """``/generate``'s handling over a serving layer of its own (its loop not started)."""
    return SGLangServing(OpenAIServing(engine, "demo", None))


def generate(client, **body) -> dict | list:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(client, **body) -> dict:
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def greedy(n: int, **more) -> dict:
    return {"max_new_tokens": n, "temperature": 0, **more}


# ---- sampling_params ---------------------------------------------------------------------------
def params_of(**fields):
    return sglang_sampling_params(SGLangSamplingParams(**fields), VOCAB)


def refusal(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        params_of(**fields)
    return e.value


def test_sglang_names_become_ours():
    p = params_of(max_new_tokens=7, min_new_tokens=2, sampling_seed=11, top_k=5, stop="x")
    assert (p.max_tokens, p.min_tokens, p.seed, p.top_k, p.stop) == (7, 2, 11, 5, ["x"])
    assert params_of(seed=3).seed == 3


def test_without_max_new_tokens_a_request_gets_sglangs_default():
    assert params_of().max_tokens == DEFAULT_MAX_NEW_TOKENS == 128


def test_max_new_tokens_0_computes_the_one_token_the_prompt_gives_anyway():
    assert params_of(max_new_tokens=0).max_tokens == 1
    assert params_of(max_new_tokens=2).max_tokens == 2


def test_logit_bias_keys_become_token_ids_checked_against_the_vocabulary():
    assert params_of(logit_bias={"5": 1.5}).logit_bias == {5: 1.5}
    assert refusal(logit_bias={str(VOCAB): 1.0}).param == "logit_bias"


def test_fields_with_no_effect_here_are_accepted_and_dropped():
    p = params_of(spaces_between_special_tokens=False, no_stop_trim=True, custom_params={"a": 1})
    assert p.max_tokens == DEFAULT_MAX_NEW_TOKENS
    assert params_of(stop_regex=[]).max_tokens == DEFAULT_MAX_NEW_TOKENS  # an empty one too


def test_stop_regex_is_a_400_that_says_to_use_stop_strings():
    e = refusal(stop_regex="a+")
    assert (e.status, e.param) == (400, "stop_regex")
    assert e.message == "stop_regex is not supported; use stop strings"


def test_a_value_our_sampler_refuses_is_a_400_naming_its_field():
    e = refusal(max_new_tokens=2, min_new_tokens=3)
    assert (e.status, e.param) == (400, "min_tokens")
    assert e.message == "min_tokens=3 must not exceed max_tokens (2)"


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("regex", PHONE, "regex"),
        ("json_schema", json.dumps(SCHEMA), "json"),
        ("json_schema", SCHEMA, "json"),
        ("ebnf", 'root ::= "yes" | "no"', "grammar"),
    ],
)
def test_each_constraint_becomes_its_structured_output(field, value, kind):
    constraint = params_of(**{field: value}).structured_outputs
    expected = SCHEMA if kind == "json" else value
    assert getattr(constraint, kind) == expected
    others = {"regex", "json", "grammar"} - {kind}
    assert all(getattr(constraint, other) is None for other in others)


@pytest.mark.parametrize(
    ("field", "value"), [("regex", "(("), ("json_schema", "{"), ("ebnf", 'root ::= "a')]
)
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(field, value):
    e = refusal(**{field: value})
    assert (e.status, e.param, e.code) == (400, field, "invalid_structured_output")


def test_a_sampler_refusal_names_the_field_even_where_its_rule_holds_an_equals_sign():
    # past the API's own ranges (which refuse it first): SamplingParams' check, named by field
    with pytest.raises(APIError) as e:
        sglang_sampling_params(SGLangSamplingParams.model_construct(temperature=-1.0), VOCAB)
    assert (e.value.param, e.value.message) == ("temperature", "temperature=-1.0 must be >= 0")


def test_two_constraints_are_a_400():
    e = refusal(regex="a", ebnf='root ::= "a"')
    assert (e.param, e.message) == ("sampling_params", "send one of regex, json_schema and ebnf")


def test_without_a_constraint_the_output_is_free():
    assert params_of(temperature=0.5).structured_outputs is None


def test_logit_bias_is_checked_against_the_served_models_vocabulary(client):
    error = refused(client, text="Hi", sampling_params={"logit_bias": {"4096": 1.0}})
    assert error["param"] == "logit_bias" and "4096" in error["message"]


def test_an_unknown_sampling_param_is_a_400_naming_it(client):
    error = refused(client, text="Hi", sampling_params={"max_new_token": 3})
    assert "max_new_token" in error["message"]


# ---- prompts -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "text", "send exactly one of text and input_ids"),
        ({"text": "a", "input_ids": [1]}, "text", "send exactly one of text and input_ids"),
        ({"text": []}, "text", "text is an empty list"),
        ({"input_ids": []}, "input_ids", "input_ids is empty"),
    ],
)
def test_a_request_without_one_prompt_is_a_400(client, body, param, message):
    error = refused(client, **body)
    assert (error["param"], error["message"]) == (param, message)


def test_text_is_tokenized_and_token_ids_are_taken_as_they_are(client, engine):
    ids = engine.tokenizer.encode("Hello there")
    by_text = generate(client, text="Hello there", sampling_params=greedy(3))
    by_ids = generate(client, input_ids=ids, sampling_params=greedy(3))
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["text"] == by_ids["text"] == engine.tokenizer.decode(by_ids["output_ids"])


@pytest.mark.parametrize(
    ("prompt", "count"),
    [
        ({"text": "Hi"}, None),
        ({"text": ["Hi"]}, 1),
        ({"text": ["Hi", "Hello there"]}, 2),
        ({"input_ids": [5, 6, 7]}, None),
        ({"input_ids": [[5, 6, 7]]}, 1),
        ({"input_ids": [[5, 6, 7], [8, 9]]}, 2),
    ],
)
def test_one_prompt_answers_an_object_and_a_batch_a_list(client, prompt, count):
    answer = generate(client, **prompt, sampling_params=greedy(2))
    if count is None:
        assert isinstance(answer, dict) and answer["meta_info"]["completion_tokens"] == 2
    else:
        assert [len(a["output_ids"]) for a in answer] == [2] * count
        ids = prompt.get("input_ids")
        if ids is not None:
            assert [a["meta_info"]["prompt_tokens"] for a in answer] == [len(p) for p in ids]


def test_n_samples_of_one_prompt_answer_a_list(client):
    answer = generate(client, text="Hi", sampling_params={"max_new_tokens": 2, "n": 3})
    assert len(answer) == 3 and all(len(a["output_ids"]) == 2 for a in answer)


def test_a_text_prompt_needs_the_tokenizer_and_token_ids_do_not(client, monkeypatch):
    serving = client.app.state.serving
    monkeypatch.setattr(serving, "tokenizer", None)
    error = refused(client, text="Hi")
    assert error["message"] == "this model has no tokenizer.json: send token ids as the prompt"
    assert len(generate(client, input_ids=[5, 6], sampling_params=greedy(2))["output_ids"]) == 2
    error = refused(client, input_ids=[5, 6], sampling_params={"regex": "a"})
    assert (error["param"], error["message"]) == (
        "regex",
        "structured outputs need the model's tokenizer.json",
    )


# ---- per-prompt lists --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("sampling_params", [greedy(1)] * 2),
        ("return_logprob", [True, False]),
        ("logprob_start_len", [0, 0]),
        ("top_logprobs_num", [1, 1]),
    ],
)
def test_a_per_prompt_list_of_the_wrong_length_is_a_400(client, name, value):
    error = refused(client, text=["a", "b", "c"], **{name: value})
    assert error["param"] == name
    assert error["message"] == (
        f"{name} has 2 entries for 3 prompts; send one per prompt or a single value for all"
    )


def test_each_prompt_takes_its_own_entry_of_a_list(client):
    a, b = generate(
        client,
        text=["Hi", "Hello"],
        sampling_params=[greedy(0), greedy(3)],
        return_logprob=[False, True],
        top_logprobs_num=[0, 2],
        logprob_start_len=[-1, 0],
    )
    assert (a["text"], a["output_ids"], a["meta_info"]["finish_reason"]) == (
        "",
        [],
        {"type": "length", "length": 0},
    )
    assert "output_token_logprobs" not in a["meta_info"]
    assert len(b["output_ids"]) == 3
    meta = b["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]  # from position 0
    assert [len(top) for top in meta["output_top_logprobs"]] == [2, 2, 2]


def test_a_single_value_serves_every_prompt(client):
    answers = generate(client, text=["Hi", "Hello"], sampling_params=greedy(2), return_logprob=True)
    assert [len(a["meta_info"]["output_token_logprobs"]) for a in answers] == [2, 2]


# ---- limits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["text", "input_ids"])
def test_a_prompt_past_the_context_is_a_400_naming_the_field_it_came_in(client, field):
    prompt = "word " * 600 if field == "text" else [5] * 600
    prompts = {field: ["Hi" if field == "text" else [5], prompt]}
    error = refused(client, **prompts, sampling_params=greedy(2))
    assert (error["param"], error["code"]) == (field, "context_length_exceeded")


def test_n_up_to_max_num_seqs_runs_and_past_it_is_a_400(client):
    assert len(generate(client, text="Hi", sampling_params={"max_new_tokens": 1, "n": 8})) == 8
    error = refused(client, text="Hi", sampling_params={"n": 9})
    assert error["param"] == "n"
    assert error["message"] == "n=9 is more than this server's --max-num-seqs 8; lower n"


def test_logprobs_are_asked_of_the_engine_for_the_prompt_and_the_output(sgl):
    assert sgl.params(GenerateReqInput(text="x"), 0).logprobs is None
    for top in (0, 3):
        body = GenerateReqInput(text="x", return_logprob=True, top_logprobs_num=top)
        params = sgl.params(body, 0)
        assert (params.logprobs, params.prompt_logprobs) == (top, top)


def test_top_logprobs_num_is_bounded_by_the_servers_max_logprobs(engine):
    sgl = SGLangServing(OpenAIServing(engine, "demo", None, max_logprobs=5))
    assert sgl.params(GenerateReqInput(text="x", return_logprob=True, top_logprobs_num=5), 0)
    with pytest.raises(APIError) as e:
        sgl.params(GenerateReqInput(text="x", return_logprob=True, top_logprobs_num=6), 0)
    assert e.value.param == "top_logprobs_num" and "5" in e.value.message


def test_top_logprobs_num_past_the_servers_limit_is_a_400_only_when_logprobs_are_asked(client):
    error = refused(client, text="Hi", return_logprob=True, top_logprobs_num=21)
    assert error["param"] == "top_logprobs_num" and "20" in error["message"]
    answer = generate(client, text="Hi", top_logprobs_num=21, sampling_params=greedy(1))
    assert "output_top_logprobs" not in answer["meta_info"]


def test_a_draining_server_admits_no_generate(client, monkeypatch):
    monkeypatch.setattr(client.app.state.serving.engine, "draining", True)
    r = client.post("/generate", json={"text": "Hi"})
    assert (r.status_code, r.json()["error"]["code"]) == (503, "shutting_down")


def test_the_request_id_names_each_prompts_answer(client):
    answers = generate(client, text=["a", "b"], rid="mine", sampling_params=greedy(1))
    assert [a["meta_info"]["id"] for a in answers] == ["mine-0", "mine-1"]
    one = generate(client, text="a", sampling_params=greedy(1))["meta_info"]["id"]
    assert re.fullmatch(r"generate-[0-9a-f]{32}-0", one)


def test_generate_answers_put_as_post(client):
    r = client.put("/generate", json={"text": "Hi", "sampling_params": greedy(2)})
    assert r.status_code == 200
    post = generate(client, text="Hi", sampling_params=greedy(2))
    assert (r.json()["text"], r.json()["output_ids"]) == (post["text"], post["output_ids"])


# ---- the answer --------------------------------------------------------------------------------
def test_meta_info_counts_the_prompt_the_output_and_the_cached_prefix(client):
    prefix = "A long shared prefix for the agent. " * 20
    first = generate(client, text=prefix, sampling_params=greedy(0))
    assert (first["text"], first["output_ids"]) == ("", [])
    meta = first["meta_info"]
    assert meta["prompt_tokens"] > 64 and meta["completion_tokens"] == 0
    second = generate(client, text=prefix + "Next", sampling_params=greedy(3))["meta_info"]
    assert second["completion_tokens"] == 3
    assert 64 <= second["cached_tokens"] < second["prompt_tokens"]
    assert second["cached_tokens"] % 16 == 0  # whole pages of the prefix


def output(finish_reason=None, stop_reason=None, token_ids=(3, 4)) -> CompletionOutput:
    return CompletionOutput(0, "ab", list(token_ids), None, None, finish_reason, stop_reason)


def answer(sgl, o: CompletionOutput, prefill_only=False, metrics=None, **body) -> dict:
    out = RequestOutput("r", "x", [1, 2], [o], o.finished, None, 5, metrics or {})
    request = GenerateReqInput(text="x", **body)
    return sgl.result(request, 0, "rid-0", [1, 2], out, o, prefill_only)


def test_the_result_is_sglangs_shape(sgl):
    res = answer(sgl, output("length"))
    meta = res.pop("meta_info")
    assert res == {"text": "ab", "output_ids": [3, 4]}
    latency = meta.pop("e2e_latency")
    assert meta == {
        "id": "rid-0",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "cached_tokens": 5,
    }
    assert latency == 0  # no arrival time: none measured


def test_e2e_latency_runs_from_the_requests_arrival(sgl):
    meta = answer(sgl, output("length"), metrics={"arrival_time": time.monotonic() - 5})
    assert 5 <= meta["meta_info"]["e2e_latency"] < 6


@pytest.mark.parametrize("reason", ["length", "stop"])
def test_a_prefill_only_answer_has_no_text_and_no_tokens(sgl, reason):
    res = answer(sgl, output(reason, "x" if reason == "stop" else None), prefill_only=True)
    assert (res["text"], res["output_ids"]) == ("", [])
    assert res["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert res["meta_info"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    ("o", "expected"),
    [
        (output(None), None),
        (output("length"), {"type": "length", "length": 2}),
        (output("stop", "END"), {"type": "stop", "matched": "END"}),
        (output("stop", 0), {"type": "stop", "matched": 0}),
        (output("stop", None), {"type": "stop", "matched": 4}),  # eos: the last token
        (output("stop", None, token_ids=()), {"type": "stop", "matched": None}),
        (output("abort"), {"type": "abort", "message": "abort"}),
    ],
)
def test_finish_reasons_in_sglangs_shape(o, expected):
    assert SGLangServing.finish_reason(o, list(o.token_ids), False) == expected


def test_a_prefill_only_request_finishes_by_length_0_whatever_ended_it():
    assert SGLangServing.finish_reason(output("stop", "x"), [], True) == {
        "type": "length",
        "length": 0,
    }


def test_a_stop_string_is_the_matched_stop(client):
    text = generate(client, text="Hi", sampling_params=greedy(8))["text"]
    stop = text[3:5]
    res = generate(client, text="Hi", sampling_params=greedy(8, stop=[stop]))
    assert res["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert res["text"] == text[: text.index(stop)]


# ---- logprobs ----------------------------------------------------------------------------------
def test_logprobs_are_sglang_tuples_matching_the_openai_api(client):
    text = "The quick brown fox"
    res = generate(
        client,
        text=text,
        sampling_params=greedy(3),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
    )
    meta = res["meta_info"]
    serving = client.app.state.serving
    ids = serving.tokenizer.encode(text)
    assert [e[1] for e in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None  # the first token has no prediction
    assert meta["input_top_logprobs"][0] is None
    for top in meta["input_top_logprobs"][1:]:
        assert len(top) == 2 and all(t[2] == serving.token_str(t[1]) for t in top)
    assert [e[1] for e in meta["output_token_logprobs"]] == res["output_ids"]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    assert all(e[2] == serving.token_str(e[1]) for e in entries)
    ref = client.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True},
    ).json()["choices"][0]["logprobs"]
    assert [e[0] for e in entries][1:] == pytest.approx(ref["token_logprobs"][1:], abs=1e-4)
    for top, want in zip(meta["output_top_logprobs"], ref["top_logprobs"][len(ids) :], strict=True):
        assert {t[2]: t[0] for t in top} == pytest.approx(want, abs=1e-4)
        assert [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert all(t[2] == serving.token_str(t[1]) for t in top)


@pytest.mark.parametrize(("start", "count"), [(-1, 1), (0, None), (2, None), (1000, 0)])
def test_logprob_start_len_picks_the_first_prompt_position(client, start, count):
    ids = [5, 6, 7, 8, 9]
    meta = generate(
        client, input_ids=ids, sampling_params=greedy(1), return_logprob=True,
        logprob_start_len=start,
    )["meta_info"]  # fmt: skip
    first = len(ids) - count if count is not None else start
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[first:]
    assert meta["input_top_logprobs"] == [None] * len(ids[first:])  # top_logprobs_num 0


def test_without_text_in_logprobs_the_tuples_hold_none_and_without_top_no_lists(client):
    meta = generate(client, input_ids=[5, 6], sampling_params=greedy(2), return_logprob=True)[
        "meta_info"
    ]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    assert [e[2] for e in entries] == [None] * 3
    assert all(isinstance(e[0], float) for e in meta["input_token_logprobs"])
    assert meta["output_top_logprobs"] == [None, None]


def test_top_logprobs_hold_their_number_of_tuples(client):
    meta = generate(
        client, input_ids=[5, 6, 7], sampling_params=greedy(2), return_logprob=True,
        top_logprobs_num=3, logprob_start_len=1,
    )["meta_info"]  # fmt: skip
    assert [len(top) for top in meta["input_top_logprobs"]] == [3, 3]
    assert [len(top) for top in meta["output_top_logprobs"]] == [3, 3]
    assert all(t[2] is None for top in meta["output_top_logprobs"] for t in top)
    chosen = [e[0] for e in meta["output_token_logprobs"]]
    assert chosen == [top[0][0] for top in meta["output_top_logprobs"]]  # greedy: the best


def test_a_prefill_only_request_has_prompt_logprobs_and_no_output_ones(client):
    meta = generate(
        client, input_ids=[5, 6, 7], sampling_params=greedy(0), return_logprob=True,
        top_logprobs_num=1, logprob_start_len=0,
    )["meta_info"]  # fmt: skip
    assert [e[1] for e in meta["input_token_logprobs"]] == [5, 6, 7]
    assert (meta["output_token_logprobs"], meta["output_top_logprobs"]) == ([], [])


def test_an_output_without_prompt_logprobs_has_none_for_each_position(sgl):
    o = CompletionOutput(0, "ab", [3, 4], None, [{3: -0.5}, {4: -0.25, 9: -2.0}], "length")
    res = answer(sgl, o, return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    meta = res["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 1, None], [None, 2, None]]
    assert meta["input_top_logprobs"] == [None, None]
    assert meta["output_token_logprobs"] == [[-0.5, 3, None], [-0.25, 4, None]]
    assert meta["output_top_logprobs"] == [[[-0.5, 3, None]], [[-0.25, 4, None]]]
    o.logprobs = None  # none came back: no output entries
    meta = answer(sgl, o, return_logprob=True)["meta_info"]
    assert (meta["output_token_logprobs"], meta["output_top_logprobs"]) == ([], [])


# ---- tools -------------------------------------------------------------------------------------
def test_a_required_tool_call_is_read_into_meta_info(client):
    res = generate(
        client, text="Weather?", tools=[WEATHER], tool_choice="required", sampling_params=greedy(60)
    )
    (call,) = res["meta_info"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    specials = client.app.state.serving.special_texts
    assert res["text"].startswith("get_weather") and not any(s in res["text"] for s in specials)


def test_every_prompt_of_a_batch_is_held_to_the_tool_choice(client):
    answers = generate(
        client, text=["Weather?", "Hi"], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        sampling_params=greedy(60),
    )  # fmt: skip
    for res in answers:
        names = [c["function"]["name"] for c in res["meta_info"]["tool_calls"]]
        assert names and set(names) == {"get_weather"}


def test_without_parallel_tool_calls_each_prompt_makes_one_call(engine, client):
    # a bias towards <|assistant|>, which opens a further call, makes every prompt want several
    # calls on any kernels (the model's own greedy choice differs between them); where the
    # grammar allows one call only, the bias has no token to act on
    further_call = engine.tokenizer.token_to_id("<|assistant|>")
    body = dict(
        text=["Hi", "Weather?"], tools=[WEATHER],
        sampling_params=greedy(40, logit_bias={str(further_call): 100.0}),
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    parallel = generate(client, **body)
    assert min(len(res["meta_info"]["tool_calls"]) for res in parallel) > 1
    single = generate(client, **body, parallel_tool_calls=False)
    assert [len(res["meta_info"]["tool_calls"]) for res in single] == [1, 1]


def test_auto_tool_choice_where_the_server_enables_it():
    with served(demo_engine(), tool_call_parser="glm4", enable_auto_tool_choice=True) as c:
        body = {"text": "Weather?", "tools": [WEATHER], "tool_choice": "auto"}
        r = c.post("/generate", json={**body, "sampling_params": greedy(4)}, headers=AUTH)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4


def test_tool_choice_none_reads_no_calls_and_constrains_nothing(client):
    free = generate(client, text="Weather?", sampling_params=greedy(8))
    res = generate(
        client, text="Weather?", tools=[WEATHER], tool_choice="none", sampling_params=greedy(8)
    )
    assert "tool_calls" not in res["meta_info"] and res["output_ids"] == free["output_ids"]


def test_tools_are_checked_as_the_openai_api_checks_them(client):
    error = refused(client, text="Hi", tool_choice="required")
    assert error["param"] == "tool_choice"
    error = refused(client, text="Hi", tools=[WEATHER], tool_choice="auto")
    assert error["param"] == "tool_choice"  # auto needs --enable-auto-tool-choice


def test_calls_are_read_once_the_output_has_finished(sgl):
    from pagedserve.server.tool_parsers import Glm4ToolParser
    from pagedserve.server.tools import tool_request

    tok = sgl.serving.tokenizer
    request = tool_request([ChatCompletionToolsParam(**WEATHER)], "required", True, False)
    parser = Glm4ToolParser(tok, request.tools)
    text = '<|assistant|>get_weather\n{"city": "Rome"}'
    running = CompletionOutput(0, text, [1], None, None, None)
    meta: dict = {}
    assert sgl.with_tool_calls(meta, (request, parser), running) == 'get_weather\n{"city": "Rome"}'
    assert meta == {}
    done = CompletionOutput(0, text, [1], None, None, "stop")
    sgl.with_tool_calls(meta, (request, parser), done)
    (call,) = meta["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    two = CompletionOutput(0, text + text.replace("Rome", "Paris"), [1], None, None, "stop")
    for parallel, count in ((True, 2), (False, 1)):
        request.parallel = parallel
        sgl.with_tool_calls(meta, (request, parser), two)
        assert len(meta["tool_calls"]) == count


# ---- streaming ---------------------------------------------------------------------------------
def stream(client, **body) -> list[dict]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_stream_sends_the_text_so_far_and_ends_as_the_whole_answer(client):
    chunks = stream(client, text="Hello", sampling_params=greedy(6))
    assert len(chunks) > 1 and all("index" not in c for c in chunks)
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    full = generate(client, text="Hello", sampling_params=greedy(6))
    assert (chunks[-1]["text"], chunks[-1]["output_ids"]) == (full["text"], full["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_a_batch_streams_each_sequence_under_its_index(client):
    chunks = stream(client, text=["Hi", "Hello"], sampling_params={"max_new_tokens": 3, "n": 2})
    last = {c["index"]: c for c in chunks}  # prompt p's sample s: p * n + s
    assert sorted(last) == [0, 1, 2, 3]
    ids = [last[i]["meta_info"]["id"] for i in range(4)]
    assert ids[0] == ids[1] != ids[2] == ids[3]  # two samples of each prompt
    assert [len(c["output_ids"]) for c in last.values()] == [3] * 4


def test_a_stream_takes_each_prompts_own_entry_of_a_list(client):
    chunks = stream(
        client, text=["Hi", "Hello"], sampling_params=[greedy(0), greedy(2)],
        return_logprob=[True, False],
    )  # fmt: skip
    last = {c["index"]: c for c in chunks}
    assert (last[0]["text"], last[0]["output_ids"]) == ("", [])
    assert last[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(last[0]["meta_info"]["input_token_logprobs"]) == 1
    assert len(last[1]["output_ids"]) == 2 and "input_token_logprobs" not in last[1]["meta_info"]


def test_a_streamed_tool_call_arrives_with_the_last_chunk(client):
    chunks = stream(
        client, text="Weather?", tools=[WEATHER], tool_choice="required", sampling_params=greedy(60)
    )
    assert all("tool_calls" not in c["meta_info"] for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["tool_calls"][0]["function"]["name"] == "get_weather"


# ---- constrained generation --------------------------------------------------------------------
def test_generate_with_json_schema_regex_and_batch(client):
    results = generate(
        client,
        text=PROMPTS[:8],
        sampling_params={"max_new_tokens": 200, "temperature": 0.8, "json_schema": SCHEMA},
    )
    assert len(results) == 8
    for res in results:
        jsonschema.validate(json.loads(res["text"]), SCHEMA)
        assert res["meta_info"]["finish_reason"]["type"] == "stop"
        assert res["meta_info"]["completion_tokens"] == len(res["output_ids"])
    res = generate(client, text="Call", sampling_params={"max_new_tokens": 20, "regex": PHONE})
    assert re.fullmatch(PHONE, res["text"])
    error = refused(client, text="x", sampling_params={"regex": "(("})
    assert error["param"] == "regex" and "unclosed group" in error["message"]


# ---- model, server, cache ----------------------------------------------------------------------
def test_model_info_names_the_model_its_tokenizer_and_role_blocks(client, engine):
    info = client.get("/get_model_info").json()
    assert client.get("/model_info").json() == info
    roles = info.pop("chat_template_roles")
    assert info == {
        "model_path": "demo",
        "tokenizer_path": str(engine.tokenizer.model_dir),
        "served_model_name": "demo",
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }
    assert roles == chat_template_roles(engine.tokenizer)
    assert roles["roles"]["user"] == ["<|user|>\n", ""]


def test_model_info_without_a_tokenizer(client, monkeypatch):
    monkeypatch.setattr(client.app.state.serving, "tokenizer", None)
    info = client.get("/get_model_info").json()
    assert (info["tokenizer_path"], info["chat_template_roles"]) == (None, None)


def test_server_info_gives_the_engines_limits(client, engine):
    import pagedserve

    info = client.get("/server_info").json()
    assert client.get("/get_server_info").json().keys() == info.keys()
    states = info.pop("internal_states")
    assert info == {
        "model_path": "demo",
        "served_model_name": "demo",
        "context_length": 512,
        "max_running_requests": 8,
        "max_total_num_tokens": 128 * 16,
        "page_size": 16,
        "version": pagedserve.__version__,
        "engine": "pagedserve",
        "frontend": "python",
    }
    assert len(states) == 1 and states[0]["num_kv_pages"] == 128


@pytest.mark.parametrize("method", ["POST", "GET"])
def test_flush_cache_empties_the_prefix_cache(client, method):
    prompt = "A prefix long enough to fill pages of its own. " * 8
    generate(client, text=prompt, sampling_params=greedy(1))
    r = client.request(method, "/flush_cache")
    assert (r.status_code, r.text) == (200, "Cache flushed.\n")
    again = generate(client, text=prompt, sampling_params=greedy(1))
    assert again["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize(("running", "waiting"), [(1, 0), (0, 1), (1, 1)])
def test_flush_cache_refuses_while_requests_run_or_wait(client, monkeypatch, running, waiting):
    engine = client.app.state.serving.engine
    stats = {"num_requests_running": running, "num_requests_waiting": waiting}
    monkeypatch.setattr(engine, "stats", stats)
    r = client.post("/flush_cache")
    assert r.status_code == 400
    assert r.text == "Flush cache failed: there are running or waiting requests.\n"


# ---- role blocks -------------------------------------------------------------------------------
class Template:
    """A tokenizer whose chat template is a Python function of the messages."""

    def __init__(self, render, chat_template="(a template)"):
        self.render = render
        self.chat_template = chat_template

    def apply_chat_template(self, messages, add_generation_prompt):
        return self.render(messages, add_generation_prompt)


def tagged(messages, add_generation_prompt, refuse=()):
    text = "<s>"
    for m in messages:
        if m["role"] in refuse:
            raise ValueError(f"no {m['role']} turns")
        text += f"[{m['role']}]{m['content']}[/{m['role']}]"
    return text + ("[assistant]" if add_generation_prompt else "")


def test_role_blocks_are_what_the_template_puts_around_each_content():
    assert chat_template_roles(Template(tagged)) == {
        "begin": "<s>",
        "roles": {
            role: [f"[{role}]", f"[/{role}]"] for role in ("system", "user", "assistant", "tool")
        },
        "generation_prompt": "[assistant]",
    }


def test_a_template_without_tool_turns_has_no_tool_block():
    roles = chat_template_roles(Template(lambda m, g: tagged(m, g, refuse=("tool",))))
    assert sorted(roles["roles"]) == ["assistant", "system", "user"]


def test_a_template_that_cannot_render_a_role_has_no_role_blocks():
    assert chat_template_roles(Template(lambda m, g: tagged(m, g, refuse=("system",)))) is None


def test_a_begin_the_template_does_not_repeat_is_kept_in_the_prefix():
    def render(messages, add_generation_prompt):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) or "<empty>"

    roles = chat_template_roles(Template(render))
    assert roles["begin"] == "<empty>" and roles["roles"]["user"] == ["<user>", ""]


def test_without_a_tokenizer_or_a_template_there_are_no_role_blocks():
    assert chat_template_roles(None) is None
    assert chat_template_roles(Template(tagged, chat_template=None)) is None
