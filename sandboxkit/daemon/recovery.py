"""Crash recovery: what a daemon that died without cleaning up (SIGKILL, the OOM killer)
left behind is found and ended by the next daemon that starts.

A dead daemon leaves its sandboxes' processes running (paused ones frozen forever), their
cgroups, and its temporary root of working directories. The cgroups are found by name
(``sandboxkit-<daemon pid>``, see :mod:`sandboxkit.daemon.tree`): every process in them is
thawed and killed — setsid'd grandchildren too, since nothing leaves a cgroup — and the
cgroups removed. Temporary roots carry an owner file (pid and start time of the daemon
that made them, so a reused pid is not mistaken for the owner) and are removed once their
owner is gone.

The limit: with the ``signals`` freezer there is no cgroup, and processes of a dead daemon
cannot be told apart from anyone else's; they are not found. Use the cgroup freezer where
processes must not outlive their daemon.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import psutil

from sandboxkit.daemon.tree import reap_dead_daemons

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
    reports: list[dict[str, Any]] = [
        {"found": "cgroup", **report} for report in reap_dead_daemons()
    ]
    for root in _dead_roots(tmp or Path(tempfile.gettempdir())):
        shutil.rmtree(root, ignore_errors=True)
        reports.append({"found": "root", "root": str(root), "removed": not root.exists()})
    return reports
