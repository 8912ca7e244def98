"""How every command describes itself: its help, each option's default, ``--state-file``.

The one help formatter and the one way to add a command, so that ``sandboxkit CMD --help``
reads the same for every command: a description made from the help line, and every
option's default at the end of its help.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["STATE_FILE_HELP", "HelpWithDefaults", "add_command", "add_state_file"]

STATE_FILE_HELP = (
    "the daemon's state file (url, pid, token); default: this install's local daemon, "
    "found through $SANDBOXKIT_STATE_FILE, else $XDG_RUNTIME_DIR/sandboxkit/daemon.json, "
    "else ~/.sandboxkit/daemon.json"
)
"""The help of ``--state-file`` for the commands that talk to a running daemon."""


class HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names it (or
    it is an off-by-default flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        if action.default == argparse.SUPPRESS:
            return text
        if isinstance(action.default, list):
            return text + " (default: " + " ".join(map(str, action.default)) + ")"
        return text + " (default: %(default)s)"


def add_command(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    """Add the command ``name`` to the subparsers ``sub``; ``help`` is its line in
    ``sandboxkit --help`` and, capitalised, its description."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=help[0].upper() + help[1:] + ".",
        formatter_class=HelpWithDefaults,
    )
    return parser


def add_state_file(parser: argparse.ArgumentParser) -> None:
    """The ``--state-file`` option of a command that talks to a running daemon."""
    parser.add_argument("--state-file", help=STATE_FILE_HELP)
