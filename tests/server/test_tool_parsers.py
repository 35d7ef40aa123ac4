"""The tool-call parsers on outputs in the real formats, whole and streamed.

Prompts are rendered as the published GLM-4-9B-chat and GLM-4-0414 templates render them
(tests/helpers/glm_formats.py), outputs are what those models write after them, and the streams
are cut at every point between two characters (inside the name, inside the JSON) and at every
special token (``<|assistant|>``, ``<|observation|>``, which arrive whole). What a stream adds up
to is what the whole output gives; the calls, put back into the conversation, render as the
model wrote them."""

from __future__ import annotations

import json
import logging

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.models.chat_templates import builtin_chat_template
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.presets import demo_model_dir
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.chat_output import ChatOutputParser
from pagedserve.server.protocol import ChatCompletionToolsParam, DeltaMessage
from pagedserve.server.reasoning_parsers import ReasoningParserManager
from pagedserve.server.tool_parsers import CallSegment, TextSegment, ToolParser, ToolParserManager
from pagedserve.server.tool_parsers.abstract_tool_parser import (
    JSON_OPTIONS,
    is_special_token,
    partial_mark_length,
)
from tests.helpers.glm_formats import PUBLISHED, TOOLS, render_published

SPECIALS = ("<|assistant|>", "<|observation|>", "<|user|>", "<|endoftext|>", "</think>")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(demo_model_dir())


@pytest.fixture(scope="module")
def glm4(tokenizer):
    return ToolParserManager.get_tool_parser("glm4")(tokenizer, _tools(TOOLS))


@pytest.fixture(scope="module")
def glm45(tokenizer):
    return ToolParserManager.get_tool_parser("glm45")(tokenizer, _tools(TOOLS))


def _tools(tools: list[dict]) -> list[ChatCompletionToolsParam]:
    return [ChatCompletionToolsParam(**t) for t in tools]


def _pieces(text: str) -> list[str]:
    """The text as a stream can deliver it: every character, but a special token whole."""
    out, i = [], 0
    while i < len(text):
        special = next((s for s in SPECIALS if text.startswith(s, i)), None)
        out.append(special or text[i])
        i += len(out[-1])
    return out


def _stream(parser: ChatOutputParser, deliveries: list[str]) -> list[DeltaMessage]:
    text, deltas = "", []
    for n, piece in enumerate(deliveries):
        text += piece
        delta = parser.delta(text, finished=n == len(deliveries) - 1)
        if delta is not None:
            deltas.append(delta)
    return deltas


def _reassemble(deltas: list[DeltaMessage]) -> tuple[str | None, list[dict], str | None]:
    """(content, calls, reasoning) as the openai SDK's stream helpers add the deltas up."""
    content, reasoning, calls = None, None, {}
    for d in deltas:
        if d.content is not None:
            content = (content or "") + d.content
        if d.reasoning_content is not None:
            reasoning = (reasoning or "") + d.reasoning_content
        for c in d.tool_calls or []:
            entry = calls.setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            if c.id is not None:
                assert entry["id"] is None, "a call's id came twice"
                entry["id"], entry["name"] = c.id, c.function.name
                assert c.type == "function"
            else:
                assert entry["id"] is not None, "arguments before the call's id and name"
            entry["arguments"] += c.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], reasoning


def _every_cut(make_parser, output: str):
    """Deltas of every way of cutting the output: not at all (the whole output in one finished
    delta, as a request that ends in the step that starts it sends it), in two, and piece by
    piece."""
    pieces = _pieces(output)
    yield _stream(make_parser(), [output])
    yield _stream(make_parser(), pieces)
    for cut in range(1, len(pieces)):
        yield _stream(make_parser(), ["".join(pieces[:cut]), "".join(pieces[cut:])])


def _whole(parser, output: str):
    parsed = ChatOutputParser(parser).parse(output)
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in parsed.tool_calls
    ]
    return parsed.content, calls


def _assert_streams_add_up(parser, output: str):
    content, calls = _whole(parser, output)
    for deltas in _every_cut(lambda: ChatOutputParser(parser), output):
        s_content, s_calls, _ = _reassemble(deltas)
        assert (s_content or None) == content
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in s_calls] == calls
    return content, calls


# ---- glm4: GLM-4-9B-chat and GLM-4-0414 -------------------------------------------------------
GLM4_OUTPUTS = [  # (what the model writes after the prompt, the calls, the content)
    (
        'get_weather\n{"location": "Paris"}<|observation|>',
        [("get_weather", '{"location": "Paris"}')],
        None,
    ),
    (
        'get_weather\n{"location": "Paris", "unit": "celsius"}<|assistant|>get_time\n{}'
        "<|observation|>",
        [("get_weather", '{"location": "Paris", "unit": "celsius"}'), ("get_time", "{}")],
        None,
    ),
    ("get_time\n{}<|observation|>", [("get_time", "{}")], None),
    ("get_time<|observation|>", [("get_time", "{}")], None),  # a name alone: no arguments
    ("\nIt is sunny in Paris.<|user|>", [], "\nIt is sunny in Paris."),
    ("\nget_weather is a tool I have.<|user|>", [], "\nget_weather is a tool I have."),
    (
        "\nLet me look.<|assistant|>get_time\n{}<|observation|>",
        [("get_time", "{}")],
        "\nLet me look.",
    ),
    (
        'get_weather\n{"location": "巴黎"}<|observation|>',
        [("get_weather", '{"location": "巴黎"}')],
        None,
    ),
]


