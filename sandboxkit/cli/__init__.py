"""sandboxkit: local sandboxes for long-lived processes whose output streams never stall.

Commands: serve (run a daemon in the foreground), status (the local daemon and its live
sandboxes), ps (sandboxes and their processes), run (start a command, in a new sandbox or
a named one), kill (kill a sandbox), pause and resume (a sandbox), logs (print or follow a
process's output from a cursor), stop (stop the local daemon), demo (the stall experiment,
on a private daemon), tour (a walk through the runtime, on a private daemon).

Without --state-file, the commands find this install's local daemon through the state
file: $SANDBOXKIT_STATE_FILE, else $XDG_RUNTIME_DIR/sandboxkit/daemon.json, else
~/.sandboxkit/daemon.json (a daemon of another sandboxkit install there is left alone).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from sandboxkit._version import __version__
from sandboxkit.cli import demos, processes, sandboxes, serve
from sandboxkit.daemon.config import DaemonConfig

__all__ = ["main"]

# Where each command lives: serve.py (serve, stop), sandboxes.py (status, ps, kill, pause,
# resume), processes.py (run, logs), demos.py (demo, tour); options.py is how each
# describes itself, find_daemon.py how each finds the daemon it talks to.

# Read here by tests/test_cli.py, which holds serve's defaults to the config's (and
# patches DaemonConfig in this module, which _parser reads for them).
_CONFIG_OPTIONS = serve.CONFIG_OPTIONS


def _parser() -> argparse.ArgumentParser:
    """The whole command line; ``sandboxkit --help`` lists the commands in this order."""
    parser = argparse.ArgumentParser(
        prog="sandboxkit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_serve(sub, DaemonConfig())  # the defaults of the options that set its fields
    sandboxes.add_status(sub)
    sandboxes.add_ps(sub)
    sandboxes.add_kill(sub)
    sandboxes.add_pause_resume(sub)
    processes.add_logs(sub)
    processes.add_run(sub)
    serve.add_stop(sub)
    demos.add_demo(sub)
    demos.add_tour(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sandboxkit`` command."""
    args = _parser().parse_args(argv)
    try:
        result: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`sandboxkit ps | head`): stop quietly, as a process that
        # SIGPIPE ended would. Python ignores SIGPIPE, so the write raised instead; point
        # stdout at /dev/null so the interpreter's last flush has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    return result
