"""The server's request -> SamplingParams mapping on its own, without a server: the same cases as
test_server_fields.py checks over HTTP, fast enough for mutation testing (tools/mutation.py)."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError, validation_error
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.sampling import chat_sampling_params, completion_sampling_params
from pagedserve.server.structured import attach_structured_outputs
from tests.server.test_server_fields import (
    BAD_FIELDS,
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    SHARED_FIELDS,
    STRUCTURED_FIELDS,
)

MAX_NUM_SEQS, VOCAB = 16, 320  # the live server's limits in conftest.py
HAS_TOKENIZER = object()  # attach_structured_outputs only asks whether the server has one


def params_for(endpoint: str, fields: dict) -> SamplingParams:
    """As the server maps a request: the schema's checks (a ValidationError becomes the server's
    400), then the server's."""
    try:
        if endpoint == "completions":
            body = CompletionRequest(prompt=[1, 2], **fields)
            params = completion_sampling_params(body, MAX_NUM_SEQS, VOCAB)
        else:
            body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
            params = chat_sampling_params(body, MAX_NUM_SEQS, VOCAB)
    except ValidationError as e:
        raise validation_error(e.errors()) from e
    attach_structured_outputs(params, body, tokenizer=object())  # any tokenizer: none is read
    return params


def cases():
    for endpoint, own in (("completions", COMPLETION_FIELDS), ("chat", CHAT_FIELDS)):
        for fields, expected in SHARED_FIELDS + own:
            yield pytest.param(endpoint, fields, expected, id=f"{endpoint}-{'-'.join(fields)}")


@pytest.mark.parametrize("endpoint, fields, expected", list(cases()))
def test_each_field_becomes_its_sampling_param(endpoint, fields, expected):
    params = params_for(endpoint, {"max_tokens": 4, **fields})
    for name, value in expected.items():
        assert getattr(params, name) == value, name


@pytest.mark.parametrize("fields, expected", STRUCTURED_FIELDS)
def test_each_constraint_becomes_its_structured_outputs(fields, expected):
    body = CompletionRequest(prompt=[1, 2], **fields)
    params = completion_sampling_params(body, MAX_NUM_SEQS, VOCAB)
    assert params.structured_outputs is None  # the sampling mapping leaves constraints alone
    attach_structured_outputs(params, body, tokenizer=HAS_TOKENIZER)
    assert params.structured_outputs == expected["structured_outputs"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_no_fields_give_vllms_defaults(endpoint):
    max_tokens = 16 if endpoint == "completions" else None
    params = params_for(endpoint, {})
    assert dataclasses.asdict(params) == dataclasses.asdict(SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize(
    "endpoint, fields, param, message", [c for c in BAD_FIELDS if c[3] is not None]
)
def test_bad_values_raise_a_400_naming_the_field(endpoint, fields, param, message):
    with pytest.raises(APIError) as e:
        params_for(endpoint, fields)
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)


def test_logit_bias_is_clipped_and_its_keys_become_ints():
    params = params_for("completions", {"logit_bias": {"3": 250, "4": -1e9, "5": 0.5}})
    assert params.logit_bias == {3: 100.0, 4: -100.0, 5: 0.5}


@pytest.mark.parametrize("key", ["-5", "--5", "5-", " 5", "X5", "\u0663", "1.0", "320", ""])
def test_logit_bias_keys_must_be_token_ids_in_decimal(key):
    with pytest.raises(APIError) as e:
        params_for("completions", {"logit_bias": {key: 1.0}})
    assert e.value.status == 400 and e.value.param == "logit_bias"
    assert e.value.message == f"logit_bias key {key!r} is not a token id in [0, {VOCAB})"


def test_the_edges_of_each_range_are_accepted():
    assert params_for("completions", {"logit_bias": {"0": 1, "319": 2}}).logit_bias == {
        0: 1.0,
        319: 2.0,
    }
    assert params_for("completions", {"n": MAX_NUM_SEQS}).n == MAX_NUM_SEQS
    for n in (0, 20):
        assert params_for("completions", {"logprobs": n}).logprobs == n
        assert params_for("chat", {"logprobs": True, "top_logprobs": n}).logprobs == n
    assert params_for("chat", {"max_completion_tokens": 1}).max_tokens == 1
