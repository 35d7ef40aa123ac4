"""A request's ``tools`` and ``tool_choice`` (tools.py) without a model: what each choice asks
of the output, the 400s that name the field before anything is queued (OpenAI's rules for a
function's name and schema, a choice that needs tools or a server flag), and OpenAI's
``finish_reason`` for an answer that calls tools. test_tool_grammar.py runs the grammars."""

from __future__ import annotations

import pytest

from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionNamedToolChoiceParam, ChatCompletionToolsParam
from pagedserve.server.tools import ToolRequest, attach_tool_grammar, finish_reason, tool_request


def tool(name: str, parameters: dict | None = None, strict: bool | None = None) -> dict:
    function = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


WEATHER = tool(
    "get_weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CLOCK = tool("get_time", {"type": "object", "properties": {}})
UNUSUAL = {"type": "object", "not": {"required": ["x"]}}  # valid JSON Schema no grammar holds


def tools(*specs) -> list[ChatCompletionToolsParam]:
    return [ChatCompletionToolsParam(**t) for t in specs]


def named(name: str) -> ChatCompletionNamedToolChoiceParam:
    return ChatCompletionNamedToolChoiceParam(function={"name": name})


def refused(*args) -> APIError:
    with pytest.raises(APIError) as e:
        tool_request(*args)
    assert e.value.status == 400
    return e.value


# ---- what each choice asks for --------------------------------------------------------------------
def test_no_tools_and_no_choice_or_none_is_no_tool_request():
    assert tool_request(None, None, True, False) is None
    assert tool_request(None, "none", True, True) is None


def test_each_choice_and_the_tools_a_grammar_holds_to_their_schema():
    ts = tools(WEATHER, tool("log", strict=True), CLOCK)
    none = tool_request(ts, "none", True, False)
    assert (none.choice, none.named, none.forced, none.enforced()) == ("none", None, False, [])
    required = tool_request(ts, "required", True, False)
    assert (required.choice, required.forced, required.enforced()) == ("required", True, ts)
    auto = tool_request(ts, "auto", True, True)
    assert (auto.choice, auto.forced, auto.enforced()) == ("auto", False, [ts[1]])
    one = tool_request(ts, named("get_time"), True, False)
    assert (one.choice, one.named, one.forced, one.enforced()) == (
        "named",
        "get_time",
        True,
        [ts[2]],
    )


def test_no_choice_with_tools_is_auto():
    request = tool_request(tools(WEATHER), None, True, True)
    assert (request.choice, request.named) == ("auto", None)


@pytest.mark.parametrize("parallel, expected", [(True, True), (None, True), (False, False)])
def test_parallel_tool_calls_is_on_unless_turned_off(parallel, expected):
    assert tool_request(tools(WEATHER), "required", parallel, False).parallel is expected


def test_a_tool_request_is_parallel_by_default():
    assert ToolRequest(tools(WEATHER), "required").parallel is True


# ---- the 400s ---------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", "auto", named("f")])
def test_a_tool_choice_without_tools_is_a_400(choice):
    e = refused(None, choice, True, True)
    assert e.param == "tool_choice"
    assert e.message == (
        "tool_choice needs tools: send the functions the model may call in 'tools', or leave "
        "tool_choice out"
    )


def test_empty_tools_are_a_400():
    e = refused([], "none", True, True)
    assert (e.param, e.message) == (
        "tools",
        "tools is empty: send at least one function, or leave tools out",
    )


@pytest.mark.parametrize("name", ["get time", "", "a" * 65, "get.time", "héllo"])
def test_a_function_name_outside_openais_rule_is_a_400_naming_it(name):
    e = refused(tools(WEATHER, tool(name)), "none", True, False)
    assert e.param == "tools.1.function.name"
    assert e.message == (
        f"function name {name!r} must be 1 to 64 letters, digits, underscores or dashes"
    )


def test_a_name_of_64_letters_digits_underscores_and_dashes_is_a_function_name():
    name = ("aZ0_-" * 13)[:64]
    assert tool_request(tools(tool(name)), "none", True, False).tools[0].function.name == name


def test_two_tools_of_one_name_are_a_400():
    e = refused(tools(WEATHER, CLOCK, WEATHER), "none", True, False)
    assert (e.param, e.message) == (
        "tools",
        "two tools are named 'get_weather'; give each a name of its own",
    )


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_without_the_servers_flag_is_a_400_saying_how_to_get_it(choice):
    e = refused(tools(WEATHER), choice, True, False)
    assert e.param == "tool_choice"
    assert e.message == (
        "tool_choice 'auto' (the default when tools are sent) needs a server started with "
        "--enable-auto-tool-choice and --tool-call-parser NAME; send tool_choice 'required', a "
        "named function or 'none', or restart the server with those flags"
    )


def test_a_named_function_not_among_the_tools_is_a_400_listing_them():
    e = refused(tools(WEATHER, CLOCK), named("get_stock"), True, True)
    assert e.param == "tool_choice"
    assert e.message == (
        "tool_choice names the function 'get_stock', which is not among the tools "
        "(get_weather, get_time)"
    )


@pytest.mark.parametrize("kind", ["array", "string", ["array", "null"]])
def test_parameters_whose_type_is_not_object_are_a_400(kind):
    e = refused(tools(CLOCK, tool("f", {"type": kind})), "none", True, False)
    assert (e.param, e.code) == ("tools.1.function.parameters", "invalid_tool_schema")
    assert e.message == (
        f"the parameters of function 'f' have type {kind!r}: a call's arguments are a JSON "
        f"object, so its schema's type must be 'object'"
    )


def test_parameters_may_be_absent_typeless_or_object_among_other_types():
    for parameters in (None, {}, {"type": ["object", "null"]}, {"properties": {}}):
        assert tool_request(tools(tool("f", parameters)), "required", True, False) is not None


def test_a_schema_llguidance_refuses_is_a_400_naming_the_function():
    e = refused(tools(WEATHER, tool("f", {"type": "object", "properties": 5})), "none", True, True)
    assert (e.param, e.code) == ("tools.1.function.parameters", "invalid_tool_schema")
    assert e.message.startswith("the parameters of function 'f' are not a usable JSON schema: ")


def test_a_schema_nested_too_deep_is_a_400():
    schema: dict = {"type": "string"}
    for _ in range(70):
        schema = {"type": "object", "properties": {"x": schema}}
    e = refused(tools(tool("f", schema)), "none", True, True)
    assert e.param == "tools.0.function.parameters"
    assert e.message.endswith("nests deeper than 64 levels")


def test_a_schema_no_grammar_can_hold_is_refused_only_where_a_grammar_must_hold_it():
    ts = tools(tool("f", UNUSUAL), CLOCK)
    for choice in ("none", named("get_time")):
        assert tool_request(ts, choice, True, True) is not None
    assert tool_request(ts, "auto", True, True) is not None  # f is not strict
    for choice in ("required", named("f")):
        e = refused(ts, choice, True, True)
        assert e.param == "tools.0.function.parameters" and e.code == "invalid_tool_schema"
        assert "Unimplemented keys" in e.message
    strict = tools(tool("f", UNUSUAL, strict=True))
    assert refused(strict, "auto", True, True).param == "tools.0.function.parameters"


# ---- the constraint ---------------------------------------------------------------------------
class FakeParser:
    """Records what the grammar was asked for."""

    def __init__(self):
        self.asked = []

    def grammar(self, tools, parallel, enforced=None):
        self.asked.append(([t.function.name for t in tools], parallel, enforced))
        return 'calls: "C"\nauto: "A" | FREE'

    def free_text(self, enforced):
        self.asked.append(("free", [t.function.name for t in enforced]))
        return '"F"'

    def auto_start(self):
        return "auto"


class FakeReasoning:
    def __init__(self, prefix):
        self.prefix = prefix

    def grammar_prefix(self):
        return self.prefix


def grammar_of(request, reasoning=None) -> tuple[str, list]:
    params, parser = SamplingParams(), FakeParser()
    attach_tool_grammar(params, request, parser, reasoning)
    if params.structured_outputs is None:
        return None, parser.asked
    return params.structured_outputs.grammar, parser.asked


def test_none_and_auto_without_strict_tools_put_no_grammar():
    assert grammar_of(ToolRequest(tools(WEATHER), "none")) == (None, [])
    assert grammar_of(ToolRequest(tools(WEATHER), "auto")) == (None, [])


def test_a_forced_choice_starts_at_the_calls_of_its_tools():
    grammar, asked = grammar_of(ToolRequest(tools(WEATHER, CLOCK), "required", parallel=False))
    assert grammar == 'start: calls\ncalls: "C"\nauto: "A" | FREE'
    assert asked == [(["get_weather", "get_time"], False, None)]
    grammar, asked = grammar_of(ToolRequest(tools(WEATHER, CLOCK), "named", named="get_time"))
    assert grammar == 'start: calls\ncalls: "C"\nauto: "A" | FREE'
    assert asked == [(["get_time"], True, None)]


def test_auto_with_strict_tools_allows_free_text_or_calls():
    ts = tools(WEATHER, tool("log", strict=True))
    grammar, asked = grammar_of(ToolRequest(ts, "auto"))
    assert grammar == 'start: auto\ncalls: "C"\nauto: "A" | FREE\nFREE: "F"'
    assert asked == [(["get_weather", "log"], True, {"log"}), ("free", ["log"])]


def test_thinking_comes_first_when_the_reasoning_parser_has_a_prefix():
    request = ToolRequest(tools(WEATHER), "required")
    grammar, _ = grammar_of(request, FakeReasoning(('think: "T"', "think")))
    assert grammar == 'start: think (calls)\ncalls: "C"\nauto: "A" | FREE\nthink: "T"'
    grammar, _ = grammar_of(request, FakeReasoning(None))
    assert grammar == 'start: calls\ncalls: "C"\nauto: "A" | FREE'


def test_a_constraining_choice_and_a_structured_output_are_a_400():
    params = SamplingParams()
    params.structured_outputs = StructuredOutputsParams(json_object=True)
    with pytest.raises(APIError) as e:
        attach_tool_grammar(params, ToolRequest(tools(WEATHER), "required"), FakeParser())
    assert (e.value.status, e.value.param) == (400, "tool_choice")
    assert e.value.message == (
        "tool_choice 'required' constrains the output, and so does the request's structured "
        "output (response_format or guided_*): send one of them"
    )


def test_a_structured_output_is_kept_where_the_choice_constrains_nothing():
    params = SamplingParams()
    params.structured_outputs = StructuredOutputsParams(json_object=True)
    attach_tool_grammar(params, ToolRequest(tools(WEATHER), "none"), FakeParser())
    assert params.structured_outputs == StructuredOutputsParams(json_object=True)


def test_a_grammar_llguidance_refuses_is_a_400_naming_tool_choice():
    class Broken(FakeParser):
        def grammar(self, tools, parallel, enforced=None):
            return "calls: undefined_rule"

    with pytest.raises(APIError) as e:
        attach_tool_grammar(SamplingParams(), ToolRequest(tools(WEATHER), "required"), Broken())
    assert (e.value.status, e.value.param) == (400, "tool_choice")


# ---- finish_reason --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "choice, reason, called, expected",
    [
        ("auto", "stop", True, "tool_calls"),
        ("required", "stop", True, "tool_calls"),
        ("named", "stop", True, "stop"),  # the client asked for that call
        ("auto", "stop", False, "stop"),
        ("auto", "length", True, "length"),  # cut short: the call may be incomplete
        ("required", None, True, None),  # not finished yet
        ("none", "stop", False, "stop"),
    ],
)
def test_finish_reason_is_tool_calls_when_the_model_ended_on_calls_it_chose_or_had_to_make(
    choice, reason, called, expected
):
    request = ToolRequest(
        tools(WEATHER), choice, named="get_weather" if choice == "named" else None
    )
    assert finish_reason(request, reason, called) == expected


def test_finish_reason_without_tools_is_the_engines():
    assert finish_reason(None, "stop", True) == "stop"
    assert finish_reason(None, "length", False) == "length"