@pytest.mark.parametrize("published", ["glm-4-9b-chat", "GLM-4-9B-0414"])
@pytest.mark.parametrize("output,calls,content", GLM4_OUTPUTS)
def test_glm4_reads_calls_after_the_published_prompt_whole_and_streamed(
    tokenizer, glm4, published, output, calls, content
):
    messages = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    prompt = render_published(published, messages, TOOLS)
    assert prompt.endswith("<|assistant|>")  # the model's text starts right after it
    got_content, got_calls = _assert_streams_add_up(glm4, output)
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls
    assert got_content == content
    for c in got_calls:
        schema = next(t for t in TOOLS if t["function"]["name"] == c["name"])
        jsonschema.validate(json.loads(c["arguments"]), schema["function"]["parameters"])
    if calls and content is None:  # the call, sent back, renders as the model wrote it
        history = [
            *messages,
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": f"call_{i}", "type": "function", "function": c}
                    for i, c in enumerate(got_calls)
                ],
            },
        ]
        again = _render(tokenizer, PUBLISHED[published][1], history, TOOLS)
        expected = output.removesuffix("<|observation|>")
        if output == "get_time<|observation|>":
            expected = "get_time\n{}"
        assert again == prompt + expected
        assert again == render_published(published, history, TOOLS, add_generation_prompt=False)


def _render(tokenizer, builtin, messages, tools):
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = builtin_chat_template(builtin)
    return tok.apply_chat_template(messages, add_generation_prompt=False, tools=tools)


def test_a_marker_that_arrives_in_pieces_is_waited_for(glm4):
    """A special token is one token, so it arrives whole; text that spells one in pieces is
    held until it is clear (nothing of it leaks into the content)."""
    output = 'get_weather\n{"location": "Paris"}<|assistant|>get_time\n{}<|observation|>'
    content, calls = _whole(glm4, output)
    s_content, s_calls, _ = _reassemble(_stream(ChatOutputParser(glm4), list(output)))
    assert (s_content, [(c["name"], c["arguments"]) for c in s_calls]) == (
        content,
        [(c["name"], c["arguments"]) for c in calls],
    )


def test_a_name_that_is_not_a_declared_tool_is_text(glm4):
    content, calls = _assert_streams_add_up(glm4, 'get_stock\n{"symbol": "X"}<|observation|>')
    assert calls == [] and content == 'get_stock\n{"symbol": "X"}'


def test_arguments_that_are_not_json_are_text_and_the_reason_is_logged(glm4, caplog):
    with caplog.at_level(logging.WARNING):
        content, calls = _whole(glm4, 'get_weather\n{"location": Paris}<|observation|>')
    assert calls == [] and content == 'get_weather\n{"location": Paris}'
    assert "not a tool call of get_weather" in caplog.text and "not JSON" in caplog.text
    # streamed: text as well when the call arrives whole; a call already streamed stays one
    output = 'get_weather\n{"location": Paris}<|observation|>'
    assert _reassemble(_stream(ChatOutputParser(glm4), [output]))[:2] == (content, [])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _, streamed, _ = _reassemble(_stream(ChatOutputParser(glm4), _pieces(output)))
    assert [c["arguments"] for c in streamed] == ['{"location": Paris}']
    assert "a streamed tool call of get_weather is not valid" in caplog.text


def test_a_valid_streamed_call_logs_nothing(glm4, caplog):
    output = 'get_weather\n{"location": "Paris"}<|observation|>'
    with caplog.at_level(logging.WARNING):
        _, streamed, _ = _reassemble(_stream(ChatOutputParser(glm4), _pieces(output)))
    assert [c["arguments"] for c in streamed] == ['{"location": "Paris"}']
    assert caplog.records == []


def test_a_call_not_json_is_text_and_the_calls_after_it_stay_in_an_output_sent_at_once(glm4):
    output = 'get_weather\n{"location": Paris}<|assistant|>get_time\n{}<|observation|>'
    content, calls = _whole(glm4, output)
    assert (content, calls) == (
        'get_weather\n{"location": Paris}',
        [{"name": "get_time", "arguments": "{}"}],
    )
    s_content, s_calls, _ = _reassemble(_stream(ChatOutputParser(glm4), [output]))
    assert s_content == content
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in s_calls] == calls


def test_a_call_is_not_shown_before_its_name_and_its_first_brace(glm4):
    parser = ChatOutputParser(glm4)
    for partial in ("get_wea", "get_weather", "get_weather\n"):
        assert parser.delta(partial, finished=False) is None
    first = parser.delta('get_weather\n{"loc', finished=False).tool_calls[0]
    assert first.function.name == "get_weather" and first.function.arguments == '{"loc'
    more = parser.delta('get_weather\n{"location": "Pa', finished=False).tool_calls[0]
    assert more.id is None and more.function.arguments == 'ation": "Pa'


def test_one_call_only_without_parallel_tool_calls(glm4):
    output = 'get_weather\n{"location": "Paris"}<|assistant|>get_time\n{}<|observation|>'
    parsed = ChatOutputParser(glm4, parallel=False).parse(output)
    assert [c.function.name for c in parsed.tool_calls] == ["get_weather"]
    _, calls, _ = _reassemble(_stream(ChatOutputParser(glm4, parallel=False), _pieces(output)))
    assert [c["name"] for c in calls] == ["get_weather"]


def test_a_truncated_call_is_text(glm4):
    content, calls = _whole(glm4, 'get_weather\n{"location": "Par')
    assert calls == [] and content == 'get_weather\n{"location": "Par'


def test_an_output_that_ends_in_the_start_of_a_marker_keeps_that_text(glm4):
    assert _whole(glm4, "\nSee <|") == ("\nSee <|", [])


def test_a_name_alone_at_the_end_is_text_and_a_call_once_its_line_is_over(glm4):
    """Cut short (max_tokens, a stop string): a bare name may be the start of a sentence; a
    name and its newline is a call without arguments."""
    assert _whole(glm4, "get_time") == ("get_time", [])
    assert _whole(glm4, "get_time\n") == (None, [{"name": "get_time", "arguments": "{}"}])


