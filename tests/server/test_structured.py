"""The request fields that constrain the output (structured.py), without a model: which field a
constraint came from, and the 400s for a bad or doubled constraint, before anything is queued.
(test_server_sampling.py checks that each good constraint becomes its StructuredOutputsParams.)"""

from __future__ import annotations

import pytest

from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import CompletionRequest
from pagedserve.server.structured import (
    MAX_SCHEMA_DEPTH,
    attach_structured_outputs,
    build,
    check_depth,
    openai_structured_outputs,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def body(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **fields)


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        openai_structured_outputs(body(**fields))
    assert e.value.status == 400
    return e.value


def nested(levels: int) -> dict:
    """A schema whose values nest ``levels`` deep, counting the schema itself as 1."""
    schema: dict = {"type": "string"}  # a dict holding a string: 2 levels
    for _ in range(levels - 2):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "fields, name, params",
    [
        (
            {"response_format": {"type": "json_object"}},
            "response_format",
            StructuredOutputsParams(json_object=True),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format",
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"guided_json": SCHEMA}, "guided_json", StructuredOutputsParams(json=SCHEMA)),
        ({"guided_regex": "a+"}, "guided_regex", StructuredOutputsParams(regex="a+")),
        (
            {"guided_choice": ["x", "y"]},
            "guided_choice",
            StructuredOutputsParams(choice=["x", "y"]),
        ),
        (
            {"guided_grammar": 'root ::= "x"'},
            "guided_grammar",
            StructuredOutputsParams(grammar='root ::= "x"'),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            "structured_outputs",
            StructuredOutputsParams(json=SCHEMA),
        ),
        (
            {"structured_outputs": {"choice": ["x"]}},
            "structured_outputs",
            StructuredOutputsParams(choice=["x"]),
        ),
    ],
)
def test_each_constraint_is_found_with_the_field_it_came_from(fields, name, params):
    assert openai_structured_outputs(body(**fields)) == (name, params)


def test_no_constraint_and_plain_text_response_format_are_none():
    assert openai_structured_outputs(body()) is None
    assert openai_structured_outputs(body(response_format={"type": "text"})) is None


def test_a_schema_sent_as_a_json_string_is_parsed():
    found = openai_structured_outputs(body(guided_json='{"type": "object"}'))
    assert found == ("guided_json", StructuredOutputsParams(json={"type": "object"}))


@pytest.mark.parametrize("json_schema", [None, {"name": "s"}])
def test_json_schema_response_format_without_a_schema_is_a_400(json_schema):
    e = refused(response_format={"type": "json_schema", "json_schema": json_schema})
    assert e.param == "response_format"
    assert e.message == (
        "response_format of type json_schema needs json_schema.schema (the JSON schema the "
        "answer must follow)"
    )


def test_two_constraints_are_a_400_naming_the_second():
    e = refused(response_format={"type": "json_object"}, guided_regex="a+")
    assert e.param == "guided_regex"
    assert e.message == "send one constraint on the output; got response_format and guided_regex"
    e = refused(
        guided_choice=["a"], guided_grammar='root ::= "x"', structured_outputs={"regex": "b"}
    )
    assert e.param == "guided_grammar"
    assert e.message == (
        "send one constraint on the output; got guided_choice and guided_grammar and "
        "structured_outputs"
    )


def test_two_constraints_inside_structured_outputs_are_a_400():
    e = refused(structured_outputs={"regex": "a", "choice": ["b"]})
    assert (e.param, e.code) == ("structured_outputs", "invalid_structured_output")
    assert e.message.startswith("structured outputs take exactly one of")


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "the JSON schema is not valid JSON: "),
        ("[1, 2]", "the JSON schema must be a JSON object"),
    ],
)
def test_a_schema_string_that_is_not_a_json_object_is_a_400(text, message):
    e = refused(guided_json=text)
    assert (e.param, e.code) == ("guided_json", "invalid_structured_output")
    assert e.message.startswith(message)


def test_a_constraint_the_decoder_cannot_use_is_a_400_naming_its_field():
    e = refused(guided_regex="(unclosed")
    assert (e.param, e.code) == ("guided_regex", "invalid_structured_output")
    assert e.message.startswith("the regex cannot be used for decoding")


def test_build_names_the_param_it_is_given():
    with pytest.raises(APIError) as e:
        build({"grammar": "start: nothing_defined"}, "tool_choice")
    assert (e.value.status, e.value.param, e.value.code) == (
        400,
        "tool_choice",
        "invalid_structured_output",
    )
    assert build({"regex": "a"}, "x") == StructuredOutputsParams(regex="a")


def test_a_schema_nested_to_the_limit_is_used_and_one_level_more_is_a_400():
    assert MAX_SCHEMA_DEPTH == 64
    check_depth(nested(MAX_SCHEMA_DEPTH))
    with pytest.raises(ValueError, match="^the JSON schema nests deeper than 64 levels$"):
        check_depth(nested(MAX_SCHEMA_DEPTH + 1))
    e = refused(guided_json=nested(MAX_SCHEMA_DEPTH + 1))
    assert (e.param, e.message) == ("guided_json", "the JSON schema nests deeper than 64 levels")


def test_depth_counts_lists_as_levels_too():
    value: list | str = "leaf"
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        value = [value]
    check_depth(value)
    with pytest.raises(ValueError):
        check_depth([value])


def test_depth_is_that_of_the_deepest_branch():
    deep = nested(MAX_SCHEMA_DEPTH - 1)
    check_depth({"shallow": 1, "deep": deep})
    with pytest.raises(ValueError):
        check_depth({"shallow": 1, "deep": {"x": deep}})


# ---- attaching ----------------------------------------------------------------------------------
def test_the_constraint_is_attached_to_the_sampling_params():
    params = SamplingParams()
    attach_structured_outputs(params, body(guided_regex="a+"), tokenizer=object())
    assert params.structured_outputs == StructuredOutputsParams(regex="a+")


def test_no_constraint_leaves_the_params_alone_even_without_a_tokenizer():
    params = SamplingParams()
    attach_structured_outputs(params, body(), tokenizer=None)
    assert params.structured_outputs is None


def test_a_constraint_without_a_tokenizer_is_a_400_naming_its_field():
    params = SamplingParams()
    with pytest.raises(APIError) as e:
        attach_structured_outputs(params, body(guided_choice=["a"]), tokenizer=None)
    assert (e.value.status, e.value.param) == (400, "guided_choice")
    assert e.value.message == "structured outputs need the model's tokenizer.json"
    assert params.structured_outputs is None
