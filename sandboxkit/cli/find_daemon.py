"""Finding the daemon a command talks to, and asking it: the state file, a probe, a GET.

A command that needs a running daemon says "no daemon running" (and fails) when the
state file names none that answers; ``serve`` and ``stop`` read the state file
themselves (``serve`` to refuse a second daemon, ``stop`` to end one that no longer
answers).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sandboxkit.statefile import DaemonState, read_state

__all__ = ["get", "running", "state_path"]


def state_path(args: argparse.Namespace) -> Path:
    """The state file: ``--state-file``, else this install's local daemon's."""
    from sandboxkit.client.local import local_state_path

    return Path(args.state_file) if args.state_file else local_state_path()


def running(args: argparse.Namespace) -> DaemonState | None:
    """The daemon the state file names, if it answers; else says so and ``None``."""
    from sandboxkit.client.local import probe

    state = read_state(state_path(args))
    if state is None or not probe(state):
        print("no daemon running")
        return None
    return state


def get(state: DaemonState, path: str) -> Any:
    """``GET path`` of the daemon with its token, as JSON (an error status raises)."""
    import httpx

    headers = {"Authorization": f"Bearer {state.token}"}
    response = httpx.get(state.url + path, headers=headers, timeout=10)
    response.raise_for_status()
    return response.json()