def test_spaces_after_a_name_alone_are_not_part_of_it(glm4):
    assert _whole(glm4, "get_time <|observation|>") == (
        None,
        [{"name": "get_time", "arguments": "{}"}],
    )


def test_spaces_after_a_name_before_its_newline_are_not_part_of_it(glm4):
    content, calls = _assert_streams_add_up(
        glm4, 'get_weather \n{"location": "Paris"}<|observation|>'
    )
    assert content is None and calls == [
        {"name": "get_weather", "arguments": '{"location": "Paris"}'}
    ]


def test_the_answer_ends_at_the_first_turn_end_even_at_its_start(glm4):
    assert _whole(glm4, "\nHi<|user|>more<|user|>") == ("\nHi", [])
    assert _whole(glm4, "<|user|>more") == ("", [])


@pytest.mark.parametrize(
    "output,calls,content",
    [  # an output with ignore_eos, or whose stop token the request removed, goes on past its end
        (
            'get_weather\n{"location": "Paris"}<|observation|>\n{"x": 1}<|user|>',
            [("get_weather", '{"location": "Paris"}')],
            None,
        ),
        ("get_time\n{}<|observation|>get_time\n{}<|observation|>", [("get_time", "{}")], None),
        ("\nSunny.<|user|>get_time\n{}<|observation|>", [], "\nSunny."),
        ("\nSunny.<|endoftext|>\nRainy.<|user|>", [], "\nSunny."),
    ],
)
def test_glm4_reads_an_output_with_several_turn_ends_to_the_first(glm4, output, calls, content):
    got_content, got_calls = _assert_streams_add_up(glm4, output)
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls
    assert got_content == content


def test_text_that_cannot_begin_a_call_is_shown_at_once(glm4):
    assert ChatOutputParser(glm4).delta("\nSunny", finished=False).content == "\nSunny"
    assert ChatOutputParser(glm4).delta("\nget_w", finished=False) is None  # it may


def test_a_declared_name_whose_next_line_is_not_json_is_shown_as_text_at_once(glm4):
    parser = ChatOutputParser(glm4)
    delta = parser.delta("get_weather\nis a tool I have", finished=False)
    assert (delta.content, delta.tool_calls) == ("get_weather\nis a tool I have", None)


def test_a_call_before_the_next_calls_marker_is_whole_while_the_turn_goes_on(glm4):
    for first in ("get_time", "get_time\n"):
        assert glm4.segments(first + "<|assistant|>get_wea", final=False) == [
            CallSegment("get_time", "{}", first)
        ]


def test_a_newline_after_the_marker_of_a_further_call_is_not_part_of_its_name(glm4):
    output = 'get_weather\n{"location": "Paris"}<|assistant|>\nget_time\n{}<|observation|>'
    content, calls = _assert_streams_add_up(glm4, output)
    assert content is None and [c["name"] for c in calls] == ["get_weather", "get_time"]


def test_special_tokens_the_client_skips_are_dropped_from_content(glm4):
    parsed = ChatOutputParser(glm4, specials=("[gMASK]",)).parse("\nHi[gMASK] there<|user|>")
    assert parsed.content == "\nHi there"


def test_special_tokens_the_client_skips_are_dropped_from_streamed_content_too(glm4):
    parser = ChatOutputParser(glm4, specials=("[gMASK]",))
    assert parser.delta("\nHi[gMASK] there<|user|>", finished=True).content == "\nHi there"


def test_an_answer_of_calls_only_has_no_content_when_special_tokens_are_dropped(glm4):
    parsed = ChatOutputParser(glm4, specials=("[gMASK]",)).parse("get_time\n{}<|observation|>")
    assert parsed.content is None and [c.function.name for c in parsed.tool_calls] == ["get_time"]


def test_without_a_tool_parser_the_answer_is_all_content_and_no_calls():
    parsed = ChatOutputParser(None).parse("get_time\n{}<|observation|>")
    assert (parsed.content, parsed.tool_calls) == ("get_time\n{}<|observation|>", [])


def test_whitespace_before_the_marker_of_a_call_is_no_content_whole_or_streamed(glm4):
    content, calls = _assert_streams_add_up(glm4, "  <|assistant|>get_time\n{}<|observation|>")
    assert content is None and calls == [{"name": "get_time", "arguments": "{}"}]


class _RevisingParser(ToolParser):
    """A plugin's parser that breaks the contract: its final text rewrites what it reported."""

    def segments(self, text, final):
        return [TextSegment("Sunny, 31 degrees" if final else text)]


def test_a_delta_never_rewrites_what_was_sent(tokenizer):
    """What the client has stands: text that no longer extends it adds nothing to it."""
    parser = ChatOutputParser(_RevisingParser(tokenizer, []))
    assert parser.delta("Sunny, 30", finished=False).content == "Sunny, 30"
    assert parser.delta("Sunny, 30 degrees", finished=True) is None


def test_an_answer_of_only_whitespace_waits_while_a_call_may_follow(glm4):
    parser = ChatOutputParser(glm4)
    assert parser.delta("\n", finished=False) is None
    last = parser.delta("\n", finished=True)
    assert (last.content, last.tool_calls) == ("\n", None)
    assert (
        ChatOutputParser(None).delta("\n", finished=False).content == "\n"
    )  # no calls to wait for


def test_a_parser_says_whether_it_streamed_a_call(glm4):
    parser = ChatOutputParser(glm4)
    parser.delta("get_wea", finished=False)
    assert not parser.called
    parser.delta('get_weather\n{"lo', finished=False)
    assert parser.called


