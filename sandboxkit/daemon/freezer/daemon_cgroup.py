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

Beside an isolated sandbox's cgroup, one more of its own (named with
:data:`LAUNCHERS_SUFFIX`): where bubblewrap's processes go once a launch's command is
born (:meth:`~sandboxkit.daemon.freezer.cgroup.CgroupFreezer.settle`).

The daemon's cgroup goes when its host closes (:func:`release_daemon_cgroup`), not only
at exit: a daemon stopped by ``SIGTERM`` (``sandboxkit stop``) ends by that signal, which
uvicorn raises again once it has shut down, and no ``atexit`` hook runs then.
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
    read_events,
    rmdir_tree,
)
from sandboxkit.daemon.freezer.proc import send_verified

__all__ = [
    "LAUNCHERS_SUFFIX",
    "daemon_cgroup",
    "daemon_cgroup_name",
    "daemon_cgroup_path",
    "defer_removal",
    "empty_and_remove",
    "is_daemon_cgroup_name",
    "reap_cgroup",
    "release_daemon_cgroup",
]

logger = logging.getLogger(__name__)

LAUNCHERS_SUFFIX: Final = ".bwrap"
"""Ends the name of a sandbox's cgroup for bubblewrap's processes (beside its own)."""

_DAEMON_RE: Final = re.compile(rf"^{re.escape(PREFIX)}(\d+)-[0-9a-f]{{8}}$")
_POLL_INTERVAL: Final = 0.005

_lock = threading.Lock()
_atexit_registered = False
_deferred: set[Path] = set()


@functools.cache
def _name(pid: int) -> str:
    return f"{PREFIX}{pid}-{secrets.token_hex(4)}"


def daemon_cgroup_name() -> str:
    """This daemon's cgroup's name, ``sandboxkit-<pid>-<random>`` (its v1 limit cgroups
    have it too: sandboxkit/daemon/limits.py)."""
    return _name(os.getpid())


def is_daemon_cgroup_name(name: str) -> bool:
    """Whether ``name`` is one :func:`daemon_cgroup_name` gives."""
    return _DAEMON_RE.match(name) is not None


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
    """Remove deferred sandbox cgroups and this daemon's own cgroup (if empty by now)."""
    release_daemon_cgroup(timeout=0)


def release_daemon_cgroup(timeout: float = 0.5) -> None:
    """When a host closes (blocking): remove the sandbox cgroups whose removal was
    deferred, waiting up to ``timeout`` for what their killed processes take to leave,
    then this daemon's cgroup if nothing else of the process's holds it (another host in
    the same process keeps it, and makes it again when it needs it). The lock is held
    for each look only: other hosts' loops take it to make and close sandboxes."""
    deadline = time.monotonic() + timeout
    while True:
        with _lock:
            _retry_deferred()
            pending = bool(_deferred)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_INTERVAL)  # sleep-ok: processes leave a cgroup asynchronously
    base = cgroup_base()
    if base is not None:
        with _lock, contextlib.suppress(OSError):
            (base / _name(os.getpid())).rmdir()


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


def _empty(root: Path, timeout: float, grace: float) -> int:
    """Thaw, kill and wait out every process below ``root``, after ``grace`` seconds in
    which processes already killed (by their owner marks) may leave; how many it killed."""
    # Thaw first: a frozen process cannot act on SIGTERM, and a cgroup left frozen keeps
    # its processes frozen whatever happens to them. (A v1 cgroup has no cgroup.freeze.)
    for dirpath, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError):
            Path(dirpath, "cgroup.freeze").write_text("0")
    start = time.monotonic()
    killed: set[int] = set()
    while True:
        pids = cgroup_pids(root)
        # Populated, not pids: a member with no pid in this PID namespace (a successor in
        # a container) is killed by cgroup.kill all the same. (v1 tells neither.)
        populated = read_events(root).get("populated", "1" if pids else "0") == "1"
        elapsed = time.monotonic() - start
        if not populated or elapsed >= timeout:
            return len(killed)
        if elapsed >= grace:
            killed |= pids
            try:
                (root / "cgroup.kill").write_text("1")  # Linux 5.14+, v2: the whole subtree
            except OSError:
                for pid in pids:
                    send_verified(pid, signal.SIGKILL, lambda p: p in cgroup_pids(root))
        time.sleep(_POLL_INTERVAL)  # sleep-ok: processes leave a cgroup asynchronously


def empty_and_remove(path: Path, timeout: float, grace: float = 0.0) -> tuple[int, bool]:
    """Kill every process in a dead daemon's cgroup ``path`` (v2, or a v1 one of its
    limits) and below it — after ``grace`` seconds for those already killed to leave —
    and remove it, within ``timeout``: (how many it killed, whether it is gone). Each is
    killed by ``cgroup.kill``, or else through a pidfd checked to be still in the cgroup.

    Again while a process joins late: one the dead daemon spawned just before it died (a
    sandbox's standby, started unasked: sandboxkit/daemon/standby.py) writes its pid into
    its cgroup once it runs, maybe after the first pass found the cgroup empty."""
    deadline = time.monotonic() + timeout
    killed = _empty(path, timeout, grace)
    while not (removed := rmdir_tree(path)) and time.monotonic() < deadline:
        killed += _empty(path, max(0.0, deadline - time.monotonic()), 0.0)
        time.sleep(_POLL_INTERVAL)  # sleep-ok: a late joiner's write, then its kill
    return killed, removed


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
        sandboxes = sum(
            1 for c in path.iterdir() if c.is_dir() and not c.name.endswith(LAUNCHERS_SUFFIX)
        )
    killed, removed = empty_and_remove(path, timeout)
    return {
        "found": "cgroup",
        "cgroup": str(path),
        "sandboxes": sandboxes,
        "processes_killed": killed,
        "cgroup_removed": removed,
    }
