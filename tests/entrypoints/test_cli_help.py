"""`--help` of every command shows each option's default; serve's flags are grouped as vLLM's
are; `--version`."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pagedserve
from pagedserve.entrypoints.cli.main import build_parser
from pagedserve.entrypoints.cli.utils import subparser

COMMANDS = ["serve", "smi", "tune", "bench", "quantize", "eval-quant"]  # completion: no defaults


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_the_default_of_every_option_that_has_one(command):
    parser = subparser(build_parser(), command)
    formatter = parser._get_formatter()
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        shown = formatter._expand_help(action) if action.help else ""
        assert str(action.default) in shown, f"{command} {action.option_strings[0]}: {shown!r}"
        checked += 1
    assert checked


def _shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return re.sub(r"\s+", " ", parser._get_formatter()._expand_help(action))


def _engine_defaults() -> dict:
    from pagedserve.config import EngineConfig

    sections = [field.annotation for field in EngineConfig.model_fields.values()]
    return {  # (speculative decoding is one flag of JSON, off by default)
        name: f.default
        for section in sections
        for name, f in getattr(section, "model_fields", {}).items()
    }


def _as_shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


@pytest.mark.parametrize("command", ["serve", "tune"])
def test_help_names_the_default_of_every_flag_as_the_engine_has_it(command):
    """README: `serve --help` lists each flag with its default. A flag left unset takes the
    engine's own default, so that is the one its help must name; tune plans for serve's."""
    from pagedserve.entrypoints.cli.serve import ENGINE_ARGS

    parser = subparser(build_parser(), command)
    engine = _engine_defaults()
    for action in parser._actions:
        if not action.option_strings or action.default is argparse.SUPPRESS or action.required:
            continue  # -h; tune's --model
        flag, shown = action.option_strings[0], _shown_help(parser, action)
        assert "default" in shown, f"{command} {flag} names no default: {shown!r}"
        if action.dest in ENGINE_ARGS and engine.get(action.dest) is not None:
            want = _as_shown(engine[action.dest])
            assert want in shown, f"{command} {flag}: {want} not in {shown!r}"


@pytest.mark.parametrize("argv", [[], *([command] for command in [*COMMANDS, "completion"])])
def test_help_is_plain_text_without_rest_markup(argv):
    parser = build_parser() if not argv else subparser(build_parser(), argv[0])
    text = parser.format_help()
    assert "``" not in text, text


def test_serve_help_shows_host_and_port_defaults():
    text = re.sub(r"\s+", " ", subparser(build_parser(), "serve").format_help())
    assert (
        "--host HOST address to listen on; 0.0.0.0 for all interfaces (default: 127.0.0.1)" in text
    )
    assert "--port PORT TCP port to listen on (default: 8000)" in text


SERVE_GROUPS = {  # vLLM's grouping of its own flags, as far as serve has them
    "Model": {"--model", "--tokenizer", "--served-model-name", "--dtype", "--quantization",
              "--max-model-len", "--seed"},
    "Cache": {"--block-size", "--gpu-memory-utilization", "--enable-prefix-caching"},
    "Scheduler": {"--max-num-seqs", "--max-num-batched-tokens"},
    "Device": {"--device", "--tensor-parallel-size", "--data-parallel-size",
               "--data-parallel-backend", "--ray-address"},
    "LoRA": {"--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank",
             "--max-cpu-loras"},
    "Server": {"--host", "--port", "--api-key", "--shutdown-timeout"},
    # not vLLM's: the flags of the data-parallel replicas on Ray Serve
    "Ray Serve": {"--request-router", "--router-imbalance-threshold", "--min-replicas",
                  "--max-replicas", "--target-ongoing-requests", "--max-ongoing-requests",
                  "--max-replicas-per-node", "--num-cpus-per-replica"},
}  # fmt: skip


def test_serve_help_groups_every_flag_as_vllm_does():
    serve = subparser(build_parser(), "serve")
    groups = {g.title: g for g in serve._action_groups}
    assert list(SERVE_GROUPS) == [t for t in groups if t in SERVE_GROUPS]
    grouped = set()
    for title, expected in SERVE_GROUPS.items():
        flags = {f for action in groups[title]._group_actions for f in action.option_strings}
        assert expected <= flags, (title, expected - flags)
        assert not flags & grouped, f"{title} repeats {flags & grouped}"
        grouped |= flags
    every = {f for action in serve._actions for f in action.option_strings}
    assert every - grouped == {"-h", "--help", "--config"}  # the file of flags stays on its own
    text = serve.format_help()
    positions = [text.index(f"\n{title}:\n") for title in SERVE_GROUPS]
    assert positions == sorted(positions)


def test_serve_config_file_still_reaches_flags_inside_groups(tmp_path):
    from pagedserve.entrypoints.cli.serve import apply_config_file

    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seqs: 3\nblock-size: 32\nport: 9001\ndevice: cpu\n")
    args = apply_config_file(build_parser(), ["serve", "--config", str(config), "--port", "9002"])
    assert (args.max_num_seqs, args.block_size, args.device, args.port) == (3, 32, "cpu", 9002)


def test_version_prints_the_installed_version_without_loading_torch():
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'\nversion = "{pagedserve.__version__}"\n' in pyproject
    program = (
        "import sys; from pagedserve.entrypoints.cli.main import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as e:\n    code = e.code\n"
        "print('torch' in sys.modules, code)"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines() == [f"pagedserve {pagedserve.__version__}", "False 0"]


@pytest.mark.parametrize(
    "argv",
    [["--version"], ["--help"], *([command, "--help"] for command in [*COMMANDS, "completion"])],
    ids=" ".join,
)
def test_help_and_version_start_without_importing_torch(argv):
    """What ``pagedserve`` imports before it prints: torch (seconds to import) only once a command
    runs that needs it, never for --version or a --help."""
    program = (
        "import sys; from pagedserve.entrypoints.cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[-1] == "False", f"pagedserve {' '.join(argv)} imported torch"