def test_a_first_call_delta_carries_its_id_type_name_and_arguments_so_far(glm4):
    parser = ChatOutputParser(glm4)
    (first,) = parser.delta('get_weather\n{"lo', finished=False).tool_calls
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0,
        "function",
        "get_weather",
        '{"lo',
    )
    assert first.id.startswith("call_") and len(first.id) == 29
    assert parser.delta('get_weather\n{"lo', finished=False) is None  # nothing new
    (second,) = parser.delta(
        'get_weather\n{"location": "Paris"}<|assistant|>get_time\n{', finished=False
    ).tool_calls[1:]
    assert (second.index, second.function.name, second.function.arguments) == (1, "get_time", "{")
    assert second.id != first.id


# ---- glm45: the XML form ----------------------------------------------------------------------
GLM45_OUTPUTS = [
    (
        "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call><|observation|>",
        [("get_weather", '{"location": "Paris", "unit": "celsius"}')],
        None,
    ),
    (  # GLM-4.7's form, without newlines; text first; a call without arguments
        "I will check.<tool_call>get_weather<arg_key>location</arg_key><arg_value>New York"
        "</arg_value></tool_call><tool_call>get_time</tool_call><|observation|>",
        [("get_weather", '{"location": "New York"}'), ("get_time", "{}")],
        "I will check.",
    ),
    ("It is sunny.<|user|>", [], "It is sunny."),
    (
        "<tool_call>get_stock\n<arg_key>s</arg_key>\n<arg_value>X</arg_value>\n</tool_call>",
        [],
        "<tool_call>get_stock\n<arg_key>s</arg_key>\n<arg_value>X</arg_value>\n</tool_call>",
    ),
    (  # a closing tag in the text before a call is text
        "Done.</tool_call> <tool_call>get_time</tool_call>",
        [("get_time", "{}")],
        "Done.</tool_call> ",
    ),
    (  # the name is the text before the first newline: none here, so this is no call
        "<tool_call>\nget_time\n</tool_call>",
        [],
        "<tool_call>\nget_time\n</tool_call>",
    ),
    *[  # a stray tag between two pairs is skipped, as vLLM's pattern of a pair skips it
        (
            "<tool_call>get_weather<arg_key>location</arg_key><arg_value>Paris</arg_value>"
            f"{stray}<arg_key>unit</arg_key><arg_value>celsius</arg_value></tool_call>",
            [("get_weather", '{"location": "Paris", "unit": "celsius"}')],
            None,
        )
        for stray in ("</arg_key>", "<arg_value>Rome</arg_value>", "</arg_value>")
    ],
    (  # a value may hold a tag's text: it runs to its own closing tag
        "<tool_call>get_weather<arg_key>location</arg_key><arg_value>x<arg_key></arg_value>"
        "<arg_key>unit</arg_key><arg_value>celsius</arg_value></tool_call>",
        [("get_weather", '{"location": "x<arg_key>", "unit": "celsius"}')],
        None,
    ),
]


@pytest.mark.parametrize("output,calls,content", GLM45_OUTPUTS)
def test_glm45_reads_the_xml_form_whole_and_streamed(glm45, output, calls, content):
    got_content, got_calls = _assert_streams_add_up(glm45, output)
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls
    assert got_content == content


def test_glm45_values_are_json_where_the_schema_says_so(tokenizer):
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer"},
                    "tags": {"type": "array"},
                    "s": {"type": "string"},
                },
            },
        },
    }
    parser = ToolParserManager.get_tool_parser("glm45")(tokenizer, _tools([tool]))
    output = (
        "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>5</arg_value>\n<arg_key>tags</arg_key>\n"
        '<arg_value>["a", "b"]</arg_value>\n<arg_key>s</arg_key>\n<arg_value>5</arg_value>\n'
        "</tool_call>"
    )
    _, calls = _assert_streams_add_up(parser, output)
    assert json.loads(calls[0]["arguments"]) == {"n": 5, "tags": ["a", "b"], "s": "5"}


def test_glm45_streams_a_call_from_its_name_line_with_its_string_values_so_far(glm45):
    """Each state of the call as it is written: its name once its line ends, a string value as
    it grows (a tag's start held back), and the model's text of it as the call's source."""
    call = (
        "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Paris</arg_value>\n"
        "</tool_call>"
    )
    states = {
        "<tool_call>get_weather": None,  # the name may go on
        "<tool_call>get_weather\n": "{",
        "<tool_call>get_weather\n<arg_key>loca": "{",
        "<tool_call>get_weather\n<arg_key>location</arg_key>": '{"location": ',
        "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>": '{"location": "',
        "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Par": '{"location": "Par',
        "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Paris</arg_va": (
            '{"location": "Paris'
        ),
        "<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Paris</arg_value>": (
            '{"location": "Paris"'
        ),
        call: '{"location": "Paris"}',
    }
    for text, arguments in states.items():
        expected = [] if arguments is None else [CallSegment("get_weather", arguments, text)]
        assert glm45.segments(text, final=False) == expected, text
    assert glm45.segments(call, final=True) == [CallSegment("get_weather", states[call], call)]


def test_glm45_holds_back_a_value_that_is_not_a_string_until_its_closing_tag(tokenizer):
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
        },
    }
    parser = ToolParserManager.get_tool_parser("glm45")(tokenizer, _tools([tool]))
    head = "<tool_call>f\n<arg_key>n</arg_key><arg_value>12"
    assert parser.segments(head, final=False) == [CallSegment("f", '{"n": ', head)]
    done = head + "3</arg_value>"
    assert parser.segments(done, final=False) == [CallSegment("f", '{"n": 123', done)]


