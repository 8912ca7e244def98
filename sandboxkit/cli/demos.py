"""``sandboxkit demo`` and ``sandboxkit tour`` from the command line: their options; the
runs themselves, each on a private daemon, are :mod:`sandboxkit.demo`'s."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sandboxkit.cli.options import add_command
from sandboxkit.daemon.config import LabDefaults
from sandboxkit.lab_options import FANOUT_POLICIES, GHOST_KINDS

__all__ = ["add_demo", "add_tour"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from sandboxkit.demo import run_experiment

    return run_experiment(
        cycles=args.cycles,
        policies=args.policies,
        ghosts=args.ghost,
        out=Path(args.out),
        deadline=args.deadline,
        kick_grace=args.kick_grace,
        progress=not args.no_progress,
        client=args.client,
    )


def _cmd_tour(args: argparse.Namespace) -> int:
    from sandboxkit.demo import run_tour

    return run_tour(lines=args.lines)


def add_demo(sub: Any) -> None:
    """The ``demo`` command."""
    demo = add_command(
        sub,
        "demo",
        "the stall experiment on a private daemon: policies x ghosts, stall table, CSV and PNG",
    )
    demo.add_argument(
        "--cycles", type=int, default=6, help="pause/resume/reattach cycles per policy"
    )
    demo.add_argument(
        "--policies",
        nargs="+",
        default=list(FANOUT_POLICIES),
        choices=FANOUT_POLICIES,
        help="fan-out policies to compare",
    )
    demo.add_argument(
        "--ghost",
        nargs="+",
        default=["pause-snapshot"],
        choices=GHOST_KINDS,
        help="what a stream open at a pause becomes",
    )
    demo.add_argument("--out", default="demo-output", help="folder for the CSV and PNG files")
    demo.add_argument(
        "--deadline",
        type=float,
        default=3.0,
        help="seconds a refresh may take before it counts as stalled",
    )
    demo.add_argument(
        "--kick-grace",
        type=float,
        default=None,
        help="seconds the kick policy waits on a full queue (default: the daemon's, "
        f"{LabDefaults().kick_grace:g})",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument(
        "--client",
        choices=["sandboxkit", "e2b"],
        default="sandboxkit",
        help="who reattaches: sandboxkit's client, or the official e2b SDK through the "
        "daemon's envd endpoint (needs pip install e2b)",
    )
    demo.set_defaults(func=_cmd_demo)


def add_tour(sub: Any) -> None:
    """The ``tour`` command."""
    tour = add_command(
        sub,
        "tour",
        "a walk through the runtime on a private daemon: two consumers, pause/resume, "
        "reattach by cursor",
    )
    tour.add_argument("--lines", type=int, default=120, help="lines the example process prints")
    tour.set_defaults(func=_cmd_tour)
