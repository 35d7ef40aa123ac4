"""Structured output: every constrained answer of the demo model (which, unconstrained, rarely
writes valid JSON) follows its schema, regex or choice, through the engine and the OpenAI API
(SGLang's /generate: tests/server/test_sglang_api.py); bad constraints are 400s naming the
problem; preemption and n > 1 keep the grammar state right."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import tokenizers

from pagedserve.engine.structured_output.backend_guidance import text_tokenizer
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

# every string bounded, so that any answer fits in max_tokens and finishes by its own closing brace
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
PHONE = r"\d{3}-\d{4}"
CHOICES = ["Paris", "London", "New York", "Tokyo"]
PROMPTS = [f"Person {i}: write their record as JSON." for i in range(100)]


@pytest.fixture(scope="module")
def demo_llm():
    from pagedserve import LLM

    return LLM("demo", max_num_seqs=16)


@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model="demo", max_num_seqs=16))
    with TestClient(build_app(engine, "demo")) as client:
        yield client


def _params(**kwargs) -> SamplingParams:
    so = {k: kwargs.pop(k) for k in ("json", "regex", "choice", "grammar") if k in kwargs}
    return SamplingParams(structured_outputs=StructuredOutputsParams(**so), **kwargs)


def test_demo_model_without_a_schema_rarely_writes_json(demo_llm):
    """The reference point: the constraint, not the model, makes the answers below valid."""
    outs = demo_llm.generate(
        PROMPTS[:20], SamplingParams(temperature=0.8, seed=0, max_tokens=120), use_tqdm=False
    )
    valid = 0
    for out in outs:
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid <= 2


def test_100_json_schema_answers_all_validate(demo_llm):
    params = _params(json=SCHEMA, temperature=0.8, seed=0, max_tokens=200)
    outs = demo_llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert len({o.outputs[0].text for o in outs}) > 1  # sampled, not one forced answer


def test_regex_and_choice_answers_all_match(demo_llm):
    outs = demo_llm.generate(
        PROMPTS[:30], _params(regex=PHONE, temperature=1.0, max_tokens=20), use_tqdm=False
    )
    assert all(re.fullmatch(PHONE, o.outputs[0].text) for o in outs)
    outs = demo_llm.generate(
        PROMPTS[:30], _params(choice=CHOICES, temperature=1.0, max_tokens=20), use_tqdm=False
    )
    assert all(o.outputs[0].text in CHOICES for o in outs)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_the_text_of_a_special_token_in_a_constraint_is_written_as_text(demo_llm):
    """The regex's literal ``<|assistant|>`` is met by ordinary tokens; the special token of that
    text is never offered, as the grammar would refuse it (and end the answer there)."""
    regex = r"a<\|assistant\|>b"
    constraint = StructuredOutputsParams(regex=regex)
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=constraint)
    (out,) = demo_llm.generate(["Hi"], params)
    o = out.outputs[0]
    assert (o.text, o.finish_reason) == ("a<|assistant|>b", "stop")
    assert demo_llm.llm_engine.tokenizer.token_to_id("<|assistant|>") not in o.token_ids


def test_ebnf_grammar_constrains_the_answer(demo_llm):
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    outs = demo_llm.generate(
        PROMPTS[:10], _params(grammar=grammar, temperature=1.0, max_tokens=10), use_tqdm=False
    )
    assert all(re.fullmatch(r"yes|no|maybe [0-9]", o.outputs[0].text) for o in outs)


def test_n_greater_than_one_gives_every_sequence_its_own_valid_answer(demo_llm):
    (out,) = demo_llm.generate(
        PROMPTS[:1], _params(json=SCHEMA, n=4, temperature=1.0, max_tokens=200), use_tqdm=False
    )
    assert len(out.outputs) == 4
    for choice in out.outputs:
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_a_constrained_answer_cut_by_max_tokens_says_length(demo_llm):
    (out,) = demo_llm.generate(
        PROMPTS[:1], _params(json=SCHEMA, temperature=0.0, max_tokens=5), use_tqdm=False
    )
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 5


@pytest.mark.parametrize(
    "constraint",
    [{"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, {"json_object": True}],
    ids=["json", "json_object"],
)
def test_json_whitespace_is_bounded(constraint):
    """At most one space between JSON tokens, in a schema's grammar as in any JSON object's: a run
    of spaces or newlines is not in the grammar."""
    from pagedserve.engine.structured_output.backend_guidance import grammar_for

    grammar = grammar_for(*StructuredOutputsParams(**constraint).key)
    for text, ok in [
        ('{"a": 1}', True),
        ('{ "a" : 1 }', True),
        ('{  "a": 1}', False),
        ('{"a":  1}', False),
        ('{\n\n"a": 1}', False),
        ('{"a": 1\n}', False),
    ]:
        assert _accepts(grammar, text) == ok, text
    # a schema's object takes no keys it does not list (strict_schema); any JSON object takes them
    assert _accepts(grammar, '{"a": 1, "b": 2}') == ("json_object" in constraint)


def test_an_object_that_lists_its_properties_takes_no_others_unless_its_schema_says_so():
    from pagedserve.engine.structured_output.backend_guidance import strict_schema

    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    strict = {**point, "additionalProperties": False}
    assert strict_schema(point) == strict and "additionalProperties" not in point
    # everywhere in the schema: under keywords, in lists of subschemas
    schema = {"anyOf": [point, {"type": "array", "items": point}], "$defs": {"p": point}}
    assert strict_schema(schema) == {
        "anyOf": [strict, {"type": "array", "items": strict}],
        "$defs": {"p": strict},
    }
    # a schema that says which other properties it takes, or lists none, is left as it is
    for opening in (
        {"additionalProperties": True},
        {"unevaluatedProperties": {"type": "string"}},
        {"patternProperties": {"^s_": {"type": "string"}}},
    ):
        assert strict_schema({**point, **opening}) == {**point, **opening}
    assert strict_schema({"type": "object"}) == {"type": "object"}


def _accepts(grammar: str, text: str) -> bool:
    import llguidance

    tok = text_tokenizer(_demo_tokenizer(), 4096, [4086])
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()


@pytest.mark.parametrize(
    "constraint, allowed, refused",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, '{"a": 1}',
         '{"a": 1, "b": 2}'),
        ({"json_object": True}, '{"b": [1]}', "[1]"),
        ({"regex": PHONE}, "555-1234", "555-12345"),
        ({"choice": CHOICES}, "New York", "York"),
        ({"grammar": 'start: "yes" | "no"'}, "no", "maybe"),  # Lark
        ({"grammar": 'root ::= "yes" | "no"'}, "yes", "yesno"),  # GBNF
    ],
    ids=["json", "json_object", "regex", "choice", "lark", "gbnf"],
)  # fmt: skip
def test_each_kind_of_constraint_becomes_a_grammar_of_exactly_what_it_allows(
    constraint, allowed, refused
):
    from pagedserve.engine.structured_output.backend_guidance import grammar_for

    grammar = grammar_for(*StructuredOutputsParams(**constraint).key)
    assert _accepts(grammar, allowed) and not _accepts(grammar, refused)


@pytest.mark.parametrize(
    "constraint",
    [
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"json_object": True},
        {"regex": PHONE},
        {"choice": CHOICES},
    ],
    ids=["json", "json_object", "regex", "choice"],
)
def test_a_constraint_that_compiles_passes_the_check(constraint):
    """Each kind is checked as what it is: a schema, a regex or a choice list is no grammar."""
    from pagedserve.engine.structured_output.backend_guidance import check_structured_outputs

    assert check_structured_outputs(StructuredOutputsParams(**constraint)) is None


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"json": {"not": {"type": "integer"}}}, "the JSON schema cannot be used for decoding: "),
        ({"regex": "[0-9"}, "the regex cannot be used for decoding: "),
        # a lone surrogate (a JSON body's \ud800 escape parses to one) has no UTF-8 form
        ({"choice": ["ok", "\ud800"]}, "the choice list cannot be used for decoding: "),
        ({"grammar": "start: undefined_rule"}, "the grammar cannot be used for decoding: "),
    ],
    ids=["json", "regex", "choice", "grammar"],
)
def test_a_constraint_that_cannot_compile_is_refused_naming_its_kind(constraint, message):
    from pagedserve.engine.structured_output.backend_guidance import check_structured_outputs

    params = StructuredOutputsParams(**constraint)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_structured_outputs(params)
    with pytest.raises(ValueError, match=re.escape(message)):  # the same, from the cache
        check_structured_outputs(params)


def _demo_tokenizer() -> str:
    from pagedserve.models import DEMO_MODEL_DIR

    return str(DEMO_MODEL_DIR / "tokenizer.json")


def test_the_grammar_vocabulary_keeps_special_tokens_out_of_text():
    """llguidance's view of the demo vocabulary, padded past the tokenizer as a model's may be:
    text never becomes a special token; a free grammar offers every text token, the end tokens
    and no other special token or padding; a grammar that names a special token gets it."""
    import llguidance

    eos = [4086, 4095]
    tok = text_tokenizer(_demo_tokenizer(), 4200, eos)
    assert (tok.vocab_size, tok.eos_tokens) == (4200, eos)
    assert 4093 not in tok.tokenize_str("<|user|>hi")
    assert tok.decode_bytes(tok.tokenize_str("<|user|>hi")) == b"<|user|>hi"

    loaded = llguidance.LLTokenizer(_demo_tokenizer(), n_vocab=4200, eos_token=eos)
    text_tokens = {t for t in _offered(loaded, FREE) if t < 4086}  # llguidance's own loader's
    assert len(text_tokens) > 3000
    assert _offered(tok, FREE) == text_tokens | set(eos)
    assert _offered(tok, "start: <|user|>") == {4093}


FREE = "%llguidance {}\nstart: /(?s:.*)/"  # any text


def _offered(vocabulary, grammar: str) -> set[int]:
    """The tokens ``grammar`` allows first."""
    import llguidance
    import numpy as np

    row = np.zeros((vocabulary.vocab_size + 31) // 32, dtype=np.int32)
    matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return set(np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist())


def test_the_grammar_vocabulary_tokenizes_text_without_the_prompts_prefix(tmp_path):
    """A tokenizer.json whose post-processor puts ``[gMASK]<sop>`` before a prompt (as GLM-4's
    do): text a grammar forces gets no prefix, and padding past the tokenizer has no text."""
    import llguidance

    from tests.helpers.models import build_tiny_tokenizer

    path = build_tiny_tokenizer(tmp_path, prefix_in_post_processor=True) / "tokenizer.json"
    hf = tokenizers.Tokenizer.from_file(str(path))
    specials = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    assert specials & set(hf.encode("hi").ids)  # the prefix a prompt gets
    eos = [hf.token_to_id("<|endoftext|>")]
    tok = text_tokenizer(path, 320, eos)
    ids = tok.tokenize_str("hi<|user|>")
    assert not specials & set(ids) and tok.decode_bytes(ids) == b"hi<|user|>"
    assert tok.vocab_size == 320
    loaded = llguidance.LLTokenizer(str(path), n_vocab=320, eos_token=eos)
    text_tokens = {t for t in _offered(loaded, FREE) if t < 300} - specials
    assert _offered(tok, FREE) == text_tokens | set(eos)


def test_bad_constraints_are_rejected_offline_with_the_reason(demo_llm):
    (out,) = demo_llm.generate(["x"], _params(json={"not": {"type": "integer"}}), use_tqdm=False)
    assert out.outputs[0].finish_reason == "rejected"
    assert '"not"' in out.error


def test_preempted_constrained_requests_rebuild_their_grammar_state(caplog):
    """A KV pool too small for all of them: requests are preempted mid-answer, recompute, and
    their matchers are rebuilt from their output tokens; every replay is accepted and every
    answer still validates."""
    from pagedserve import LLM

    small = LLM("demo", num_kv_pages=24, block_size=16, max_num_seqs=8)
    prompts = [p * 3 for p in PROMPTS[:8]]
    outs = small.generate(
        prompts, _params(json=SCHEMA, temperature=0.8, seed=1, max_tokens=200), use_tqdm=False
    )
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert REPLAY_FAILED not in caplog.text
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


REPLAY_FAILED = "replaying a constrained sequence failed"


def test_replayed_matcher_allows_the_same_tokens_as_the_live_one():
    from pagedserve.engine.request import Request
    from pagedserve.engine.structured_output.manager import StructuredOutputManager
    from pagedserve.models import Tokenizer

    tok = Tokenizer(DEMO_DIR())
    manager = StructuredOutputManager(DEMO_DIR() / "tokenizer.json", 4096, tok.eos_token_ids)
    so = StructuredOutputsParams(json=SCHEMA)
    answer = tok.encode('{"name": "Ada", "age": 36, "role": "user", "tags": []', False)
    live = Request("a", [1], SamplingParams(), structured_output=manager.request(so))
    live.structured_output.grammar.result(timeout=30)
    for t in answer:
        live.append_output_token(t)
        assert not manager.accept_token(live, t)
    replayed = Request("b", [1], SamplingParams(), structured_output=manager.request(so))
    replayed.output_token_ids = list(answer)
    assert (manager.grammar_bitmask([live]) == manager.grammar_bitmask([replayed])).all()
    manager.shutdown()


def test_a_replay_the_grammar_refuses_is_logged(caplog):
    from pagedserve.engine.structured_output.manager import StructuredOutputManager
    from pagedserve.models import Tokenizer

    tok = Tokenizer(DEMO_DIR())
    manager = StructuredOutputManager(DEMO_DIR() / "tokenizer.json", 4096, tok.eos_token_ids)
    so = manager.request(StructuredOutputsParams(json=SCHEMA))
    so.grammar.result(timeout=30)
    so.matcher_for(tok.encode("hello", False))  # not JSON: the matcher stops at the first token
    manager.shutdown()
    assert REPLAY_FAILED in caplog.text


def DEMO_DIR():
    from pagedserve.models import DEMO_MODEL_DIR

    return DEMO_MODEL_DIR


def test_other_requests_keep_stepping_while_a_grammar_compiles(demo_llm, monkeypatch):
    """A slow compile holds back only its own request."""
    import threading

    from pagedserve.engine.structured_output import manager as structured

    engine = demo_llm.llm_engine
    release = threading.Event()
    original = structured.StructuredOutputManager._compile

    def slow_compile(self, params):
        release.wait(30)
        return original(self, params)

    monkeypatch.setattr(structured.StructuredOutputManager, "_compile", slow_compile)
    engine.add_request("slow", [5, 6, 7], _params(regex="slow[0-9]{5}", max_tokens=8))
    engine.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    finished = set()
    while "plain" not in finished:
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert "slow" not in finished and engine.scheduler.waiting[0].request_id == "slow"
    release.set()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                assert o.outputs[0].text.startswith("slow")


# ---- the HTTP API -----------------------------------------------------------------------------
def test_chat_response_format_json_schema_validates(http):
    body = {
        "messages": [{"role": "user", "content": "Describe a user as JSON."}],
        "max_tokens": 200,
        "temperature": 0.7,
        "n": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_completions_json_object_and_vllm_fields(http):
    r = http.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 60, "n": 4, "response_format": {"type": "json_object"}},
    )
    for choice in r.json()["choices"]:  # any object: the model may not close a long string
        assert choice["text"].startswith("{")
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["text"]), dict)
    r = http.post(
        "/v1/completions", json={"prompt": "Call", "max_tokens": 20, "guided_regex": PHONE}
    )
    assert re.fullmatch(PHONE, r.json()["choices"][0]["text"])
    r = http.post(
        "/v1/completions",
        json={"prompt": "City", "max_tokens": 20, "structured_outputs": {"choice": CHOICES}},
    )
    assert r.json()["choices"][0]["text"] in CHOICES
    r = http.post(
        "/v1/completions",
        json={
            "prompt": "City",
            "max_tokens": 200,
            "guided_json": json.dumps(SCHEMA),
            "temperature": 0.5,
        },
    )
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


def test_streamed_constrained_answer_with_logprobs_and_stop_string(http):
    body = {
        "prompt": "Call",
        "max_tokens": 20,
        "guided_regex": PHONE,
        "stream": True,
        "logprobs": 2,
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert re.fullmatch(PHONE, text)
    for c in chunks:  # the masked-out tokens have no probability: logprobs are of allowed tokens
        for lp in c["choices"][0]["logprobs"]["top_logprobs"]:
            allowed = [t for t, v in lp.items() if v is not None and v > -1e30]
            assert allowed and all(re.fullmatch(r"[0-9-]+", t) for t in allowed)
    r = http.post("/v1/completions", json={**body, "stream": False, "stop": ["-"]})
    assert re.fullmatch(r"\d{3}", r.json()["choices"][0]["text"])


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
        ({"guided_json": {"type": "object", "not": {}}}, "guided_json", '"not"'),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}},
                }
            },
            "response_format",
            "minimum",
        ),
        ({"guided_grammar": "root ::= foo"}, "guided_grammar", "foo"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one constraint"),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(http, fields, param, words):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]