def test_glm45_writes_keys_and_values_beyond_ascii_as_they_are(tokenizer):
    """As vLLM's GLM-4.5 parser does (json.dumps with ensure_ascii=False)."""
    tool = {
        "type": "function",
        "function": {
            "name": "天气",
            "parameters": {
                "type": "object",
                "properties": {"城市": {"type": "string"}, "标签": {"type": "array"}},
            },
        },
    }
    parser = ToolParserManager.get_tool_parser("glm45")(tokenizer, _tools([tool]))
    output = (
        "<tool_call>天气\n<arg_key>城市</arg_key>\n<arg_value>巴黎</arg_value>\n"
        '<arg_key>标签</arg_key>\n<arg_value>["晴"]</arg_value>\n</tool_call>'
    )
    _, calls = _assert_streams_add_up(parser, output)
    assert calls == [{"name": "天气", "arguments": '{"城市": "巴黎", "标签": ["晴"]}'}]
    head = "<tool_call>天气\n<arg_key>城市</arg_key>\n<arg_value>巴"
    assert parser.segments(head, final=False) == [CallSegment("天气", '{"城市": "巴', head)]


def test_glm45_the_answer_ends_at_the_first_turn_end_even_before_the_output_is_final(glm45):
    assert glm45.segments("Sunny.<|user|>Hi<|user|>", final=True) == [TextSegment("Sunny.")]
    assert glm45.segments("<|user|>Hello", final=False) == []
    # a turn end completes the answer: what could have begun a call is text, a call is over
    assert glm45.segments("I will check <tool<|observation|>", final=False) == [
        TextSegment("I will check <tool")
    ]
    assert glm45.segments("<tool_call>get_time<|observation|>", final=False) == [
        CallSegment("get_time", "{}", "<tool_call>get_time")
    ]


@pytest.mark.parametrize(
    "output,calls,content",
    [
        (
            "<tool_call>get_time\n</tool_call><|observation|>"
            "<tool_call>get_weather\n</tool_call><|user|>",
            [("get_time", "{}")],
            None,
        ),
        ("Sunny.<|user|><tool_call>get_time\n</tool_call><|observation|>", [], "Sunny."),
        ("Sunny.<|endoftext|>Rainy.<|endoftext|>", [], "Sunny."),
    ],
)
def test_glm45_reads_an_output_with_several_turn_ends_to_the_first(glm45, output, calls, content):
    got_content, got_calls = _assert_streams_add_up(glm45, output)
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls
    assert got_content == content


def test_glm45_holds_back_only_an_end_that_may_still_become_a_mark(glm45):
    assert glm45.segments("Sunny.", final=False) == [TextSegment("Sunny.")]
    assert glm45.segments("Sunny.<|us", final=False) == [TextSegment("Sunny.")]
    assert glm45.segments("See <tool_ca", final=False) == [TextSegment("See ")]
    assert glm45.segments("Sunny <|", final=True) == [TextSegment("Sunny <|")]
    assert glm45.segments("See <tool_ca", final=True) == [TextSegment("See <tool_ca")]


def test_glm45_a_name_that_is_not_declared_is_text_as_soon_as_its_line_ends(glm45):
    assert glm45.segments("<tool_call>get_stock", final=False) == []
    assert glm45.segments("<tool_call>get_stock\n", final=False) == [
        TextSegment("<tool_call>get_stock\n")
    ]
    assert glm45.segments("<tool_call>get_stock</tool_call>", final=False) == [
        TextSegment("<tool_call>get_stock</tool_call>")
    ]


# ---- reasoning: GLM-Z1 ----------------------------------------------------------------------------
def _z1(tokenizer, messages, tools=None):
    return ReasoningParserManager.get_reasoning_parser("glm4")(
        tokenizer, render_published("GLM-Z1-9B-0414", messages, tools)
    )


def test_glm_z1s_thinking_is_split_from_its_answer_whole_and_streamed(tokenizer):
    reasoning = _z1(tokenizer, [{"role": "user", "content": "2+2?"}])
    assert reasoning.opened_by_prompt  # the template opened <think>: the output closes it
    output = "\nTwo and two.\n</think>\n\n4<|user|>"
    parsed = ChatOutputParser(None, reasoning, specials=("<|user|>",)).parse(output)
    assert (parsed.reasoning, parsed.content) == ("\nTwo and two.\n", "\n\n4")
    for deltas in _every_cut(
        lambda: ChatOutputParser(None, reasoning, specials=("<|user|>",)), output
    ):
        content, _, thinking = _reassemble(deltas)
        assert (thinking, content) == (parsed.reasoning, parsed.content)


def test_thinking_then_a_call(tokenizer, glm4):
    reasoning = _z1(tokenizer, [{"role": "user", "content": "Paris?"}], TOOLS)
    output = 'I should look it up.</think>get_weather\n{"location": "Paris"}<|observation|>'
    parsed = ChatOutputParser(glm4, reasoning).parse(output)
    assert parsed.reasoning == "I should look it up." and parsed.content is None
    assert parsed.tool_calls[0].function.arguments == '{"location": "Paris"}'
    for deltas in _every_cut(lambda: ChatOutputParser(glm4, reasoning), output):
        content, calls, thinking = _reassemble(deltas)
        assert thinking == "I should look it up." and content is None
        assert [c["arguments"] for c in calls] == ['{"location": "Paris"}']


def test_thinking_cut_by_max_tokens_is_all_reasoning(tokenizer):
    reasoning = _z1(tokenizer, [{"role": "user", "content": "2+2?"}])
    parsed = ChatOutputParser(None, reasoning).parse("Two and")
    assert (parsed.reasoning, parsed.content) == ("Two and", None)


