"""The grammars a tool choice puts on the output, run by llguidance over real tokenizers (the
demo model's, and one whose GLM-4.5 tags are special tokens): what they let a model write and
what they refuse."""

from __future__ import annotations

import llguidance
import pytest

from pagedserve.engine.structured_output.backend_guidance import text_tokenizer
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.presets import demo_model_dir
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionToolsParam
from pagedserve.server.reasoning_parsers import ReasoningParserManager
from pagedserve.server.tool_parsers import ToolParserManager
from pagedserve.server.tools import ToolRequest, attach_tool_grammar, tool_request
from tests.helpers.glm_formats import CLOCK, WEATHER
from tests.helpers.models import SPECIAL_TOKENS, build_tiny_tokenizer

XML_TAGS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
STOPS = ("<|endoftext|>", "<|user|>", "<|observation|>")
PARIS = '{"location": "Paris"}'


@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer(demo_model_dir())


@pytest.fixture(scope="module")
def glm45_vocab(tmp_path_factory) -> Tokenizer:
    """A tokenizer in which GLM-4.5's tags and </think> are special tokens, as in GLM-4.5's."""
    path = tmp_path_factory.mktemp("glm45-tokenizer")
    build_tiny_tokenizer(path, special_tokens=(*SPECIAL_TOKENS, *XML_TAGS, "</think>"))
    return Tokenizer(path)


def _matcher(tokenizer: Tokenizer, grammar: str) -> llguidance.LLMatcher:
    eos = [tokenizer.token_to_id(t) for t in STOPS]
    llg = text_tokenizer(tokenizer.model_dir / "tokenizer.json", tokenizer.vocab_size, eos)
    return llguidance.LLMatcher(llg, llguidance.grammar_from("lark", grammar), log_level=0)


