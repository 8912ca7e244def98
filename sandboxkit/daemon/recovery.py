"""Crash recovery by ownership: what a daemon that died without cleaning up (SIGKILL, the
OOM killer) left behind is found and ended by the next daemon that starts — and nothing
that a live daemon owns is ever touched, whatever that daemon can or cannot see.

**The root lock.** Every daemon holds, for its whole life, an exclusive ``flock`` on a
lock file in its temporary root (``<tmp>/sandboxkit-…/.sandboxkit-lock``), which names
the daemon's cgroup (and, for a root daemon on a hybrid host, its cgroups in the v1
hierarchies its limits use: :func:`~sandboxkit.daemon.limits.v1_daemon_dirs`). The
kernel drops the lock when the daemon's last descriptor of it closes — when it exits,
however it exits (a zombie holds no files) — so "the lock can be taken" is the proof
that its owner is gone. It holds across pid namespaces, containers that share ``/tmp``
and daemons of other versions, where "is pid N running" is meaningless: a pid seen from
another namespace is another process, or none.

A daemon that starts scans its temp directory (``TMPDIR``) for ``sandboxkit-*`` roots of
its own user and, for each, tries the lock without waiting. Locked: a live daemon's,
left alone. Taken: its owner is dead — the cgroup it names is thawed, everything in it
killed (setsid'd grandchildren too: nothing leaves a cgroup) and removed, its v1 limit
cgroups removed once empty, then the root removed, then the lock let go. A root without
a lock file (being made, or made by a sandboxkit before locks) is left alone.

**Owner marks** reach a dead ``signals`` daemon's processes (no cgroup): every process a
sandbox starts carries its daemon's pid, start time and pid namespace in its environment
(``SANDBOXKIT_OWNER``, see :mod:`sandboxkit.daemon.freezer.marks`), and processes marked by
a daemon *of this pid namespace* that no longer runs are killed, with their sessions and
descendants. Marks of another namespace are not ours to judge and are left alone.

A daemon given its root (``DaemonConfig.root_dir``) does not own it: it takes no lock
there, and no successor scans or removes it (its cgroup is removed at its exit only).
Until a successor starts, a dead daemon's processes keep running.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandboxkit.daemon.freezer import reap_cgroup, reap_marked_orphans
from sandboxkit.daemon.limits import reap_v1_cgroup

__all__ = ["LOCK_FILE", "ROOT_PREFIX", "RootLock", "claim_root", "recover"]

ROOT_PREFIX = "sandboxkit-"
LOCK_FILE = ".sandboxkit-lock"


class RootLock:
    """This daemon's hold on its root: an open, ``flock``-ed lock file (see the module's
    docstring). Closing it (or the daemon's death) lets a successor reclaim the root."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def close(self) -> None:
        """Let the lock go (the daemon removes its root right after)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim_root(root: Path, cgroup: Path | None, v1: Sequence[Path] = ()) -> RootLock:
    """Lock ``root`` as this process's for its lifetime, naming its cgroup (and ``v1``,
    its cgroups in the v1 hierarchies its limits may use).

    The lock file is written and locked under a temporary name, then renamed into place:
    whoever opens ``LOCK_FILE`` opens a file that is already locked."""
    record = {
        "pid": os.getpid(),
        "uid": os.geteuid(),
        "cgroup": None if cgroup is None else str(cgroup),
        "v1": [str(path) for path in v1],
    }
    scratch = root / f"{LOCK_FILE}.{secrets.token_hex(4)}"
    fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.rename(scratch, root / LOCK_FILE)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            scratch.unlink()
        raise
    return RootLock(root / LOCK_FILE, fd)


def _take(root: Path) -> tuple[int, dict[str, Any]] | None:
    """The lock of ``root`` and its record, if ``root`` is a root of this user whose owner
    is gone; None if it is live, another user's, not a root, or has no lock file."""
    try:
        st = os.lstat(root)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return None  # a symlink, a file, or another user's: never ours to judge
    try:
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: being made, or not a daemon's root we can prove dead
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise BlockingIOError
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: its owner lives
        os.close(fd)
        return None
    record: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(os.pread(fd, 4096, 0))
        if isinstance(loaded, dict):
            record = loaded
    return fd, record


def recover(tmp: Path | None = None) -> list[dict[str, Any]]:
    """End and remove what dead daemons left; one report per thing found (blocking)."""
    tmp = tmp or Path(tempfile.gettempdir())
    taken: list[tuple[Path, int, dict[str, Any]]] = []
    with contextlib.suppress(OSError):
        for entry in tmp.iterdir():
            if entry.name.startswith(ROOT_PREFIX) and (got := _take(entry)) is not None:
                taken.append((entry, *got))
    reports: list[dict[str, Any]] = []
    try:
        # Cgroups first: their processes are thawed before they are killed.
        for _root, _fd, record in taken:
            cgroup = record.get("cgroup")
            if isinstance(cgroup, str) and (found := reap_cgroup(Path(cgroup))) is not None:
                reports.append({**found, "daemon_pid": record.get("pid")})
        reports += reap_marked_orphans()
        # Then its v1 limit cgroups, empty by now.
        for _root, _fd, record in taken:
            v1 = record.get("v1")
            for path in v1 if isinstance(v1, list) else []:
                if isinstance(path, str) and (found := reap_v1_cgroup(Path(path))) is not None:
                    reports.append({**found, "daemon_pid": record.get("pid")})
        for root, _fd, record in taken:
            shutil.rmtree(root, ignore_errors=True)
            reports.append(
                {
                    "found": "root",
                    "root": str(root),
                    "daemon_pid": record.get("pid"),
                    "removed": not root.exists(),
                }
            )
    finally:
        for _root, fd, _record in taken:
            os.close(fd)
    return reports