def test_a_whole_output_keeps_an_end_that_could_have_begun_a_thinking_mark(tokenizer):
    """Cut short in what might have become ``</think>`` or ``<think>``: the whole output, parsed
    or in its last delta, holds nothing back."""
    reasoning = _z1(tokenizer, [{"role": "user", "content": "2+2?"}])
    assert ChatOutputParser(None, reasoning).parse("Two and </thi").reasoning == "Two and </thi"
    last = ChatOutputParser(None, reasoning).delta("Two and </thi", finished=True)
    assert (last.reasoning, last.content) == ("Two and </thi", None)
    prompt = render_published("GLM-4-9B-0414", [{"role": "user", "content": "2+2?"}])
    no_thinking = ReasoningParserManager.get_reasoning_parser("glm4")(tokenizer, prompt)
    assert ChatOutputParser(None, no_thinking).parse("<thi").content == "<thi"
    assert ChatOutputParser(None, no_thinking).delta("<thi", finished=True).content == "<thi"


def test_a_prompt_that_opens_no_thinking_starts_with_the_answer(tokenizer):
    prompt = render_published("GLM-4-9B-0414", [{"role": "user", "content": "2+2?"}])
    reasoning = ReasoningParserManager.get_reasoning_parser("glm4")(tokenizer, prompt)
    assert ChatOutputParser(None, reasoning).parse("\n4").content == "\n4"
    parsed = ChatOutputParser(None, reasoning).parse("<think>hm</think>4")
    assert (parsed.reasoning, parsed.content) == ("hm", "4")


def test_streamed_thinking_is_sent_under_both_names(tokenizer):
    reasoning = _z1(tokenizer, [{"role": "user", "content": "2+2?"}])
    parser = ChatOutputParser(None, reasoning)
    first = parser.delta("Two", finished=False)
    assert (first.reasoning_content, first.reasoning, first.content) == ("Two", "Two", None)
    assert parser.delta("Two", finished=False) is None
    last = parser.delta("Two and two.</think>4", finished=True)
    assert (last.reasoning_content, last.reasoning, last.content) == (" and two.", " and two.", "4")


def test_thinking_that_never_ends_has_no_answer_streamed(tokenizer):
    reasoning = _z1(tokenizer, [{"role": "user", "content": "2+2?"}])
    last = ChatOutputParser(None, reasoning).delta("Two and", finished=True)
    assert (last.reasoning, last.content, last.tool_calls) == ("Two and", None, None)


def test_no_reasoning_fields_when_the_client_does_not_want_them(tokenizer):
    reasoning = _z1(tokenizer, [{"role": "user", "content": "2+2?"}])
    parser = ChatOutputParser(None, reasoning, include_reasoning=False)
    assert parser.parse("hm</think>4").reasoning is None
    assert (
        ChatOutputParser(None, reasoning, include_reasoning=False)
        .delta("hm</think>4", True)
        .reasoning
        is None
    )


def _glm4_reasoning(tokenizer, prompt: str):
    return ReasoningParserManager.get_reasoning_parser("glm4")(tokenizer, prompt)


def test_a_prompt_opens_the_thinking_when_it_ends_in_think_whitespace_aside(tokenizer):
    assert _glm4_reasoning(tokenizer, "<|assistant|>\n<think>\n ").opened_by_prompt
    assert _glm4_reasoning(tokenizer, "<|assistant|>\n<think>").opened_by_prompt
    assert not _glm4_reasoning(tokenizer, "<|assistant|><think>x").opened_by_prompt
    assert not _glm4_reasoning(tokenizer, "<think>\n<|assistant|>").opened_by_prompt


@pytest.mark.parametrize(
    "text, final, expected",
    [
        ("hm</think>4", True, ("hm", "4")),
        ("hm</think>4", False, ("hm", "4")),
        ("hm</thi", False, ("hm", None)),  # may be the end of the thinking: held back
        ("hm</thi", True, ("hm</thi", None)),
        ("hm", True, ("hm", None)),
        ("a</think>b</think>c", True, ("a", "b</think>c")),
        ("</think>4", True, ("", "4")),  # no thinking at all: the mark opens the output
        ("", False, ("", None)),
    ],
)
def test_a_thinking_the_prompt_opened_ends_at_its_mark(tokenizer, text, final, expected):
    reasoning = _glm4_reasoning(tokenizer, "<|assistant|>\n<think>")
    assert reasoning.split(text, final) == expected


@pytest.mark.parametrize(
    "text, final, expected",
    [
        ("4", True, (None, "4")),
        ("\n4", False, (None, "\n4")),
        ("  <think>hm</think>4", True, ("hm", "4")),
        ("<think>hm", True, ("hm", None)),
        ("<think>hm</th", False, ("hm", None)),
        ("\n<thi", False, (None, None)),  # may be opening its thinking
        ("\n<thi", True, (None, "\n<thi")),
        ("", False, (None, "")),
        ("\n", False, (None, "\n")),
        ("<b>", False, (None, "<b>")),
    ],
)
def test_without_a_thinking_opened_by_the_prompt_the_output_may_open_one(
    tokenizer, text, final, expected
):
    reasoning = _glm4_reasoning(tokenizer, "<|assistant|>")
    assert reasoning.split(text, final) == expected


def test_the_end_of_thinking_is_kept_in_the_text_where_it_is_a_special_token(tokenizer, tmp_path):
    from tests.helpers.models import SPECIAL_TOKENS, build_tiny_tokenizer

    params = SamplingParams()
    _glm4_reasoning(tokenizer, "<think>").adjust_request(params)
    assert params.skip_special_tokens is True  # the demo's </think> is text
    special = Tokenizer(
        build_tiny_tokenizer(tmp_path, special_tokens=(*SPECIAL_TOKENS, "</think>"))
    )
    _glm4_reasoning(special, "<think>").adjust_request(params)
    assert params.skip_special_tokens is False