def _grammar(tokenizer, parser_name, request: ToolRequest, prompt: str | None = None) -> str:
    parser = ToolParserManager.get_tool_parser(parser_name)(tokenizer, request.tools)
    reasoning = None
    if prompt is not None:
        reasoning = ReasoningParserManager.get_reasoning_parser("glm4")(tokenizer, prompt)
    params = SamplingParams()
    attach_tool_grammar(params, request, parser, reasoning)
    return params.structured_outputs.grammar


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = _matcher(tokenizer, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def _tools(*tools) -> list[ChatCompletionToolsParam]:
    return [ChatCompletionToolsParam(**t) for t in tools]


def _strict(tool: dict) -> dict:
    return {**tool, "function": {**tool["function"], "strict": True}}


# ---- glm4 --------------------------------------------------------------------------------------
def test_required_takes_only_valid_calls_of_declared_tools(demo):
    g = _grammar(demo, "glm4", ToolRequest(_tools(WEATHER, CLOCK), "required"))
    assert _accepts(demo, g, f"get_weather\n{PARIS}")
    assert _accepts(demo, g, 'get_weather\n{"location": "Paris", "unit": "celsius"}')
    assert _accepts(demo, g, f"get_weather\n{PARIS}<|assistant|>get_time\n{{}}")
    assert _accepts(demo, g, f"get_weather\n{PARIS}<|assistant|>\nget_time\n{{}}")  # the demo's
    assert not _accepts(demo, g, "\nget_time\n{}")  # the name comes first
    assert not _accepts(demo, g, 'get_weather\n{"location": 5}')  # a string is required
    assert not _accepts(demo, g, 'get_weather\n{"unit": "celsius"}')  # location is required
    assert not _accepts(demo, g, 'get_weather\n{"location": "Paris", "x": 1}')  # no other keys
    assert not _accepts(demo, g, 'get_weather\n{"location": "Paris", "unit": "kelvin"}')
    assert not _accepts(demo, g, 'get_time\n{"now": true}')
    assert not _accepts(demo, g, "get_stock\n{}")
    assert not _accepts(demo, g, "It is sunny.")


def test_arguments_are_an_object_even_when_the_schema_says_nothing(demo):
    anything = {"type": "function", "function": {"name": "log", "parameters": {}}}
    g = _grammar(demo, "glm4", ToolRequest(_tools(anything), "required"))
    assert _accepts(demo, g, 'log\n{"line": "x"}')
    assert not _accepts(demo, g, "log\n5") and not _accepts(demo, g, 'log\n"x"')


def test_a_named_function_and_one_call_without_parallel_tool_calls(demo):
    named = ToolRequest(_tools(WEATHER, CLOCK), "named", named="get_time", parallel=False)
    g = _grammar(demo, "glm4", named)
    assert _accepts(demo, g, "get_time\n{}")
    assert not _accepts(demo, g, f"get_weather\n{PARIS}")
    assert not _accepts(demo, g, "get_time\n{}<|assistant|>get_time\n{}")


def test_auto_holds_only_strict_tools_to_their_schema(demo):
    g = _grammar(demo, "glm4", ToolRequest(_tools(_strict(WEATHER), CLOCK), "auto"))
    assert _accepts(demo, g, "\nIt is sunny in Paris.")
    assert _accepts(demo, g, f"get_weather\n{PARIS}")
    assert not _accepts(demo, g, 'get_weather\n{"location": 5}')
    assert not _accepts(demo, g, "\nget_weather\nsunny")
    assert _accepts(demo, g, 'get_time\n{"any": "thing"}')  # not strict: any JSON object
    assert tool_request(_tools(WEATHER), "auto", True, True).enforced() == []  # no grammar


def test_auto_holds_each_strict_tool_and_a_further_call_of_another_to_any_object(demo):
    g = _grammar(demo, "glm4", ToolRequest(_tools(_strict(WEATHER), _strict(CLOCK)), "auto"))
    assert not _accepts(demo, g, 'get_weather\n{"location": 5}')
    assert not _accepts(demo, g, 'get_time\n{"x": 1}')
    assert _accepts(demo, g, "get_time\n{}") and _accepts(demo, g, "\nSunny.")
    g = _grammar(demo, "glm4", ToolRequest(_tools(_strict(WEATHER), CLOCK), "auto"))
    assert _accepts(demo, g, f'get_weather\n{PARIS}<|assistant|>get_time\n{{"x": 1}}')


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])  # </think> as text, as a special
def test_thinking_comes_before_the_call(vocab, request):
    tok = request.getfixturevalue(vocab)
    g = _grammar(tok, "glm4", ToolRequest(_tools(WEATHER), "required"), "<|assistant|>\n<think>")
    assert _accepts(tok, g, f"I will look it up.</think>get_weather\n{PARIS}")
    assert _accepts(tok, g, f"</think>\nget_weather\n{PARIS}")
    assert not _accepts(tok, g, f"get_weather\n{PARIS}")  # the thinking is still open
    strict_auto = ToolRequest(_tools(_strict(WEATHER)), "auto")
    g = _grammar(tok, "glm45", strict_auto, "<|assistant|>\n<think>")
    assert _accepts(tok, g, "hm</think>Sunny.") and _accepts(tok, g, "hm</think>" + XML_CALL)


