"""``pagedserve serve``'s tool flags, vLLM's names: ``--enable-auto-tool-choice``,
``--tool-call-parser``, ``--tool-parser-plugin``, ``--reasoning-parser``, ``--chat-template``;
a bad one is an error naming the flag, before any model loads. A plugin's parser reads the calls
of a server started with it."""

from __future__ import annotations

import json

import openai
import pytest

from pagedserve.entrypoints.cli.main import build_parser
from pagedserve.entrypoints.cli.serve import run_serve, tool_settings
from pagedserve.models.chat_templates import builtin_chat_template
from pagedserve.server.tool_parsers import Glm4ToolParser, ToolParserManager
from pagedserve.testing import serve

PLUGIN = '''
from pagedserve.server.tool_parsers import Glm4ToolParser, ToolParserManager


@ToolParserManager.register_module("my-glm")
class MyParser(Glm4ToolParser):
    """GLM-4's form, registered under a name of its own."""
'''


# A format of its own, which no built-in parser reads: ">> name {arguments}".
ARROW_PLUGIN = """
from pagedserve.server.tool_parsers import CallSegment, TextSegment, ToolParser, ToolParserManager


@ToolParserManager.register_module("arrow")
class ArrowToolParser(ToolParser):
    def segments(self, text, final):
        text = text.split("<|")[0]  # the special token that ended the turn
        if not text.startswith(">>"):
            held = not final and ">>".startswith(text)
            return [] if held else [TextSegment(text)]
        name, space, arguments = text[2:].strip().partition(" ")
        if name not in self.tools:
            return [TextSegment(text)] if final or space else []
        arguments = arguments.strip() or ("{}" if final else "")
        return [CallSegment(name, arguments, text)]
"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _args(*flags: str):
    return build_parser(["serve"]).parse_args(["serve", *flags])


def test_the_flags_reach_the_app():
    settings = tool_settings(
        _args(
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "glm4",
            "--reasoning-parser",
            "glm4",
            "--chat-template",
            "glm-z1-0414",
        )
    )
    assert settings == {
        "tool_call_parser": "glm4",
        "enable_auto_tool_choice": True,
        "reasoning_parser": "glm4",
        "chat_template": builtin_chat_template("glm-z1-0414"),
    }
    assert tool_settings(_args())["chat_template"] is None  # the model's own (or its built-in)


def test_a_plugin_file_registers_a_parser(tmp_path, monkeypatch):
    # the plugin registers in this process: into a copy, so that later tests see the built-ins
    monkeypatch.setattr(ToolParserManager, "tool_parsers", dict(ToolParserManager.tool_parsers))
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(PLUGIN)
    flags = ("--tool-parser-plugin", str(plugin), "--tool-call-parser", "my-glm")
    assert tool_settings(_args(*flags))["tool_call_parser"] == "my-glm"
    parser = ToolParserManager.get_tool_parser("my-glm")
    assert issubclass(parser, Glm4ToolParser) and parser.__name__ == "MyParser"


def test_a_server_started_with_a_plugin_reads_calls_in_its_format(tmp_path):
    plugin = tmp_path / "arrow_parser.py"
    plugin.write_text(ARROW_PLUGIN)
    flags = ["--tool-parser-plugin", str(plugin), "--tool-call-parser", "arrow"]
    flags += ["--enable-auto-tool-choice", "--device", "cpu", "--max-model-len", "512"]
    request = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [WEATHER],
        "max_tokens": 32,
        "temperature": 0,
        "extra_body": {"guided_regex": r'>> get_weather \{"city": "Rome"\}'},
    }
    with serve(*flags) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        whole = client.chat.completions.create(**request).choices[0]
        with client.chat.completions.stream(**request) as stream:
            streamed = stream.get_final_completion().choices[0]
    for choice in (whole, streamed):
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Rome"}


@pytest.mark.parametrize(
    "flags, named",
    [
        (("--tool-call-parser", "hermes"), "--tool-call-parser hermes: no such parser"),
        (("--enable-auto-tool-choice",), "--enable-auto-tool-choice needs --tool-call-parser"),
        (("--reasoning-parser", "deepseek_r1"), "--reasoning-parser deepseek_r1: no such parser"),
        (("--chat-template", "glm5"), "--chat-template glm5: not a file"),
        (("--tool-parser-plugin", "/nonexistent.py"), "--tool-parser-plugin /nonexistent.py"),
        (("--tool-parser-plugin", "BROKEN"), "failed to load: NameError: name 'oops'"),
    ],
)
def test_a_bad_flag_is_an_error_naming_it_before_the_model_loads(flags, named, capsys, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("oops\n")
    flags = tuple(str(broken) if f == "BROKEN" else f for f in flags)
    assert run_serve(_args("--model", "/nonexistent-model", *flags)) == 2
    err = capsys.readouterr().err
    assert named in err and "/nonexistent-model" not in err
