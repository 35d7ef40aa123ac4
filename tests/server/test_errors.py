"""OpenAI's error shape and the mapping of every bad input to it (errors.py), without a model: a
pydantic error becomes a 400 whose ``param`` names the field and whose message says what the
value must be; FastAPI's own errors (404, 405, 422) and an unexpected exception answer in the
same shape, with OpenAI's ``type`` for the status."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from pagedserve.server.errors import (
    APIError,
    bad_request,
    error_body,
    error_response,
    install_error_handlers,
    validation_error,
)
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "hi"}]


def completion_error(**fields) -> APIError:
    """The server's 400 for a completions body with ``fields``."""
    with pytest.raises(ValidationError) as e:
        CompletionRequest(**{"prompt": "hi", **fields})
    return validation_error(e.value.errors())


# ---- the shape ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "status, etype",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "invalid_request_error"),
        (405, "invalid_request_error"),
        (413, "invalid_request_error"),
        (429, "invalid_request_error"),
        (499, "invalid_request_error"),
        (500, "server_error"),
        (503, "server_error"),
        (504, "server_error"),
    ],
)
def test_the_error_type_follows_the_status(status, etype):
    assert error_body(status, "m") == {
        "error": {"message": "m", "type": etype, "param": None, "code": None}
    }


def test_an_error_body_carries_message_param_and_code():
    assert error_body(400, "n is too big", "n", "too_big") == {
        "error": {
            "message": "n is too big",
            "type": "invalid_request_error",
            "param": "n",
            "code": "too_big",
        }
    }


def test_bad_request_is_a_400_with_its_param_and_code():
    e = bad_request("no", "field", "a_code")
    assert (e.status, e.message, e.param, e.code, e.headers) == (400, "no", "field", "a_code", None)
    assert str(e) == "no"


def test_an_error_response_has_the_status_body_and_headers_of_the_error():
    r = error_response(APIError(503, "full", code="busy", headers={"Retry-After": "1"}))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.body == (
        b'{"error":{"message":"full","type":"server_error","param":null,"code":"busy"}}'
    )


# ---- pydantic's errors -> a 400 naming the field ------------------------------------------------
def test_a_range_error_names_the_field_its_value_and_the_limit():
    e = completion_error(temperature=-0.5)
    assert (e.status, e.param, e.message) == (400, "temperature", "temperature=-0.5 must be >= 0")


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"top_p": 0.0}, "top_p", "top_p=0.0 must be > 0"),
        ({"top_p": 1.5}, "top_p", "top_p=1.5 must be <= 1"),
        ({"n": 0}, "n", "n=0 must be >= 1"),
        ({"n": 2**31}, "n", "n=2147483648 must be <= 2147483647"),
    ],
)
def test_each_range_rule_says_what_the_value_must_be(fields, param, message):
    e = completion_error(**fields)
    assert (e.status, e.param, e.message) == (400, param, message)


def test_a_list_too_long_says_how_many_items_it_may_have():
    e = completion_error(stop=["a"] * 65)
    assert (e.status, e.param) == (400, "stop")
    assert e.message.startswith("stop=['a', 'a'") and e.message.endswith(
        "... (325 characters) must have at most 64 items"
    )


def test_less_than_and_finite_number_rules():
    errors = [{"type": "less_than", "loc": ("body", "x"), "input": 9, "ctx": {"lt": 9.0}}]
    assert validation_error(errors).message == "x=9 must be < 9"
    errors = [{"type": "finite_number", "loc": ("body", "x"), "input": float("nan")}]
    assert validation_error(errors).message == "x=nan must be a finite number"


def test_of_a_union_fields_errors_the_range_error_is_the_one_reported():
    e = completion_error(prompt=[1, -1])  # also "not a string", "not a list of lists"
    assert (e.param, e.message) == ("prompt.1", "prompt.1=-1 must be >= 0")


def test_the_path_drops_the_body_and_the_union_tags():
    errors = [
        {
            "type": "greater_than_equal",
            "loc": ("body", "prompt", "list[list[constrained-int]]", 2, 0),
            "input": -3,
            "ctx": {"ge": 0},
        }
    ]
    assert validation_error(errors).param == "prompt.2.0"
    for tag in ("str", "int", "float", "bool", "none", "constrained-str", "ToolCall", "dict[str]"):
        errors = [{"type": "string_type", "loc": ("body", "x", tag), "msg": "bad", "input": 1}]
        assert validation_error(errors).param == "x", tag


def test_a_field_named_like_a_word_is_kept_in_the_path():
    errors = [{"type": "missing", "loc": ("body", "messages", 0, "role"), "msg": "Field required"}]
    e = validation_error(errors)
    assert (e.param, e.message) == (
        "messages.0.role",
        "field 'messages.0.role': Field required (got None)",
    )


def test_an_error_without_a_rule_quotes_pydantics_words_and_the_value():
    e = completion_error(response_format={"type": "xml"})
    assert (e.status, e.param) == (400, "response_format.type")
    assert e.message == (
        "field 'response_format.type': Input should be 'text', 'json_object' or 'json_schema' "
        "(got 'xml')"
    )


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [  # OpenAI's API takes values strictly, and so do we
        ("temperature", "0.5", "must be a number (a JSON number, not a string)"),
        ("top_k", 0.5, "must be an integer (a JSON number without a fractional part)"),
        ("max_tokens", 2.0, "must be an integer (a JSON number without a fractional part)"),
        ("n", True, "must be an integer (a JSON number without a fractional part)"),
        ("echo", "true", "must be true or false"),
    ],
)
def test_a_value_of_the_wrong_json_type_is_refused_naming_the_field(field, value, rule):
    e = completion_error(**{field: value})
    assert (e.status, e.param, e.message) == (400, field, f"{field}={value!r} {rule}")


