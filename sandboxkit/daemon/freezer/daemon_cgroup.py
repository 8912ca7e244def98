"""The daemon's own cgroup, ``<base>/sandboxkit-<daemon pid>-<random>/``, which holds one
cgroup per sandbox: made on first use, removed when the daemon exits — and, when a daemon
died without removing it (SIGKILL, the OOM killer), emptied and removed by the next
daemon, which finds it named in the dead daemon's root lock (:mod:`sandboxkit.daemon.
recovery`), never by guessing from the name.

Why the random part: pids are per pid namespace, so two daemons in two containers (or
``unshare --pid``) on one cgroup tree may have the same pid — each needs its own cgroup.
Why not judge by the pid: from another pid namespace a live daemon's pid is not visible,
and a daemon must never take a live neighbour's cgroup for a dead one's.

A sandbox cgroup that cannot be removed yet (a process still leaving it) is kept in a list
and retried: on the next sandbox, and at exit.

Beside the sandboxes' cgroups, one more, :data:`LAUNCHERS`: where bubblewrap's own
processes go once an isolated launch's command is born in its sandbox's cgroup (see
:meth:`~sandboxkit.daemon.freezer.cgroup.CgroupFreezer.add`), so that a pause does not
freeze them. It is the daemon's, and goes with it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Any, Final

from sandboxkit.daemon.freezer.cgroupfs import (
    PREFIX,
    cgroup2_mount,
    cgroup_base,
    cgroup_pids,
    rmdir_tree,
)

__all__ = ["LAUNCHERS", "daemon_cgroup", "daemon_cgroup_path", "defer_removal", "reap_cgroup"]

logger = logging.getLogger(__name__)

LAUNCHERS: Final = "bwrap"
"""The name of the daemon's cgroup for bubblewrap's processes (no sandbox's is ``sb-``-less)."""

_DAEMON_RE: Final = re.compile(rf"^{re.escape(PREFIX)}(\d+)-[0-9a-f]{{8}}$")
_POLL_INTERVAL: Final = 0.005

_lock = threading.Lock()
_atexit_registered = False
_deferred: set[Path] = set()


@functools.cache
def _name(pid: int) -> str:
    return f"{PREFIX}{pid}-{secrets.token_hex(4)}"


def daemon_cgroup_path() -> Path | None:
    """Where this daemon's cgroup is (or will be, on first use); None without a usable
    cgroup2 hierarchy. The ``os.getpid()`` argument keeps it right after a fork."""
    base = cgroup_base()
    return None if base is None else base / _name(os.getpid())


def _retry_deferred() -> None:
    for path in list(_deferred):
        if rmdir_tree(path):
            _deferred.discard(path)


def defer_removal(path: Path) -> None:
    """Remove ``path`` later: it still holds a process that is on its way out."""
    with _lock:
        _deferred.add(path)


def _cleanup_at_exit() -> None:
    """Remove deferred sandbox cgroups and this daemon's own cgroups (if empty by now)."""
    _retry_deferred()
    base = cgroup_base()
    if base is not None:
        own = base / _name(os.getpid())
        for path in (own / LAUNCHERS, own):
            with contextlib.suppress(OSError):
                path.rmdir()


def daemon_cgroup(base: Path) -> Path:
    """This daemon's cgroup below ``base``, made on first use."""
    global _atexit_registered
    parent = base / _name(os.getpid())
    with _lock:
        _retry_deferred()
        if not parent.is_dir():
            parent.mkdir(exist_ok=True)
        if not _atexit_registered:
            atexit.register(_cleanup_at_exit)
            _atexit_registered = True
    return parent


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


def reap_cgroup(path: Path, timeout: float = 2.0) -> dict[str, Any] | None:
    """Thaw and kill every process in a dead daemon's cgroup ``path`` — setsid'd and
    double-forked ones included, since nothing leaves a cgroup — and remove it; a report,
    or None if there was nothing (blocking).

    The caller proves the daemon dead (it holds the lock of the daemon's root). ``path``
    comes from a file on disk, so it is taken only if it is what a daemon makes: a
    ``sandboxkit-<pid>-<random>`` directory right below a cgroup2 mount's subtree."""
    mount = cgroup2_mount()
    if (
        mount is None
        or _DAEMON_RE.match(path.name) is None
        or not path.is_absolute()
        or ".." in path.parts
        or not path.is_relative_to(mount)
        or path.is_symlink()
        or not path.is_dir()
    ):
        return None
    sandboxes = 0
    with contextlib.suppress(OSError):
        sandboxes = sum(1 for c in path.iterdir() if c.is_dir() and c.name != LAUNCHERS)
    killed = _empty(path, timeout)
    removed = rmdir_tree(path)
    return {
        "found": "cgroup",
        "cgroup": str(path),
        "sandboxes": sandboxes,
        "processes_killed": killed,
        "cgroup_removed": removed,
    }
