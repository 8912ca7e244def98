"""Enforcing a sandbox's :class:`~sandboxkit.limits.Limits` with what the host allows.

Each limit is held by the strongest means this daemon may use, and ``enforced()`` says
which (``get_info().limits_enforced``, ``docs/isolation.md``):

``cgroup`` — cgroup v2 controllers in the sandbox's own cgroup (the freezer's), where
    the daemon's cgroup may enable them (a root daemon on a v2 host; a user with systemd
    delegation). Memory is for the whole sandbox, and past it the kernel's OOM killer
    ends a process: the daemon reads ``memory.events`` and records reason ``oom``.
``cgroup-v1`` — the same from the v1 ``memory``, ``pids`` and ``cpu`` hierarchies, for a
    root daemon on a hybrid host (v2 mounted beside v1, as on this project's CI), below a
    cgroup of the daemon's named as its v2 one is, and named in its root lock too: a
    successor removes what a SIGKILLed daemon left (sandboxkit/daemon/recovery.py).
``rlimit`` — per-process resource limits, inherited by everything a launch starts:
    ``RLIMIT_AS`` for memory (an allocation past it fails: ENOMEM, no OOM kill),
    ``RLIMIT_NPROC`` for pids (counted per user namespace, so per launch under
    isolation), ``RLIMIT_FSIZE`` for disk (per file: a write past it gets ``SIGXFSZ``),
    ``RLIMIT_NOFILE`` for open files (always this way: no cgroup limits open files).
``none`` — ``cpu`` with no cgroup: no rlimit can share a core.

The ``disk`` limit also caps the sandbox's ``/tmp`` nowhere else: ``/home/user`` is a
host directory, which only a quota or a file system of its own could cap (neither can a
non-root daemon make); ``RLIMIT_FSIZE`` keeps any one file under it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Final

from sandboxkit.daemon.freezer.cgroupfs import rmdir_tree
from sandboxkit.daemon.freezer.daemon_cgroup import (
    daemon_cgroup_name,
    defer_removal,
    empty_and_remove,
    is_daemon_cgroup_name,
)
from sandboxkit.daemon.launch import wrapper
from sandboxkit.limits import Limits

__all__ = ["LimitEnforcer"]

logger = logging.getLogger(__name__)

_V1_ROOT: Final = Path("/sys/fs/cgroup")
_PERIOD_US: Final = 100_000


class LimitEnforcer:
    """One sandbox's limits: where they are written, and the argv that applies them."""

    def __init__(self, sandbox_id: str, limits: Limits, cgroup: Path | None) -> None:
        """``cgroup``: the sandbox's cgroup v2 directory (the cgroup freezer's), if any."""
        self.limits = limits
        self.how: dict[str, str] = {}
        self._v2 = cgroup
        self._v1: dict[str, Path] = {}
        self._rlimits: dict[str, int] = {}
        wanted = limits.given()
        if cgroup is not None:
            self._write_v2(cgroup, wanted)
        if os.geteuid() == 0:
            self._write_v1(sandbox_id, wanted)
        if "memory" in wanted and "memory" not in self.how:
            self._rlimit("memory", "as", int(wanted["memory"]))
        if "pids" in wanted and "pids" not in self.how:
            self._rlimit("pids", "nproc", int(wanted["pids"]))
        if "disk" in wanted:
            self._rlimit("disk", "fsize", int(wanted["disk"]))
        if "open_files" in wanted:
            self._rlimit("open_files", "nofile", int(wanted["open_files"]))
        if "cpu" in wanted and "cpu" not in self.how:
            self.how["cpu"] = "none"
        self._oom_seen = self.oom_kills()

    # -- setting up ------------------------------------------------------------------

    def _write_v2(self, cgroup: Path, wanted: dict[str, int | float]) -> None:
        files = {
            "memory": ("memory.max", str(int(wanted.get("memory", 0)))),
            "pids": ("pids.max", str(int(wanted.get("pids", 0)))),
            "cpu": ("cpu.max", f"{max(1000, int(wanted.get('cpu', 0) * _PERIOD_US))} {_PERIOD_US}"),
        }
        for name, (file, value) in files.items():
            if name not in wanted:
                continue
            controller = file.split(".")[0]
            if not _enable_v2(cgroup.parent, controller):
                continue
            try:
                (cgroup / file).write_text(value)
                if name == "memory":
                    # No swap, so the limit is a limit (best effort: swap may be off).
                    with contextlib.suppress(OSError):
                        (cgroup / "memory.swap.max").write_text("0")
            except OSError as exc:
                logger.debug("cgroup v2 %s not set: %s", file, exc)
                continue
            self.how[name] = "cgroup"

    def _write_v1(self, sandbox_id: str, wanted: dict[str, int | float]) -> None:
        plan = {
            "memory": ("memory", [("memory.limit_in_bytes", str(int(wanted.get("memory", 0))))]),
            "pids": ("pids", [("pids.max", str(int(wanted.get("pids", 0))))]),
            "cpu": (
                "cpu",
                [
                    ("cpu.cfs_period_us", str(_PERIOD_US)),
                    ("cpu.cfs_quota_us", str(max(1000, int(wanted.get("cpu", 0) * _PERIOD_US)))),
                ],
            ),
        }
        for name, (controller, writes) in plan.items():
            if name not in wanted or name in self.how:
                continue
            directory = _v1_dir(controller, sandbox_id)
            if directory is None:
                continue
            try:
                directory.mkdir(parents=True, exist_ok=True)
                for file, value in writes:
                    (directory / file).write_text(value)
                if name == "memory":
                    with contextlib.suppress(OSError):
                        (directory / "memory.memsw.limit_in_bytes").write_text(writes[0][1])
            except OSError as exc:
                logger.debug("cgroup v1 %s not set: %s", controller, exc)
                with contextlib.suppress(OSError):
                    directory.rmdir()
                continue
            self._v1[name] = directory
            self.how[name] = "cgroup-v1"

    def _rlimit(self, name: str, resource: str, value: int) -> None:
        self._rlimits[resource] = value
        self.how[name] = "rlimit"

    # -- per launch ------------------------------------------------------------------

    def launch_prefix(self, freezer_joins: list[str]) -> list[str]:
        """The argv to start a launch with, in place of the freezer's own wrapper: one
        ``/bin/sh`` that joins ``freezer_joins`` and the v1 cgroups, then applies the
        rlimits (see :mod:`~sandboxkit.daemon.launch`)."""
        joins = [*freezer_joins, *(str(d / "cgroup.procs") for d in self._v1.values())]
        return wrapper(joins, self._rlimits)

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has ended in this sandbox so far."""
        total = 0
        if self._v2 is not None and self.how.get("memory") == "cgroup":
            total += _counter(self._v2 / "memory.events", "oom_kill")
        memory = self._v1.get("memory")
        if memory is not None:
            total += _counter(memory / "memory.oom_control", "oom_kill")
        return total

    def new_oom_kill(self) -> bool:
        """True once for each batch of OOM kills since the last call (process exits ask)."""
        now = self.oom_kills()
        seen, self._oom_seen = self._oom_seen, now
        return now > seen

    def enforced(self) -> dict[str, str]:
        """How each limit that was asked for holds: cgroup, cgroup-v1, rlimit or none."""
        return dict(self.how)

    def close(self) -> None:
        """Remove the v1 cgroups (blocking: run it off the loop). The sandbox's processes
        are killed by now, but what they leave may take a while longer: a cgroup at its
        memory limit reclaims as it goes, bubblewrap's namespace init tears its
        namespaces down after its command ended. A cgroup still held after
        :data:`_V1_CLOSE_WAIT` goes later (``defer_removal``: the next sandbox, or the
        host's close, retries it)."""
        deadline = time.monotonic() + _V1_CLOSE_WAIT
        for directory in self._v1.values():
            while not rmdir_tree(directory) and time.monotonic() < deadline:
                time.sleep(0.002)  # sleep-ok: killed processes leave a cgroup shortly
            if directory.exists():
                defer_removal(directory)
            else:
                with contextlib.suppress(OSError):
                    directory.parent.rmdir()  # the daemon's, once its last sandbox goes
        self._v1.clear()


def _enable_v2(parent: Path, controller: str) -> bool:
    """Whether ``controller`` is (or could be made) available to ``parent``'s children."""
    control = parent / "cgroup.subtree_control"
    try:
        if controller in control.read_text().split():
            return True
        if controller not in (parent / "cgroup.controllers").read_text().split():
            return False
        control.write_text(f"+{controller}")
        return True
    except OSError:
        return False


_V1_CONTROLLERS: Final = ("memory", "pids", "cpu")
_V1_EMPTY_WAIT: Final = 2.0
_V1_LEAVE_WAIT: Final = 0.2
"""How long the processes a successor just killed get to leave before what is left is
killed here (SIGKILLed processes leave in milliseconds)."""
_V1_CLOSE_WAIT: Final = 0.5


def _v1_dir(controller: str, sandbox_id: str) -> Path | None:
    """``<v1 root>/<controller>/<the daemon's own v1 cgroup>/sandboxkit-<pid>-<random>/
    sb-<id>``, if that hierarchy is mounted and writable."""
    parent = _v1_daemon_dir(controller)
    if parent is None:
        return None
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", sandbox_id)[:100]
    return parent / f"sb-{safe}"


def _v1_daemon_dir(controller: str) -> Path | None:
    """This daemon's cgroup in the v1 ``controller`` hierarchy (made on first use), named
    as its v2 one is, if that hierarchy is mounted and writable."""
    mount = _V1_ROOT / controller
    if not (mount / "cgroup.procs").exists() or not os.access(mount, os.W_OK):
        return None
    own = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                own = path.lstrip("/")
    return mount / own / daemon_cgroup_name()


def v1_daemon_dirs() -> list[Path]:
    """Where a root daemon's v1 limit cgroups go, one per hierarchy it may use: named in
    its root lock (sandboxkit/daemon/recovery.py), so that a successor removes what a
    SIGKILLed daemon left; none for any other daemon."""
    if os.geteuid() != 0:
        return []
    return [d for c in _V1_CONTROLLERS if (d := _v1_daemon_dir(c)) is not None]


def release_v1_daemon_dirs() -> None:
    """When a host closes: remove this daemon's v1 limit cgroups, left empty by its
    sandboxes (another host in the same process keeps those it still uses)."""
    for directory in v1_daemon_dirs():
        with contextlib.suppress(OSError):
            directory.rmdir()


def reap_v1_cgroup(path: Path) -> dict[str, Any] | None:
    """Remove a dead daemon's v1 limit cgroup ``path`` and its sandboxes' below it, killing
    what is still in them; a report, or None if there was nothing (blocking).

    The successor has just ended the dead daemon's processes through its v2 cgroup or
    their owner marks: they are given a moment to leave. What stays had dropped its mark
    (a sandboxed process owns its environment: ``env -i``) or joined after the successor
    looked (spawned just before the daemon died), and nothing leaves a cgroup: each is
    killed as in a v2 cgroup (``empty_and_remove``).
    ``path`` comes from a file on disk, so it is taken only if it is what a daemon makes: a
    ``sandboxkit-<pid>-<random>`` directory in one of the v1 hierarchies limits use."""
    if (
        not path.is_absolute()
        or ".." in path.parts
        or not is_daemon_cgroup_name(path.name)
        or not any(path.is_relative_to(_V1_ROOT / c) for c in _V1_CONTROLLERS)
        or path.is_symlink()
        or not path.is_dir()
    ):
        return None
    killed, removed = empty_and_remove(path, _V1_EMPTY_WAIT, grace=_V1_LEAVE_WAIT)
    return {
        "found": "cgroup-v1",
        "cgroup": str(path),
        "processes_killed": killed,
        "cgroup_removed": removed,
    }


def _counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
