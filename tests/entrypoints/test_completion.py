"""`pagedserve completion bash|zsh`: scripts generated from the parser, valid for their shell,
completing the subcommands, each subcommand's flags and the choices of a flag."""

from __future__ import annotations

import subprocess

import pytest

from pagedserve.entrypoints.cli.completion import bash_script, zsh_script
from pagedserve.entrypoints.cli.main import build_parser, main
from pagedserve.entrypoints.cli.utils import subparser
from tests.helpers.tools import missing_tool, which

COMMANDS = ["serve", "smi", "tune", "bench", "quantize", "eval-quant", "completion"]


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.fixture(scope="module")
def bash_file(parser, tmp_path_factory):
    path = tmp_path_factory.mktemp("completion") / "pagedserve.bash"
    path.write_text(bash_script(parser))
    return path


def _complete(script, line: str) -> list[str]:
    """What bash offers for the last word of ``line`` (a trailing space: a new, empty word)."""
    words = line.split() + ([""] if line.endswith(" ") else [])
    quoted = " ".join(f"'{w}'" for w in words)
    program = (
        f"source '{script}'; COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; "
        'COMPREPLY=(); _pagedserve; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    return [w for w in out.stdout.split("\n") if w]


def _options(parser, command: str) -> set[str]:
    sub = subparser(parser, command)
    return {name for a in sub._actions for name in a.option_strings}


def test_bash_script_is_valid_bash_and_registers_the_completion(bash_file):
    subprocess.run(["bash", "-n", str(bash_file)], check=True)
    out = subprocess.run(
        ["bash", "-c", f"source '{bash_file}'; complete -p pagedserve"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "-F _pagedserve" in out.stdout


def test_bash_completes_every_subcommand_and_the_top_level_flags(bash_file):
    assert set(_complete(bash_file, "pagedserve ")) == {*COMMANDS, "-h", "--help", "--version"}
    assert _complete(bash_file, "pagedserve s") == ["serve", "smi"]


@pytest.mark.parametrize("command", COMMANDS)
def test_bash_completes_each_subcommands_flags_as_its_parser_has_them(parser, bash_file, command):
    assert set(_complete(bash_file, f"pagedserve {command} -")) == _options(parser, command)


def test_bash_completes_serve_flags_after_other_flags_and_values(bash_file):
    offered = _complete(bash_file, "pagedserve serve --enforce-eager --port 8001 --max-n")
    assert offered == ["--max-num-seqs", "--max-num-batched-tokens"]


def test_bash_completes_the_choices_of_a_flag_and_of_a_positional(bash_file):
    assert _complete(bash_file, "pagedserve serve --dtype ") == [
        "auto",
        "float32",
        "bfloat16",
        "float16",
    ]
    assert _complete(bash_file, "pagedserve serve --dtype bf") == ["bfloat16"]
    assert _complete(bash_file, "pagedserve bench --endpoint ") == ["completions", "chat"]
    assert _complete(bash_file, "pagedserve completion ") == ["bash", "zsh"]


def test_bash_offers_nothing_of_its_own_after_a_flag_that_takes_a_path(bash_file):
    # an empty reply: `complete -o default` falls back to file and directory names
    assert _complete(bash_file, "pagedserve serve --tokenizer ") == []


def test_bash_offers_device_presets_and_files_after_device(bash_file, tmp_path, monkeypatch):
    from pagedserve.presets import preset_names

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-card.yaml").write_text("backend: cpu\n")
    offered = _complete(bash_file, "pagedserve serve --device ")
    assert set(offered) == {"kunlun-emu", "cpu", "cuda", *preset_names("devices"), "my-card.yaml"}
    assert _complete(bash_file, "pagedserve serve --device kunlun-p") == ["kunlun-p800x8"]
    assert _complete(bash_file, "pagedserve tune --device my") == ["my-card.yaml"]
    assert "glm-4-9b-0414" in _complete(bash_file, "pagedserve tune --model ")
    assert _complete(bash_file, "pagedserve serve --model de") == ["demo"]


def test_completion_command_prints_the_script(capsys):
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("# bash completion for pagedserve")
    assert "complete -o default -F _pagedserve pagedserve" in script
    with pytest.raises(SystemExit):
        main(["completion", "fish"])


def test_zsh_script_lists_every_subcommand_and_flag(parser):
    script = zsh_script(parser)
    assert script.startswith("#compdef pagedserve")
    for command in COMMANDS:
        assert f"\n        '{command}:" in script
        for option in _options(parser, command):
            assert f"'{option}[" in script, (command, option)
    assert ":dtype:(auto float32 bfloat16 float16)'" in script
    assert ":device:{compadd -- kunlun-emu cpu cuda " in script


def test_zsh_script_is_valid_zsh(parser, tmp_path):
    if which("zsh") is None:
        missing_tool("zsh is not installed: apt-get install -y zsh")
    path = tmp_path / "_pagedserve"
    path.write_text(zsh_script(parser))
    subprocess.run(["zsh", "-n", str(path)], check=True)
