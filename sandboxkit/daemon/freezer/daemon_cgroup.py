"""The daemon's own cgroup, ``<base>/sandboxkit-<daemon pid>/``, which holds one cgroup per
sandbox: made on first use, removed when the daemon exits — and, when a daemon died
without removing it (SIGKILL, the OOM killer), found by name by the next daemon, which
kills what still runs inside and removes it.

The name carries the daemon's pid, so whether its owner still runs is one look in
``/proc``. A sandbox cgroup that cannot be removed yet (a process still leaving it) is
kept in a list and retried: on the next sandbox, and at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Final

from sandboxkit.daemon.freezer.cgroupfs import PREFIX, cgroup_base, cgroup_pids, rmdir_tree
from sandboxkit.daemon.freezer.proc import pid_alive

__all__ = ["daemon_cgroup", "defer_removal", "reap_dead_daemons"]

logger = logging.getLogger(__name__)

_DAEMON_RE: Final = re.compile(rf"^{re.escape(PREFIX)}(\d+)$")
_POLL_INTERVAL: Final = 0.005

_lock = threading.Lock()
_atexit_registered = False
_deferred: set[Path] = set()


def _dead(pid: int) -> bool:
    return pid != os.getpid() and not pid_alive(pid)


def _retry_deferred() -> None:
    for path in list(_deferred):
        if rmdir_tree(path):
            _deferred.discard(path)


def defer_removal(path: Path) -> None:
    """Remove ``path`` later: it still holds a process that is on its way out."""
    with _lock:
        _deferred.add(path)


def _cleanup_at_exit() -> None:
    """Remove deferred sandbox cgroups and this daemon's own cgroup (if empty by now)."""
    _retry_deferred()
    base = cgroup_base()
    if base is not None:
        with contextlib.suppress(OSError):
            (base / f"{PREFIX}{os.getpid()}").rmdir()


def daemon_cgroup(base: Path) -> Path:
    """This daemon's cgroup below ``base``, made on first use (removing the empty ones of
    dead daemons on the way)."""
    global _atexit_registered
    parent = base / f"{PREFIX}{os.getpid()}"
    with _lock:
        _retry_deferred()
        if not parent.is_dir():
            _remove_empty_dead(base)
            parent.mkdir(exist_ok=True)
        if not _atexit_registered:
            atexit.register(_cleanup_at_exit)
            _atexit_registered = True
    return parent


def _dead_daemon_dirs(base: Path) -> list[tuple[int, Path]]:
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _DAEMON_RE.match(entry.name)
        if match is not None and entry.is_dir() and _dead(int(match.group(1))):
            found.append((int(match.group(1)), entry))
    return found


def _remove_empty_dead(base: Path) -> None:
    for _pid, entry in _dead_daemon_dirs(base):
        if rmdir_tree(entry):
            logger.debug("removed stale cgroup %s", entry)


def _empty(root: Path, timeout: float) -> int:
    """Thaw, kill and wait out every process below ``root``; how many there were."""
    found = cgroup_pids(root)
    # Thaw first: a frozen process cannot act on SIGTERM, and a cgroup left frozen keeps
    # its processes frozen whatever happens to them.
    for dirpath, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError):
            Path(dirpath, "cgroup.freeze").write_text("0")
    deadline = time.monotonic() + timeout
    while True:
        pids = cgroup_pids(root)
        found |= pids
        if not pids or time.monotonic() >= deadline:
            return len(found)
        try:
            (root / "cgroup.kill").write_text("1")  # Linux 5.14+: the whole subtree at once
        except OSError:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(_POLL_INTERVAL)  # sleep-ok: processes leave a cgroup asynchronously


def reap_dead_daemons(timeout: float = 2.0) -> list[dict[str, Any]]:
    """Find the cgroups of daemons that died without cleaning up, thaw and kill every
    process in them — setsid'd and double-forked ones included, since nothing leaves a
    cgroup — and remove them. One report per dead daemon found (blocking)."""
    base = cgroup_base()
    if base is None:
        return []
    reports: list[dict[str, Any]] = []
    for pid, entry in _dead_daemon_dirs(base):
        sandboxes = 0
        with contextlib.suppress(OSError):
            sandboxes = sum(1 for child in entry.iterdir() if child.is_dir())
        killed = _empty(entry, timeout)
        removed = rmdir_tree(entry)
        if killed or sandboxes:
            reports.append(
                {
                    "found": "cgroup",
                    "daemon_pid": pid,
                    "cgroup": str(entry),
                    "sandboxes": sandboxes,
                    "processes_killed": killed,
                    "cgroup_removed": removed,
                }
            )
    return reports
