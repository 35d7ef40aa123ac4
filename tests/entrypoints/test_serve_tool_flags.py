"""``pagedserve serve``'s tool flags, vLLM's names: ``--enable-auto-tool-choice``,
``--tool-call-parser``, ``--tool-parser-plugin``, ``--reasoning-parser``, ``--chat-template``;
a bad one is an error naming the flag, before any model loads."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.cli.main import build_parser
from pagedserve.entrypoints.cli.serve import run_serve, tool_settings
from pagedserve.models.chat_templates import builtin_chat_template
from pagedserve.server.tool_parsers import Glm4ToolParser, ToolParserManager

PLUGIN = '''
from pagedserve.server.tool_parsers import Glm4ToolParser, ToolParserManager


@ToolParserManager.register_module("my-glm")
class MyParser(Glm4ToolParser):
    """GLM-4's form, registered under a name of its own."""
'''


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


def test_a_plugin_file_registers_a_parser(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(PLUGIN)
    flags = ("--tool-parser-plugin", str(plugin), "--tool-call-parser", "my-glm")
    assert tool_settings(_args(*flags))["tool_call_parser"] == "my-glm"
    parser = ToolParserManager.get_tool_parser("my-glm")
    assert issubclass(parser, Glm4ToolParser) and parser.__name__ == "MyParser"


@pytest.mark.parametrize(
    "flags, named",
    [
        (("--tool-call-parser", "hermes"), "--tool-call-parser hermes: no such parser"),
        (("--enable-auto-tool-choice",), "--enable-auto-tool-choice needs --tool-call-parser"),
        (("--reasoning-parser", "deepseek_r1"), "--reasoning-parser deepseek_r1: no such parser"),
        (("--chat-template", "glm5"), "--chat-template glm5: not a file"),
        (("--tool-parser-plugin", "/nonexistent.py"), "--tool-parser-plugin /nonexistent.py"),
    ],
)
def test_a_bad_flag_is_an_error_naming_it_before_the_model_loads(flags, named, capsys):
    assert run_serve(_args("--model", "/nonexistent-model", *flags)) == 2
    err = capsys.readouterr().err
    assert named in err and "/nonexistent-model" not in err