def test_unknown_fields_are_ignored_and_logged_as_vllm_does(caplog):
    """OpenAI's API refuses them; vLLM's server serves the request and logs what it ignored,
    which keeps working the clients that send vLLM extras this server does not implement."""
    with caplog.at_level(logging.WARNING, logger="pagedserve.server.protocol"):
        request = ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi", "name": "x", "extra": 1}],
            max_token=5,
            use_beam_search=False,
            stream_options={"include_usage": True, "chunk_size": 3},
        )
    assert request.max_tokens is None
    assert [r.getMessage() for r in caplog.records] == [
        "StreamOptions: these fields were in the request but are not used: 'chunk_size'",
        "ChatCompletionRequest: these fields were in the request but are not used: "
        "'max_token', 'use_beam_search'",
    ]  # a message's extra keys are the chat template's to read: not logged
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.server.protocol"):
        CompletionRequest(prompt="hi", **{f"x{i}\nFAKE LOG LINE": i for i in range(12)})
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and line.endswith(
        "'x7\\nFAKE LOG LINE' and 2 more"
    )  # sorted: x0, x1, x10, ..., x7


def test_an_error_of_the_whole_body_says_so():
    errors = [
        {"type": "model_type", "loc": ("body",), "msg": "Input should be an object", "input": 5}
    ]
    e = validation_error(errors)
    assert (e.status, e.param) == (400, None)
    assert e.message == "the request body: Input should be an object (got 5)"


def test_a_range_error_of_the_whole_body_has_no_rule_message():
    errors = [{"type": "too_long", "loc": ("body",), "msg": "too long", "input": [], "ctx": {}}]
    assert validation_error(errors).message == "the request body: too long (got [])"


def test_a_long_bad_value_is_cut_and_its_length_given():
    value = "x" * 200
    e = completion_error(response_format=value)
    shown = repr(value)[:80]
    assert e.message.endswith(f"(got {shown}... (202 characters))")
    exactly = "y" * 78  # repr adds the quotes: 80 characters, shown whole
    e = completion_error(response_format=exactly)
    assert e.message.endswith(f"(got {exactly!r})")


def test_limits_are_written_as_numbers_not_floats():
    errors = [
        {"type": "greater_than_equal", "loc": ("x",), "input": -1, "ctx": {"ge": 0.0}},
    ]
    assert validation_error(errors).message == "x=-1 must be >= 0"
    errors = [
        {"type": "less_than_equal", "loc": ("x",), "input": 3, "ctx": {"le": 2147483647}},
    ]
    assert validation_error(errors).message == "x=3 must be <= 2147483647"
    errors = [{"type": "less_than_equal", "loc": ("x",), "input": 3, "ctx": {"le": 2.5}}]
    assert validation_error(errors).message == "x=3 must be <= 2.5"


def test_json_that_does_not_parse_is_a_400_saying_so():
    errors = [{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error"}]
    e = validation_error(errors)
    assert (e.status, e.param, e.message) == (
        400,
        None,
        "the request body is not valid JSON: JSON decode error",
    )


def test_an_error_without_a_location_is_of_the_whole_body():
    e = validation_error([{"type": "missing", "msg": "Field required", "input": {}}])
    assert (e.param, e.message) == (None, "the request body: Field required (got {})")


def test_no_errors_is_still_a_400():
    e = validation_error([])
    assert (e.status, e.message, e.param) == (400, "invalid request", None)


def test_chat_errors_name_the_message_field():
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(messages=CHAT, top_logprobs=-1)
    assert validation_error(e.value.errors()).param == "top_logprobs"


# ---- the handlers ------------------------------------------------------------------------------
class Body(BaseModel):
    n: int


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/api")
    async def api(body: Body):
        if body.n == 1:
            raise APIError(429, "slow down", "n", "rate", headers={"Retry-After": "3"})
        if body.n == 2:
            raise RuntimeError("boom")
        if body.n == 3:
            raise HTTPException(418, detail={"not": "a string"})
        if body.n == 4:
            raise HTTPException(409, detail="already there", headers={"X-Why": "dup"})
        return {"n": body.n}

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_an_api_error_answers_its_status_shape_and_headers(client):
    r = client.post("/api", json={"n": 1})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json() == {
        "error": {
            "message": "slow down",
            "type": "invalid_request_error",
            "param": "n",
            "code": "rate",
        }
    }


def test_a_body_fastapi_refuses_is_a_400_not_a_422(client):
    r = client.post("/api", json={"n": "many"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "n" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("field 'n': Input should be a valid integer")


def test_an_unknown_route_is_a_404_in_openais_shape(client):
    r = client.get("/nowhere")
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "Not Found",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


def test_a_wrong_method_is_a_405_that_names_the_allowed_one(client):
    r = client.get("/api")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == "Method Not Allowed"


def test_an_http_error_keeps_its_text_and_headers_or_says_its_status_phrase(client):
    r = client.post("/api", json={"n": 4})
    assert r.status_code == 409 and r.headers["x-why"] == "dup"
    assert r.json()["error"]["message"] == "already there"
    r = client.post("/api", json={"n": 3})
    assert r.status_code == 418 and r.json()["error"]["message"] == "I'm a Teapot"


def test_an_unexpected_exception_is_a_500_naming_only_its_type(client):
    r = client.post("/api", json={"n": 2})
    assert r.status_code == 500
    assert r.json() == {
        "error": {
            "message": "internal server error: RuntimeError",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