# ---- glm45 ---------------------------------------------------------------------------------------
XML_CALL = (
    "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Paris</arg_value>\n"
    "</tool_call>"
)


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
def test_glm45_required_takes_valid_xml_calls(vocab, request):
    tok = request.getfixturevalue(vocab)
    g = _grammar(tok, "glm45", ToolRequest(_tools(WEATHER, CLOCK), "required"))
    assert _accepts(tok, g, XML_CALL)
    assert _accepts(tok, g, XML_CALL.replace("\n", ""))  # GLM-4.7 writes no newlines
    assert _accepts(tok, g, XML_CALL + "<tool_call>get_time</tool_call>")
    with_unit = XML_CALL.replace(
        "</tool_call>", "<arg_key>unit</arg_key><arg_value>celsius</arg_value></tool_call>"
    )
    assert _accepts(tok, g, with_unit)
    assert not _accepts(tok, g, with_unit.replace("celsius", "kelvin"))
    assert not _accepts(tok, g, "<tool_call>get_weather\n</tool_call>")  # location is required
    assert not _accepts(tok, g, "Sunny.")


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
def test_glm45_auto_with_a_strict_tool_allows_text_first(vocab, request):
    tok = request.getfixturevalue(vocab)
    g = _grammar(tok, "glm45", ToolRequest(_tools(_strict(WEATHER)), "auto"))
    assert _accepts(tok, g, "Let me check." + XML_CALL)
    assert _accepts(tok, g, "Sunny.")
    assert not _accepts(tok, g, "<tool_call>get_weather\n</tool_call>")


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
def test_glm45_one_call_only_without_parallel_tool_calls(vocab, request):
    tok = request.getfixturevalue(vocab)
    named = ToolRequest(_tools(WEATHER, CLOCK), "named", named="get_weather", parallel=False)
    g = _grammar(tok, "glm45", named)
    assert _accepts(tok, g, XML_CALL)
    assert not _accepts(tok, g, XML_CALL + XML_CALL)
    g = _grammar(tok, "glm45", ToolRequest(_tools(WEATHER, CLOCK), "required", parallel=False))
    assert _accepts(tok, g, XML_CALL)
    assert not _accepts(tok, g, XML_CALL + "<tool_call>get_time</tool_call>")


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
def test_glm45_a_function_without_parameters_takes_no_pairs_and_a_free_object_any(vocab, request):
    tok = request.getfixturevalue(vocab)
    ping = {"type": "function", "function": {"name": "ping"}}  # no parameters: no arguments
    pair = "<arg_key>host</arg_key><arg_value>x</arg_value>"
    g = _grammar(tok, "glm45", ToolRequest(_tools(ping), "required"))
    assert _accepts(tok, g, "<tool_call>ping</tool_call>")
    assert not _accepts(tok, g, f"<tool_call>ping{pair}</tool_call>")
    # auto holds a tool that is not strict to no schema: any pairs (glm4's: any object)
    g = _grammar(tok, "glm45", ToolRequest(_tools(_strict(CLOCK), ping, WEATHER), "auto"))
    assert _accepts(tok, g, f"<tool_call>ping{pair}{pair}</tool_call>")
    assert _accepts(tok, g, f"<tool_call>get_weather{pair}</tool_call>")  # no location
    assert _accepts(tok, g, "<tool_call>get_time</tool_call>")


