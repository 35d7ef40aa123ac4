"""`--help` of every command shows each option's default."""

from __future__ import annotations

import argparse
import re

import pytest

from pagedserve.cli import _subparser, build_parser

COMMANDS = ["serve", "smi", "tune", "bench", "quantize", "eval-quant"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_the_default_of_every_option_that_has_one(command):
    parser = _subparser(build_parser(), command)
    formatter = parser._get_formatter()
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        shown = formatter._expand_help(action) if action.help else ""
        assert str(action.default) in shown, f"{command} {action.option_strings[0]}: {shown!r}"
        checked += 1
    assert checked


def test_serve_help_shows_host_and_port_defaults():
    text = re.sub(r"\s+", " ", _subparser(build_parser(), "serve").format_help())
    assert (
        "--host HOST address to listen on; 0.0.0.0 for all interfaces (default: 127.0.0.1)" in text
    )
    assert "--port PORT TCP port to listen on (default: 8000)" in text
