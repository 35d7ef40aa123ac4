"""``pagedserve`` command line: ``serve``, ``smi``, ``tune``, ``bench``, ``quantize``, ``eval-quant``,
``completion``; ``pagedserve --version``.

``serve``'s flags are vLLM's names (with SGLang's ``--mem-fraction-static`` and ``--tp-size`` as
aliases) so that a vLLM launch script works unchanged.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

import pagedserve
from pagedserve.entrypoints.cli.serve import add_serve_args, apply_config_file, run_serve
from pagedserve.entrypoints.cli.utils import HelpFormatter, document_defaults

# What `pagedserve --help` says: this module's docstring as a reader of a terminal sees it (no reST)
DESCRIPTION = """\
A paged LLM inference engine for GLM-4 with an OpenAI-compatible server. Commands: serve, smi,
tune, bench, quantize, eval-quant, completion; pagedserve COMMAND --help for each.

serve's flags are vLLM's names (with SGLang's --mem-fraction-static and --tp-size as aliases) so
that a vLLM launch script works unchanged."""

# The subcommands whose modules are imported only when named (the others need torch or more):
# (name, help, module, the function that adds its flags, the function that runs it).
LAZY_COMMANDS = (
    ("tune", "size KV cache and batch limits for a model on a device",
     "pagedserve.entrypoints.cli.tune", "add_tune_args", "run_tune"),
    ("bench", "benchmark a running server (throughput, TTFT, ITL)",
     "pagedserve.entrypoints.cli.bench", "add_bench_args", "run_bench"),
    ("quantize", "quantize a checkpoint to int4",
     "pagedserve.entrypoints.cli.quantize", "add_quantize_args", "run_quantize"),
    ("eval-quant", "compare a quantized model with its 16-bit source",
     "pagedserve.entrypoints.cli.quantize", "add_eval_quant_args", "run_eval_quant"),
    ("completion", 'print a bash or zsh completion script: eval "$(pagedserve completion bash)"',
     "pagedserve.entrypoints.cli.completion", "add_completion_args", "run_completion"),
)  # fmt: skip


def _lazy_subcommand(
    subparsers, name: str, help_text: str, module: str, add: str, run: str, load: bool = True
) -> None:
    """``load=False``: listed with its help line only; its module (and torch) is not imported."""
    parser = subparsers.add_parser(
        name, help=help_text, description=help_text, formatter_class=HelpFormatter
    )
    if not load:
        return
    try:
        mod = __import__(module, fromlist=[add, run])
        document_defaults(getattr(mod, add)(parser))
        parser.set_defaults(func=getattr(mod, run))
    except (ImportError, AttributeError) as e:
        parser.add_argument("rest", nargs=argparse.REMAINDER)
        parser.set_defaults(func=_unavailable(name, module, e))


def _unavailable(name: str, module: str, error: Exception) -> Callable[[argparse.Namespace], int]:
    def run(_: argparse.Namespace) -> int:
        print(
            f"pagedserve {name}: not available in this build ({module}: {error})", file=sys.stderr
        )
        return 2

    return run


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``argv``, only the subcommand it names is imported in full,
    so that ``serve``'s HTTP process does not load torch for ``tune`` or ``quantize``."""
    from pagedserve.entrypoints.cli.smi import add_smi_args, run_smi

    if argv is None:
        chosen = None  # every subcommand loaded
    else:  # the command named, or "" for none (--version, --help): no subcommand loaded
        chosen = next((a for a in argv if not a.startswith("-")), "")

    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"pagedserve {pagedserve.__version__}"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server.",
        formatter_class=HelpFormatter,
    )
    document_defaults(add_serve_args(serve)).set_defaults(func=run_serve)
    smi = subparsers.add_parser(
        "smi",
        help="show a running server's device, memory and KV pages",
        description="nvidia-smi for a running pagedserve server.",
        formatter_class=HelpFormatter,
    )
    document_defaults(add_smi_args(smi)).set_defaults(func=run_smi)
    for name, help_text, module, add, run in LAZY_COMMANDS:
        _lazy_subcommand(subparsers, name, help_text, module, add, run, chosen in (None, name))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = apply_config_file(parser, argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad input: a message, not a traceback
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`pagedserve smi --json | head`): quiet, as cat is
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit's flush
        return 128 + signal.SIGPIPE  # what a shell reports for a program a closed pipe ended