NOW = "<arg_key>now</arg_key><arg_value>true</arg_value>"  # a pair get_time does not list


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
@pytest.mark.parametrize(
    ("choice", "clock"),
    [("required", CLOCK), ("named", CLOCK), ("auto", _strict(CLOCK))],
    ids=["required", "named", "auto-strict"],
)
def test_glm45_a_held_tool_whose_properties_are_empty_takes_no_pairs_as_glm4_takes_no_keys(
    vocab, choice, clock, request
):
    tok = request.getfixturevalue(vocab)
    named = "get_time" if choice == "named" else None
    held = ToolRequest(_tools(WEATHER, clock), choice, named=named)
    g = _grammar(tok, "glm45", held)
    assert _accepts(tok, g, "<tool_call>get_time</tool_call>")
    assert not _accepts(tok, g, f"<tool_call>get_time{NOW}</tool_call>")
    assert not _accepts(tok, g, f"<tool_call>get_time\n{NOW}\n</tool_call>")
    g = _grammar(tok, "glm4", held)
    assert _accepts(tok, g, "get_time\n{}") and not _accepts(tok, g, 'get_time\n{"now": true}')


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
def test_glm45_empty_properties_take_any_pairs_where_the_schema_or_auto_leaves_them_open(
    vocab, request
):
    tok = request.getfixturevalue(vocab)
    open_clock = {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": True},
        },
    }
    auto = ToolRequest(_tools(_strict(WEATHER), CLOCK), "auto")  # holds get_time to no schema
    for open_request in (ToolRequest(_tools(open_clock), "required"), auto):
        g = _grammar(tok, "glm45", open_request)
        assert _accepts(tok, g, f"<tool_call>get_time{NOW}</tool_call>")
        assert _accepts(tok, g, "<tool_call>get_time</tool_call>")
        g = _grammar(tok, "glm4", open_request)
        assert _accepts(tok, g, 'get_time\n{"now": true}') and _accepts(tok, g, "get_time\n{}")


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
@pytest.mark.parametrize(
    "extra", [None, True, {"type": "boolean"}], ids=["closed", "true", "schema"]
)
def test_glm45_takes_pairs_past_the_listed_ones_where_the_schema_does_as_glm4_takes_keys(
    vocab, extra, request
):
    tok = request.getfixturevalue(vocab)
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    if extra is not None:
        params["additionalProperties"] = extra
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    held = ToolRequest(_tools(weather), "required")
    city = "<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    g = _grammar(tok, "glm45", held)
    assert _accepts(tok, g, f"<tool_call>get_weather{city}</tool_call>")
    assert _accepts(tok, g, f"<tool_call>get_weather{city}{NOW}</tool_call>") == (extra is not None)
    assert not _accepts(tok, g, f"<tool_call>get_weather{NOW}</tool_call>")  # city is required
    soon = NOW.replace("true", "soon")  # not a boolean: only a schema that says so refuses it
    assert _accepts(tok, g, f"<tool_call>get_weather{city}{soon}</tool_call>") == (extra is True)
    g = _grammar(tok, "glm4", held)
    assert _accepts(tok, g, 'get_weather\n{"city": "Paris"}')
    extended = 'get_weather\n{"city": "Paris", "now": true}'
    assert _accepts(tok, g, extended) == (extra is not None)


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
def test_glm45_each_tools_other_pairs_hold_to_its_own_additional_schema(vocab, request):
    tok = request.getfixturevalue(vocab)

    def tool(name: str, longest: int) -> dict:
        extra = {"type": "string", "maxLength": longest}
        params = {"type": "object", "properties": {}, "additionalProperties": extra}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    g = _grammar(tok, "glm45", ToolRequest(_tools(tool("short", 3), tool("long", 5)), "required"))

    def call(name: str, value: str) -> str:
        return f"<tool_call>{name}<arg_key>k</arg_key><arg_value>{value}</arg_value></tool_call>"

    assert _accepts(tok, g, call("short", "yes")) and not _accepts(tok, g, call("short", "soon"))
    assert _accepts(tok, g, call("long", "soon")) and not _accepts(tok, g, call("long", "sooner"))


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
def test_glm45_free_text_is_any_text_without_a_calls_tag(vocab, request):
    tok = request.getfixturevalue(vocab)
    parser = ToolParserManager.get_tool_parser("glm45")(tok, _tools(WEATHER))
    g = f"start: FREE\nFREE: {parser.free_text(_tools(WEATHER))}"
    assert _accepts(tok, g, "Sunny.") and _accepts(tok, g, "a <tool call> or <tool_call")
    assert not _accepts(tok, g, "Sunny.<tool_call>") and not _accepts(tok, g, XML_CALL)


LABEL = {  # a value of each kind of rule: lengths of a string, and JSON
    "type": "function",
    "function": {
        "name": "label",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "minLength": 2, "maxLength": 4},
                "note": {"type": "string", "maxLength": 3},
                "name": {"type": "string", "minLength": 2},
                "count": {"type": "integer"},
            },
        },
    },
}


@pytest.mark.parametrize("vocab", ["demo", "glm45_vocab"])
def test_glm45_values_keep_to_their_schemas_lengths_and_types(vocab, request):
    tok = request.getfixturevalue(vocab)
    g = _grammar(tok, "glm45", ToolRequest(_tools(LABEL), "required"))

    def takes(key: str, value: str) -> bool:
        pair = f"<arg_key>{key}</arg_key><arg_value>{value}</arg_value>"
        return _accepts(tok, g, f"<tool_call>label\n{pair}\n</tool_call>")

    assert takes("code", "ab") and takes("code", "abcd")
    assert not takes("code", "a") and not takes("code", "abcde")
    assert takes("note", "") and takes("note", "abc") and not takes("note", "abcd")
    assert takes("name", "ab") and takes("name", "a long name") and not takes("name", "a")
    assert takes("count", "12") and takes("count", "-3")
    assert not takes("count", "twelve") and not takes("count", "1.5")


# ---- the request's constraint ----------------------------------------------------------------
def test_a_tool_choice_that_constrains_and_a_structured_output_cannot_both_apply(demo):
    request = ToolRequest(_tools(WEATHER), "required")
    parser = ToolParserManager.get_tool_parser("glm4")(demo, request.tools)
    params = SamplingParams()
    attach_tool_grammar(params, request, parser)
    with pytest.raises(APIError) as e:
        attach_tool_grammar(params, request, parser)
    assert e.value.status == 400 and e.value.param == "tool_choice"