def test_the_thinking_before_a_constrained_answer(tokenizer, tmp_path):
    from tests.helpers.models import SPECIAL_TOKENS, build_tiny_tokenizer

    assert _glm4_reasoning(tokenizer, "<|assistant|>").grammar_prefix() is None
    assert _glm4_reasoning(tokenizer, "<|assistant|>\n<think>").grammar_prefix() == (
        'thinking[stop="</think>"]: /(?s:.*)/',
        'thinking "\\n"*',
    )
    special = Tokenizer(
        build_tiny_tokenizer(tmp_path, special_tokens=(*SPECIAL_TOKENS, "</think>"))
    )
    assert _glm4_reasoning(special, "<think>").grammar_prefix() == (
        "THINKING: /(?s:.*)/",
        'THINKING </think> "\\n"*',
    )


def test_a_reasoning_parser_by_default_keeps_the_request_and_has_no_prefix(tokenizer):
    from pagedserve.server.reasoning_parsers import ReasoningParser

    parser = ReasoningParser(tokenizer, "the prompt")
    assert (parser.tokenizer, parser.prompt) == (tokenizer, "the prompt")
    params = SamplingParams()
    parser.adjust_request(params)
    assert params.skip_special_tokens is True and parser.grammar_prefix() is None
    with pytest.raises(NotImplementedError):
        parser.split("x", True)


def test_a_reasoning_parser_registers_under_each_name():
    from pagedserve.server.reasoning_parsers import ReasoningParser

    @ReasoningParserManager.register_module("think-a", "think-b")
    class Mine(ReasoningParser):
        pass

    try:
        assert ReasoningParserManager.get_reasoning_parser("think-a") is Mine
        assert ReasoningParserManager.get_reasoning_parser("think-b") is Mine
    finally:
        for name in ("think-a", "think-b"):
            ReasoningParserManager.reasoning_parsers.pop(name, None)


# ---- what every parser shares --------------------------------------------------------------------
PLUGIN = """
from pagedserve.server.tool_parsers import TextSegment, ToolParser, ToolParserManager


@ToolParserManager.register_module("plugin-a", "plugin-b")
class PluginParser(ToolParser):
    def segments(self, text, final):
        return [TextSegment(text)]
"""


def test_a_plugin_file_registers_its_parser_under_each_name(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(PLUGIN)
    ToolParserManager.import_tool_parser(str(plugin))
    try:
        a = ToolParserManager.get_tool_parser("plugin-a")
        assert a is ToolParserManager.get_tool_parser("plugin-b")
        assert a.__name__ == "PluginParser" and a.__module__ == "pagedserve_tool_plugin_my_parser"
    finally:
        for name in ("plugin-a", "plugin-b"):
            ToolParserManager.tool_parsers.pop(name, None)


def test_a_plugin_that_is_not_a_file_or_fails_to_run_is_an_error_naming_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        ToolParserManager.import_tool_parser(str(tmp_path / "none.py"))
    assert str(e.value) == f"--tool-parser-plugin {tmp_path / 'none.py'}: no such file"
    with pytest.raises(FileNotFoundError):
        ToolParserManager.import_tool_parser(str(tmp_path))  # a directory
    broken = tmp_path / "broken.py"
    broken.write_text("oops")
    with pytest.raises(ValueError) as e:
        ToolParserManager.import_tool_parser(str(broken))
    assert str(e.value) == (
        f"--tool-parser-plugin {broken} failed to load: NameError: name 'oops' is not defined"
    )


def test_an_unknown_parser_name_lists_the_parsers():
    with pytest.raises(ValueError) as e:
        ToolParserManager.get_tool_parser("hermes")
    assert str(e.value) == (
        "--tool-call-parser hermes: no such parser; the parsers are glm4, glm45, glm47 (a file "
        "given to --tool-parser-plugin can register another)"
    )
    with pytest.raises(ValueError) as e:
        ReasoningParserManager.get_reasoning_parser("deepseek_r1")
    assert str(e.value) == "--reasoning-parser deepseek_r1: no such parser; the parsers are glm4"


def test_an_unknown_reasoning_parser_name_lists_every_registered_parser():
    from pagedserve.server.reasoning_parsers import ReasoningParser

    ReasoningParserManager.register_module("think-a")(type("Mine", (ReasoningParser,), {}))
    try:
        with pytest.raises(ValueError) as e:
            ReasoningParserManager.get_reasoning_parser("deepseek_r1")
    finally:
        ReasoningParserManager.reasoning_parsers.pop("think-a", None)
    assert str(e.value).endswith("the parsers are glm4, think-a")


def test_the_parsers_are_registered_by_their_names():
    assert ToolParserManager.get_tool_parser("glm45") is ToolParserManager.get_tool_parser("glm47")
    assert ToolParserManager.get_tool_parser("glm4").__name__ == "Glm4ToolParser"


def test_a_parser_keeps_special_tokens_in_the_text(glm4):
    params = SamplingParams()
    glm4.adjust_request(params)
    assert params.skip_special_tokens is False


def test_a_special_token_is_named_in_a_grammar_and_other_text_quoted(tokenizer, glm4):
    assert glm4.token("<|assistant|>") == "<|assistant|>" and glm4.has_special("<|assistant|>")
    assert glm4.token("<tool_call>") == '"<tool_call>"' and not glm4.has_special("<tool_call>")
    assert glm4.token("get_time") == '"get_time"'  # a word of the vocabulary, not special
    assert not is_special_token(None, "<|assistant|>")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("abc<|obs", 5),
        ("abc<", 1),
        ("abc", 0),
        ("", 0),
        ("<|observation|", 14),  # the longest start of a mark, one short of it
        ("x<|user", 6),
        ("<|u", 3),
    ],
)
def test_the_end_of_the_text_that_may_begin_a_mark_is_held_back(text, expected):
    assert partial_mark_length(text, "<|observation|>", "<|user|>") == expected


