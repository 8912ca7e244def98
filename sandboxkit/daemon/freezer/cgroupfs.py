"""Finding a cgroup v2 hierarchy the daemon may use, and reading and writing its files.

The daemon creates its cgroups below its *own* cgroup (from ``/proc/self/cgroup``) rather
than at the mount's root, so a delegated subtree (a systemd user slice, a container) works
as well as root on the host. Whether that place is usable is found by trying: a scratch
cgroup is made and must offer the freezer's files. That probe costs a mkdir and an rmdir,
so its answer is kept for the life of the process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
from pathlib import Path
from typing import Final

__all__ = [
    "PREFIX",
    "cgroup2_mount",
    "cgroup2_path_of",
    "cgroup_base",
    "cgroup_pids",
    "cgroup_v2_available",
    "read_events",
    "rmdir_tree",
]

PREFIX: Final = "sandboxkit-"
"""Every cgroup directory the daemon makes at the base starts so."""

_REQUIRED: Final = ("cgroup.freeze", "cgroup.procs", "cgroup.events")


def _unescape_mount_field(field: str) -> str:
    """Undo the octal escaping (``\\040`` etc.) of ``/proc/self/mounts``."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _find_cgroup2_mount() -> tuple[Path, bool] | None:
    """(mount point, read-only?) of the first cgroup2 mount, or None."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup2":
            return Path(_unescape_mount_field(parts[1])), "ro" in parts[3].split(",")
    return None


def cgroup2_mount() -> Path | None:
    """Where the cgroup2 hierarchy is mounted, or None."""
    found = _find_cgroup2_mount()
    return found[0] if found is not None else None


def cgroup2_path_of(pid: int | str) -> str | None:
    """The cgroup2 path of a process (its ``0::`` line, e.g. ``/a/b``); None if unknown."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].rstrip("\n")
    except OSError:
        return None
    return None


def read_events(cgdir: Path) -> dict[str, str]:
    """``cgroup.events`` as a dict (empty if unreadable)."""
    try:
        text = (cgdir / "cgroup.events").read_text()
    except OSError:
        return {}
    return dict(line.partition(" ")[::2] for line in text.splitlines())


def cgroup_pids(root: Path) -> set[int]:
    """Every pid in ``root``'s ``cgroup.procs`` and those of the cgroups below it. A member
    with no pid in this PID namespace, which cgroup v2 lists as 0, is left out: it cannot
    be signalled from here, and 0 given to ``kill()`` is this process's own group."""
    pids: set[int] = set()
    for dirpath, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(tok) for tok in Path(dirpath, "cgroup.procs").read_text().split())
    pids.discard(0)
    return pids


def rmdir_tree(root: Path) -> bool:
    """Remove a cgroup and its (empty) sub-cgroups, bottom-up; True if ``root`` is gone.

    Only directories are removed: a cgroup's interface files vanish with it, and a
    cgroup that still holds a process refuses (``EBUSY``), which is left for later.
    """
    if not root.exists():
        return True
    for dirpath, _dirnames, _files in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
    return not root.exists()


@functools.cache
def cgroup_base() -> Path | None:
    """The directory below which this daemon makes its cgroups, or None if there is no
    writable cgroup2 hierarchy with a freezer (probed once per process)."""
    found = _find_cgroup2_mount()
    if found is None or found[1]:
        return None
    mount = found[0]
    own = cgroup2_path_of("self")
    base = mount
    if own is not None and (candidate := mount / own.lstrip("/")).is_dir():
        base = candidate
    if not os.access(base, os.W_OK | os.X_OK):
        return None
    probe = base / f"{PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError:
        return None
    try:
        if not all((probe / name).exists() for name in _REQUIRED):
            return None
        return base if os.access(probe / "cgroup.procs", os.W_OK) else None
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def cgroup_v2_available() -> bool:
    """True if a writable cgroup2 hierarchy with the freezer is usable."""
    return cgroup_base() is not None
