"""What the commands share: a help formatter that shows each option's default, the names a
flag's shell completion offers, and finding a subcommand's parser."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names one; a switch
    that takes no value is off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings:
            return text
        if action.nargs == 0 and action.default in (None, False):
            return f"{text} (default: off)"
        if not _has_default(action):
            return text
        return f"{text} (default: %(default)s)"


def _has_default(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.default not in (None, False, argparse.SUPPRESS)


def document_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse prints no help line, so no default, for an option without help: give it one."""
    for action in parser._actions:
        if not action.help and _has_default(action):
            action.help = "default: %(default)s"
    return parser


def offer(action: argparse.Action, names) -> argparse.Action:
    """Let completion offer ``names`` (besides file names) for a flag that also takes a path, as
    ``--device`` takes a preset name or a preset file. argparse's ``choices`` would refuse the
    path."""
    action.completion_names = [str(n) for n in names]
    return action


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._subparsers._group_actions:
        if name in action.choices:
            return action.choices[name]
    raise KeyError(name)