def test_the_arguments_schema_of_a_tool():
    def schema(parameters, enforced=None):
        function = {"name": "f"} if parameters is None else {"name": "f", "parameters": parameters}
        tool = ChatCompletionToolsParam(type="function", function=function)
        return ToolParser.arguments_schema(tool, enforced)

    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    assert schema(None) == no_arguments
    assert schema({"properties": {"a": {}}}) == {"type": "object", "properties": {"a": {}}}
    assert schema({"type": "object", "required": []}) == {"type": "object", "required": []}
    assert schema({"type": "object", "required": ["a"]}, enforced={"g"}) == {"type": "object"}
    assert schema({"type": "object", "required": ["a"]}, enforced={"f"})["required"] == ["a"]


def test_a_json_rule_is_strict_and_tight():
    rule = ToolParser.json_rule({"type": "object", "properties": {"a": {"type": "string"}}})
    assert rule.startswith("%json ")
    body = json.loads(rule.removeprefix("%json "))
    assert body["additionalProperties"] is False and body["x-guidance"] == JSON_OPTIONS
    assert json.loads(ToolParser.json_rule(None).removeprefix("%json "))["properties"] == {}
    assert "é" in ToolParser.json_rule({"description": "é"})  # not escaped


def test_auto_starts_with_free_text_or_calls(glm4):
    assert glm4.auto_start() == "FREE | calls"


def test_content_beside_calls_is_none_unless_it_has_text(glm4):
    found = glm4.extract_tool_calls("get_time\n{}<|observation|>")
    assert (found.tools_called, found.content) == (True, None)
    found = glm4.extract_tool_calls("  <|assistant|>get_time\n{}<|observation|>")
    assert (found.tools_called, found.content) == (True, None)
    found = glm4.extract_tool_calls("\n \n<|user|>")
    assert (found.tools_called, found.tool_calls, found.content) == (False, [], "\n \n")
    found = glm4.extract_tool_calls(
        'get_weather\n{"location": "Paris"}<|assistant|>get_time\n{}', False
    )
    assert [c.function.name for c in found.tool_calls] == ["get_weather"]


def test_a_call_whose_arguments_are_not_an_object_says_why():
    assert CallSegment("f", "{}", "").error() is None
    assert CallSegment("f", "[1]", "").error() == "arguments are not a JSON object"
    assert CallSegment("f", "{", "").error().startswith("arguments are not JSON (")


# ---- any output at all --------------------------------------------------------------------------
# Calls in both formats (of declared functions and of others), markers, JSON and text pieces, in
# any order: what a small or confused model may write.
NAMES = st.sampled_from(["get_weather", "get_time", "get_stock"])
ARGUMENTS = st.dictionaries(
    st.sampled_from(["location", "unit"]),
    st.sampled_from(["Paris", "巴黎", " New York\n", "celsius", 1, [1, 2], {"a": None}]),
    max_size=2,
)
GLM4_CALLS = st.builds(lambda n, a: f"{n}\n{json.dumps(a, ensure_ascii=False)}", NAMES, ARGUMENTS)
GLM45_CALLS = st.builds(
    lambda n, a, sep: (
        f"<tool_call>{n}{sep}"
        + "".join(
            f"<arg_key>{k}</arg_key>{sep}<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
            f"</arg_value>{sep}"
            for k, v in a.items()
        )
        + "</tool_call>"
    ),
    NAMES,
    ARGUMENTS,
    st.sampled_from(["", "\n"]),
)
PIECES = st.sampled_from(
    [
        *("get_weather", "get_", "Paris", "x", " ", "\n", "\\", "{", "}", '"', ":", ","),
        *("<|assistant|>", "<|observation|>", "<|user|>", "<|endoftext|>", "<think>", "</think>"),
        *("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    ]
)
OUTPUTS = st.lists(st.one_of(PIECES, GLM4_CALLS, GLM45_CALLS), max_size=12).map("".join)


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        return False


@settings(max_examples=500)
@given(
    output=OUTPUTS,
    name=st.sampled_from(["glm4", "glm45"]),
    thinking=st.booleans(),
    parallel=st.booleans(),
    cut=st.integers(1, 200),
)
def test_any_output_parses_without_error_and_its_stream_adds_up(
    tokenizer, output, name, thinking, parallel, cut
):
    """A malformed output is text, never an exception (the server's 500): the whole output's
    calls are declared functions with object arguments, and a stream, piece by piece or in two,
    adds up to the whole (but for a call already streamed whose arguments end up not JSON,
    which stays a call)."""
    parser = ToolParserManager.get_tool_parser(name)(tokenizer, _tools(TOOLS))
    prompt = "<|assistant|>\n<think>" if thinking else "<|assistant|>"
    reasoning = ReasoningParserManager.get_reasoning_parser("glm4")(tokenizer, prompt)
    whole = ChatOutputParser(parser, reasoning, parallel).parse(output)
    for c in whole.tool_calls:
        assert c.function.name in parser.tools and _is_object(c.function.arguments)
    pieces = _pieces(output) or [""]
    cut = min(cut, len(pieces))
    for deliveries in (pieces, ["".join(pieces[:cut]), "".join(pieces[cut:])]):
        content, calls, thinking_text = _reassemble(
            _stream(ChatOutputParser(parser, reasoning, parallel), deliveries)
        )
        assert (thinking_text or None) == (whole.reasoning or None)
        streamed = [(c["name"], c["arguments"]) for c in calls]
        expected = [(c.function.name, c.function.arguments) for c in whole.tool_calls]
        bad = next((i for i, c in enumerate(calls) if not _is_object(c["arguments"])), None)
        if bad is None:
            assert streamed == expected and (content or None) == (whole.content or None)
        else:  # the whole output has that call's text as content
            assert streamed[:bad] == expected[:bad]
            assert calls[bad]["arguments"] in (whole.content or "")
