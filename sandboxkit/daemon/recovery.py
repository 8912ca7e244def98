"""Crash recovery: what a daemon that died without cleaning up (SIGKILL, the OOM killer)
left behind is found and ended by the next daemon that starts.

A dead daemon leaves its sandboxes' processes running (paused ones frozen or stopped
forever), their cgroups, and its temporary root of working directories. Two searches find
the processes, whichever freezer the dead daemon used (see
:mod:`sandboxkit.daemon.freezer`):

- its cgroups, by name (``sandboxkit-<daemon pid>``): every process in them is thawed and
  killed — setsid'd grandchildren too, since nothing leaves a cgroup — and the cgroups
  removed;
- its owner marks: every process a sandbox starts carries its daemon's pid and start time
  in its environment (``SANDBOXKIT_OWNER``), inherited by all it starts; processes marked
  by a daemon that no longer runs are killed, with their sessions and descendants. This
  is what reaches a ``signals`` daemon's processes, double-forked and setsid'd ones
  included. Out of reach: a process that left the sandbox's sessions and parentage *and*
  replaced its environment (``env -i``), or runs as another user.

Temporary roots carry an owner file (pid and start time of the daemon that made them, so
a reused pid is not mistaken for the owner) and are removed once their owner is gone.
Until a successor starts, a dead daemon's processes keep running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import psutil

from sandboxkit.daemon.freezer import reap_dead_daemons, reap_marked_orphans

__all__ = ["OWNER_FILE", "ROOT_PREFIX", "claim_root", "recover"]

ROOT_PREFIX = "sandboxkit-"
OWNER_FILE = ".sandboxkit-owner"


def _identity(pid: int) -> str:
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = 0.0
    return f"{pid} {started:.2f}"


def claim_root(root: Path) -> None:
    """Mark ``root`` as this process's, for a successor to clean up if it dies."""
    (root / OWNER_FILE).write_text(_identity(os.getpid()) + "\n")


def _owner_alive(marker: Path) -> bool:
    try:
        pid_text, started = marker.read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return True  # unreadable: not ours to judge
    return _identity(pid) == f"{pid} {started}"


def _dead_roots(tmp: Path) -> list[Path]:
    found = []
    with contextlib.suppress(OSError):
        for entry in tmp.iterdir():
            marker = entry / OWNER_FILE
            if entry.name.startswith(ROOT_PREFIX) and marker.is_file() and not _owner_alive(marker):
                found.append(entry)
    return found


def recover(tmp: Path | None = None) -> list[dict[str, Any]]:
    """End and remove what dead daemons left; one report per thing found (blocking)."""
    # Cgroups first: their processes are thawed before they are killed.
    reports: list[dict[str, Any]] = reap_dead_daemons() + reap_marked_orphans()
    for root in _dead_roots(tmp or Path(tempfile.gettempdir())):
        shutil.rmtree(root, ignore_errors=True)
        reports.append({"found": "root", "root": str(root), "removed": not root.exists()})
    return reports
