"""Freeze, thaw and signal the whole process tree of a sandbox.

A sandbox runs many processes: the leaders started by the daemon, their
children, grandchildren and daemons that double-fork away from their parent.
"Pause" must stop all of them, "resume" must continue all of them and "kill"
must reach every one.  Two backends implement the same :class:`ProcessTree`
interface:

``cgroup``
    One cgroup v2 per sandbox, below ``<base>/sandboxkit-<daemonpid>/``, where
    ``<base>`` is the daemon's own cgroup in the cgroup2 hierarchy (found by
    parsing ``/proc/self/mounts`` and ``/proc/self/cgroup``).  Processes join
    race-free through :meth:`ProcessTree.launch_prefix`: a tiny ``/bin/sh``
    wrapper writes its own pid to ``cgroup.procs`` and then ``exec``\\ s the
    real program, so every descendant is born inside the cgroup.  Freezing
    uses ``cgroup.freeze``; nothing can escape, not even processes that call
    ``setsid()`` and get reparented.

``signals``
    ``SIGSTOP``/``SIGCONT``.  Members are the registered leaders, all their
    descendants (by parent pid), and every process whose session id equals a
    leader's session id (this catches double-forked daemons reparented to
    init, as long as they did not call ``setsid()`` themselves).

Use :func:`make_process_tree` to pick a backend.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import contextlib
import errno
import logging
import os
import re
import secrets
import signal as _signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import psutil

__all__ = [
    "FREEZER_ENV_VAR",
    "CgroupProcessTree",
    "ProcessTree",
    "SignalProcessTree",
    "cgroup_v2_available",
    "make_process_tree",
    "process_is_frozen",
    "reap_dead_daemons",
]

logger = logging.getLogger(__name__)

#: Environment variable read by :func:`make_process_tree` when ``backend="auto"``.
FREEZER_ENV_VAR: Final = "SANDBOXKIT_FREEZER"

#: Default time allowed for a freeze to take effect, in seconds.
DEFAULT_FREEZE_TIMEOUT: Final = 2.0

_POLL_INTERVAL: Final = 0.005
_PARENT_PREFIX: Final = "sandboxkit-"
_PARENT_RE: Final = re.compile(r"^sandboxkit-(\d+)$")
_BACKENDS: Final = ("auto", "cgroup", "signals")
_STOPPED_STATES: Final = frozenset({"T", "t"})
_DEAD_STATES: Final = frozenset({"Z", "X", "x"})


# --------------------------------------------------------------------------
# /proc helpers
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ProcStat:
    """The fields of ``/proc/<pid>/stat`` this module needs."""

    pid: int
    state: str
    ppid: int
    sid: int
    starttime: int

    @property
    def alive(self) -> bool:
        """True unless the process is a zombie or dead."""
        return self.state not in _DEAD_STATES


def _read_stat(pid: int) -> _ProcStat | None:
    """Parse ``/proc/<pid>/stat``; None if the process does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        return _ProcStat(
            pid=pid,
            state=rest[0].decode("ascii", "replace"),
            ppid=int(rest[1]),
            sid=int(rest[3]),
            starttime=int(rest[19]),
        )
    except (IndexError, ValueError):
        return None


def _scan_processes() -> dict[int, _ProcStat]:
    """Snapshot every process (thread-group leaders) listed in ``/proc``."""
    result: dict[int, _ProcStat] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return result
    for name in names:
        if not name.isdigit():
            continue
        st = _read_stat(int(name))
        if st is not None:
            result[st.pid] = st
    return result


def _send_verified(pid: int, sig: int, still_ours: Callable[[int], bool]) -> bool:
    """Send ``sig`` to ``pid`` if ``still_ours(pid)`` holds, avoiding pid reuse.

    A pidfd is opened first and the check is made afterwards, so the signal
    reaches exactly the process that passed the check.  Falls back to
    :func:`os.kill` when pidfds are unsupported.  Returns True if sent.
    """
    fd = -1
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:
        fd = -1  # ENOSYS/EINVAL: old kernel, fall back to os.kill
    try:
        if not still_ours(pid):
            return False
        if fd >= 0:
            _signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        logger.debug("no permission to send signal %d to pid %d", sig, pid)
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def _stop_pending(pid: int) -> bool:
    """True if ``SIGSTOP`` is pending for ``pid`` (per ``/proc/<pid>/status``)."""
    bit = 1 << (_signal.SIGSTOP - 1)
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit:
                    return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def _is_stopped(st: _ProcStat) -> bool:
    """True if the process is stopped, or can only stop next.

    A process in uninterruptible sleep (``D``) with a pending ``SIGSTOP``
    cannot run user code again before stopping.  This matters for
    ``vfork()``: a parent waits in ``D`` until its child execs, and never
    will if the child got stopped first.
    """
    if st.state in _STOPPED_STATES:
        return True
    return st.state == "D" and _stop_pending(st.pid)


def _pid_alive_elsewhere(pid: int, st: _ProcStat | None) -> bool:
    """True if ``pid`` exists but ``/proc`` could not describe it (hidden)."""
    if st is not None:
        return False  # described: a zombie or dead process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------
# cgroup v2 discovery
# --------------------------------------------------------------------------


def _unescape_mount_field(field: str) -> str:
    """Undo the octal escaping (``\\040`` etc.) used in ``/proc/self/mounts``."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _find_cgroup2_mount() -> tuple[Path, bool] | None:
    """Return (mount point, read-only?) of the first cgroup2 mount, or None."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup2":
            options = parts[3].split(",")
            return Path(_unescape_mount_field(parts[1])), "ro" in options
    return None


def _cgroup2_path_of(pid: int | str) -> str | None:
    """The cgroup2 path (``0::`` line) of a process, e.g. ``/a/b``; None if unknown."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].rstrip("\n")
    except OSError:
        return None
    return None


def _cgroup_dir(mount: Path, cgpath: str) -> Path:
    """Join a cgroup path (as in ``/proc/<pid>/cgroup``) onto the mount point."""
    # "(deleted)" suffix appears for removed cgroups; harmless for lookups.
    return mount / cgpath.lstrip("/")


def _read_events(cgdir: Path) -> dict[str, str]:
    """Parse ``cgroup.events`` into a dict (empty if unreadable)."""
    try:
        text = (cgdir / "cgroup.events").read_text()
    except OSError:
        return {}
    result: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        result[key] = value.strip()
    return result


_base_lock = threading.Lock()
_base_probed = False
_base_dir: Path | None = None


def _cgroup_base() -> Path | None:
    """Directory below which sandbox cgroups are created, or None if unusable.

    This is the daemon's own cgroup2 cgroup (so delegated subtrees work), or
    the mount root when that cannot be located.  The result is probed once
    (by creating and removing a scratch cgroup that must offer
    ``cgroup.freeze``) and cached.
    """
    global _base_probed, _base_dir
    with _base_lock:
        if _base_probed:
            return _base_dir
        _base_probed = True
        _base_dir = _probe_cgroup_base()
        return _base_dir


def _probe_cgroup_base() -> Path | None:
    """Uncached implementation of :func:`_cgroup_base`."""
    found = _find_cgroup2_mount()
    if found is None:
        return None
    mount, read_only = found
    if read_only:
        return None
    own = _cgroup2_path_of("self")
    base = mount
    if own is not None:
        candidate = _cgroup_dir(mount, own)
        if candidate.is_dir():
            base = candidate
    if not os.access(base, os.W_OK | os.X_OK):
        return None
    probe = base / f"{_PARENT_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
    except OSError:
        return None
    try:
        required = ("cgroup.freeze", "cgroup.procs", "cgroup.events")
        if not all((probe / name).exists() for name in required):
            return None
        if not os.access(probe / "cgroup.procs", os.W_OK):
            return None
        return base
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def cgroup_v2_available() -> bool:
    """True if a writable cgroup2 hierarchy with the freezer is usable."""
    return _cgroup_base() is not None


# --------------------------------------------------------------------------
# cgroup parent directory lifecycle
# --------------------------------------------------------------------------

_parent_lock = threading.Lock()
_atexit_registered = False
_leftover_dirs: set[Path] = set()


def _rmdir_tree(root: Path) -> bool:
    """Remove a cgroup directory and its (empty) sub-cgroups, bottom-up.

    Only directories are removed (cgroupfs interface files vanish with their
    directory).  Returns True if ``root`` no longer exists.
    """
    if not root.exists():
        return True
    for dirpath, _dirnames, _files in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
    return not root.exists()


def _remove_stale_parents(base: Path) -> None:
    """Best effort: remove empty ``sandboxkit-<pid>`` dirs of dead daemons."""
    try:
        entries = list(base.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _PARENT_RE.match(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        st = _read_stat(pid)
        if pid == os.getpid() or (st is not None and st.alive) or _pid_alive_elsewhere(pid, st):
            continue
        if _rmdir_tree(entry):
            logger.debug("removed stale cgroup %s", entry)


def _dead_daemon(pid: int) -> bool:
    st = _read_stat(pid)
    return (
        pid != os.getpid()
        and not (st is not None and st.alive)
        and not (_pid_alive_elsewhere(pid, st))
    )


def _cgroup_pids(root: Path) -> set[int]:
    pids: set[int] = set()
    for dirpath, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError, ValueError):
            text = (Path(dirpath) / "cgroup.procs").read_text()
            pids.update(int(line) for line in text.split())
    return pids


def _empty_cgroup(root: Path, timeout: float) -> int:
    """Thaw, kill and wait out every process below ``root``; returns how many there were."""
    found = _cgroup_pids(root)
    for dirpath, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError):
            (Path(dirpath) / "cgroup.freeze").write_text("0")
    deadline = time.monotonic() + timeout
    while True:
        pids = _cgroup_pids(root)
        found |= pids
        if not pids or time.monotonic() >= deadline:
            return len(found)
        killed = False
        with contextlib.suppress(OSError):
            (root / "cgroup.kill").write_text("1")
            killed = True
        if not killed:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, _signal.SIGKILL)
        time.sleep(_POLL_INTERVAL)


def reap_dead_daemons(timeout: float = 2.0) -> list[dict[str, object]]:
    """Find the cgroups of daemons that died without cleaning up (SIGKILL, OOM, a power
    cut of the container), thaw and kill every process in them — setsid'd grandchildren
    included, since nothing leaves a cgroup — and remove them.

    Returns one report per dead daemon found (empty without a usable cgroup2 freezer: the
    ``signals`` backend has no place where a successor could find orphans).
    """
    base = _cgroup_base()
    if base is None:
        return []
    reports: list[dict[str, object]] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = _PARENT_RE.match(entry.name)
        if match is None or not entry.is_dir() or not _dead_daemon(int(match.group(1))):
            continue
        sandboxes = 0
        with contextlib.suppress(OSError):
            sandboxes = sum(1 for child in entry.iterdir() if child.is_dir())
        killed = _empty_cgroup(entry, timeout)
        removed = _rmdir_tree(entry)
        if killed or sandboxes:
            reports.append(
                {
                    "daemon_pid": int(match.group(1)),
                    "cgroup": str(entry),
                    "sandboxes": sandboxes,
                    "processes_killed": killed,
                    "cgroup_removed": removed,
                }
            )
    return reports


def _cleanup_at_exit() -> None:
    """Remove leftover sandbox cgroups and this daemon's parent cgroup."""
    for path in list(_leftover_dirs):
        if _rmdir_tree(path):
            _leftover_dirs.discard(path)
    base = _base_dir
    if base is not None:
        with contextlib.suppress(OSError):
            (base / f"{_PARENT_PREFIX}{os.getpid()}").rmdir()


def _ensure_parent(base: Path) -> Path:
    """Create (if needed) and return this daemon's ``sandboxkit-<pid>`` cgroup."""
    global _atexit_registered
    parent = base / f"{_PARENT_PREFIX}{os.getpid()}"
    with _parent_lock:
        for path in list(_leftover_dirs):  # retry deferred removals
            if _rmdir_tree(path):
                _leftover_dirs.discard(path)
        if not parent.is_dir():
            _remove_stale_parents(base)
            parent.mkdir(exist_ok=True)
        if not _atexit_registered:
            atexit.register(_cleanup_at_exit)
            _atexit_registered = True
    return parent


def _sanitize(sandbox_id: str) -> str:
    """Turn a sandbox id into a safe cgroup directory name."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", sandbox_id)[:100]
    return f"sb-{cleaned or 'anon'}"


# --------------------------------------------------------------------------
# Public interface
# --------------------------------------------------------------------------


class ProcessTree(abc.ABC):
    """All processes of one sandbox, which can be frozen, thawed and signalled.

    Usage: spawn each sandbox process as ``launch_prefix() + argv`` with
    ``start_new_session=True`` and call :meth:`add` with its pid right away.
    """

    #: Name of the backend: ``"cgroup"`` or ``"signals"``.
    backend: str

    def __init__(self, sandbox_id: str, freeze_timeout: float) -> None:
        """Store the common settings."""
        self.sandbox_id = sandbox_id
        self.freeze_timeout = freeze_timeout
        self._frozen = False
        self._closed = False

    @abc.abstractmethod
    def launch_prefix(self) -> list[str]:
        """Argv prefix the caller must put before the real argv of each process.

        For the cgroup backend this moves the process into the sandbox cgroup
        before ``exec``; for the signal backend it is empty.
        """

    @abc.abstractmethod
    def add(self, pid: int) -> None:
        """Register a newly started (already running) leader process."""

    @abc.abstractmethod
    def pids(self) -> list[int]:
        """Every live (non-zombie) process of the sandbox right now, sorted."""

    @property
    def frozen(self) -> bool:
        """True between a :meth:`freeze` and the next :meth:`thaw`."""
        return self._frozen

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    @abc.abstractmethod
    async def freeze(self) -> None:
        """Stop every process of the sandbox and wait until they are stopped.

        If the processes are not all stopped within ``freeze_timeout`` a
        warning is logged; the tree stays marked frozen (the stop is still
        pending and takes effect once e.g. an uninterruptible sleep ends).
        """

    @abc.abstractmethod
    async def thaw(self) -> None:
        """Continue every process of the sandbox."""

    @abc.abstractmethod
    def signal(self, sig: int) -> None:
        """Send ``sig`` to every live process of the sandbox.

        Processes that exit meanwhile are ignored.  Note that while frozen
        only ``SIGKILL`` takes effect immediately; other signals are delivered
        after :meth:`thaw`.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources (the cgroup directory).  Idempotent, never raises.

        Processes are not killed (call ``signal(SIGKILL)`` first), but a
        frozen tree is thawed so that nothing stays stopped forever.
        """

    def __repr__(self) -> str:
        """Debug representation."""
        return (
            f"<{type(self).__name__} {self.sandbox_id!r} backend={self.backend}"
            f" frozen={self._frozen} closed={self._closed}>"
        )


class CgroupProcessTree(ProcessTree):
    """Process tree backed by a dedicated cgroup v2 with its freezer."""

    backend = "cgroup"

    def __init__(self, sandbox_id: str, freeze_timeout: float = DEFAULT_FREEZE_TIMEOUT) -> None:
        """Create the sandbox cgroup; raises RuntimeError if impossible."""
        super().__init__(sandbox_id, freeze_timeout)
        base = _cgroup_base()
        if base is None:
            raise RuntimeError("no writable cgroup v2 hierarchy with a freezer")
        try:
            parent = _ensure_parent(base)
            name = _sanitize(sandbox_id)
            path = parent / name
            suffix = 0
            while True:
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    suffix += 1
                    path = parent / f"{name}-{suffix}"
        except OSError as exc:
            raise RuntimeError(f"cannot create sandbox cgroup: {exc}") from exc
        self.path: Path = path
        self._procs_file = path / "cgroup.procs"
        mount = _find_cgroup2_mount()
        # cgroup path as shown in /proc/<pid>/cgroup, for membership checks.
        self._cgpath = "/" + str(path.relative_to(mount[0])) if mount else ""

    def launch_prefix(self) -> list[str]:
        """``/bin/sh`` wrapper that joins the cgroup, then execs the argv."""
        if self._closed:
            raise RuntimeError("process tree is closed")
        return [
            "/bin/sh",
            "-c",
            'echo $$ > "$0" && exec "$@"',
            str(self._procs_file),
        ]

    def _contains(self, pid: int) -> bool:
        """True if ``pid`` is in this cgroup or one of its sub-cgroups."""
        cgpath = _cgroup2_path_of(pid)
        if cgpath is None or not self._cgpath:
            return False
        return cgpath == self._cgpath or cgpath.startswith(self._cgpath + "/")

    def add(self, pid: int) -> None:
        """Move ``pid`` into the cgroup unless the launch prefix already did.

        Only ``pid`` itself is moved: children it forked before this call stay
        outside, so always spawn through :meth:`launch_prefix`.
        """
        if self._closed:
            raise RuntimeError("process tree is closed")
        if self._contains(pid):
            return
        try:
            self._procs_file.write_text(f"{pid}\n")
        except ProcessLookupError:
            pass  # already gone
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise

    def _all_cgroup_pids(self) -> list[int]:
        """Pids listed in ``cgroup.procs`` of the cgroup and its sub-cgroups."""
        result: set[int] = set()
        for dirpath, _dirs, _files in os.walk(self.path):
            try:
                text = Path(dirpath, "cgroup.procs").read_text()
            except OSError:
                continue
            result.update(int(tok) for tok in text.split() if tok.isdigit())
        return sorted(result)

    def pids(self) -> list[int]:
        """Live processes of the cgroup (zombies excluded)."""
        result = []
        for pid in self._all_cgroup_pids():
            st = _read_stat(pid)
            if st is not None and st.alive:
                result.append(pid)
        return result

    def _write(self, name: str, value: str) -> None:
        """Write a cgroup interface file."""
        (self.path / name).write_text(value)

    async def freeze(self) -> None:
        """Set ``cgroup.freeze`` and wait for ``frozen 1`` in ``cgroup.events``."""
        if self._closed:
            raise RuntimeError("process tree is closed")
        self._write("cgroup.freeze", "1")
        self._frozen = True
        deadline = time.monotonic() + self.freeze_timeout
        while _read_events(self.path).get("frozen") != "1":
            if time.monotonic() >= deadline:
                logger.warning("cgroup %s not frozen after %.1fs", self.path, self.freeze_timeout)
                return
            await asyncio.sleep(_POLL_INTERVAL)

    async def thaw(self) -> None:
        """Clear ``cgroup.freeze``."""
        if self._closed:
            raise RuntimeError("process tree is closed")
        self._write("cgroup.freeze", "0")
        self._frozen = False

    def signal(self, sig: int) -> None:
        """Signal every process; ``SIGKILL`` uses ``cgroup.kill`` if present."""
        if self._closed:
            return
        if sig == _signal.SIGKILL and (self.path / "cgroup.kill").exists():
            try:
                self._write("cgroup.kill", "1")
                return
            except OSError as exc:
                logger.debug("cgroup.kill failed (%s), signalling pids", exc)
        # Repeat while new processes show up (forks racing with us).
        sent: set[int] = set()
        for _ in range(100):
            new = [p for p in self.pids() if p not in sent]
            if not new:
                break
            for pid in new:
                sent.add(pid)
                _send_verified(pid, sig, self._contains)

    def close(self) -> None:
        """Thaw if needed and remove the cgroup directory (best effort)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._frozen:
                with contextlib.suppress(OSError):
                    self._write("cgroup.freeze", "0")
                self._frozen = False
            # Exiting processes leave the cgroup asynchronously: retry briefly,
            # but don't wait for processes that are still alive.
            deadline = time.monotonic() + 0.5
            while not _rmdir_tree(self.path):
                if self.pids() or time.monotonic() >= deadline:
                    logger.debug("cgroup %s still busy; removal deferred", self.path)
                    _leftover_dirs.add(self.path)
                    return
                time.sleep(0.002)
        except Exception:  # never raise from close
            logger.exception("error closing cgroup %s", self.path)
            _leftover_dirs.add(self.path)


@dataclass(frozen=True, slots=True)
class _Ident:
    """A process identity robust against pid reuse."""

    pid: int
    starttime: int


class SignalProcessTree(ProcessTree):
    """Process tree tracked by parentage and session id, frozen with SIGSTOP."""

    backend = "signals"

    def __init__(self, sandbox_id: str, freeze_timeout: float = DEFAULT_FREEZE_TIMEOUT) -> None:
        """Create an empty tree."""
        super().__init__(sandbox_id, freeze_timeout)
        self._leaders: set[_Ident] = set()
        self._sids: set[int] = set()
        self._stopped: set[_Ident] = set()
        self._own_sid = os.getsid(0)

    def launch_prefix(self) -> list[str]:
        """No wrapper needed (always ``[]``)."""
        if self._closed:
            raise RuntimeError("process tree is closed")
        return []

    def add(self, pid: int) -> None:
        """Register a leader; its session id is tracked too.

        The leader should have been started with ``start_new_session=True``:
        a leader in the daemon's own session is tracked by parentage only.
        A leader that already exited (even if reaped) still counts: its
        session (``sid == pid``) may hold orphaned descendants.
        """
        if self._closed:
            raise RuntimeError("process tree is closed")
        if pid in (0, 1, os.getpid()):
            raise ValueError(f"refusing to manage pid {pid}")
        st = _read_stat(pid)
        if st is not None and st.alive:
            self._leaders.add(_Ident(pid, st.starttime))
        # Gone already: assume it was a session leader.  The session id can't
        # be reused while any process of that session remains, and sessions
        # nobody holds are dropped at the next scan.
        sid = st.sid if st is not None else pid
        if sid in (0, 1, self._own_sid):
            logger.warning(
                "pid %d shares the daemon's session %d; not tracking by session",
                pid,
                sid,
            )
        else:
            self._sids.add(sid)

    def _members(self) -> dict[int, _ProcStat]:
        """Current live members of the tree (one /proc snapshot)."""
        procs = _scan_processes()
        # Forget dead leaders.  A session id can only be reused once no
        # process (zombies included) has it, so drop sids nobody holds.
        self._leaders = {
            ident
            for ident in self._leaders
            if (st := procs.get(ident.pid)) is not None and st.starttime == ident.starttime
        }
        held = {st.sid for st in procs.values()}
        self._sids &= held
        children: dict[int, list[int]] = {}
        for st in procs.values():
            children.setdefault(st.ppid, []).append(st.pid)
        roots = {ident.pid for ident in self._leaders}
        roots.update(st.pid for st in procs.values() if st.sid in self._sids)
        excluded = {0, 1, os.getpid()}
        members: dict[int, _ProcStat] = {}
        stack = [p for p in roots if p not in excluded]
        while stack:
            pid = stack.pop()
            if pid in members or pid in excluded or pid not in procs:
                continue
            members[pid] = procs[pid]
            stack.extend(children.get(pid, ()))
        return {pid: st for pid, st in members.items() if st.alive}

    def _is_member(self, ident: _Ident) -> Callable[[int], bool]:
        """Check used right before signalling: same process still alive."""

        def check(pid: int) -> bool:
            st = _read_stat(pid)
            return st is not None and st.starttime == ident.starttime and st.alive

        return check

    def _send(self, st: _ProcStat, sig: int) -> bool:
        """Signal one member, guarding against pid reuse."""
        ident = _Ident(st.pid, st.starttime)
        return _send_verified(st.pid, sig, self._is_member(ident))

    def pids(self) -> list[int]:
        """Live members: leaders, their descendants and their sessions."""
        return sorted(self._members())

    def _stop_new(self, members: Iterable[_ProcStat]) -> bool:
        """SIGSTOP members not stopped yet; True if any was new."""
        found = False
        for st in members:
            ident = _Ident(st.pid, st.starttime)
            if ident in self._stopped:
                continue
            found = True
            self._stopped.add(ident)
            self._send(st, _signal.SIGSTOP)
        return found

    async def freeze(self) -> None:
        """SIGSTOP every member until no new one appears, then wait for stops."""
        if self._closed:
            raise RuntimeError("process tree is closed")
        self._frozen = True
        deadline = time.monotonic() + self.freeze_timeout
        # A process forked between a scan and its parent's SIGSTOP is found by
        # the next scan; once a scan finds nothing new, every member has a
        # pending SIGSTOP (which makes a concurrent fork() restart) so no more
        # members can appear.
        while self._stop_new(self._members().values()):
            if time.monotonic() >= deadline:
                break
        while True:
            members = self._members()
            if not self._stop_new(members.values()) and all(
                _is_stopped(st) for st in members.values()
            ):
                return
            if time.monotonic() >= deadline:
                running = [p for p, s in members.items() if not _is_stopped(s)]
                logger.warning(
                    "sandbox %s: pids %s not stopped after %.1fs",
                    self.sandbox_id,
                    running,
                    self.freeze_timeout,
                )
                return
            await asyncio.sleep(_POLL_INTERVAL)

    def _continue_all(self) -> None:
        """SIGCONT every member and every process we stopped."""
        members = self._members()
        for st in members.values():
            self._send(st, _signal.SIGCONT)
        for ident in self._stopped:
            if ident.pid not in members:
                _send_verified(ident.pid, _signal.SIGCONT, self._is_member(ident))
        self._stopped.clear()
        self._frozen = False

    async def thaw(self) -> None:
        """SIGCONT every member."""
        if self._closed:
            raise RuntimeError("process tree is closed")
        self._continue_all()

    def signal(self, sig: int) -> None:
        """Signal every member, rescanning while new members appear."""
        if self._closed:
            return
        sent: set[_Ident] = set()
        for _ in range(100):
            new = [
                st for st in self._members().values() if _Ident(st.pid, st.starttime) not in sent
            ]
            if not new:
                break
            for st in new:
                sent.add(_Ident(st.pid, st.starttime))
                self._send(st, sig)

    def close(self) -> None:
        """Thaw if frozen and forget all state."""
        if self._closed:
            return
        try:
            if self._frozen:
                self._continue_all()
        except Exception:  # never raise from close
            logger.exception("error thawing sandbox %s on close", self.sandbox_id)
        self._closed = True
        self._leaders.clear()
        self._sids.clear()
        self._stopped.clear()


def make_process_tree(
    sandbox_id: str,
    backend: str = "auto",
    *,
    freeze_timeout: float = DEFAULT_FREEZE_TIMEOUT,
) -> ProcessTree:
    """Create the process tree of a sandbox.

    ``backend`` is ``"auto"`` (cgroup if available, else signals; the
    ``SANDBOXKIT_FREEZER`` environment variable can force either), ``"cgroup"``
    (RuntimeError if unavailable) or ``"signals"``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"unknown freezer backend {backend!r}; use {_BACKENDS}")
    forced = False
    if backend == "auto":
        env = os.environ.get(FREEZER_ENV_VAR, "").strip().lower() or "auto"
        if env not in _BACKENDS:
            raise ValueError(f"invalid {FREEZER_ENV_VAR}={env!r}; use {_BACKENDS}")
        backend = env
        forced = env != "auto"
    else:
        forced = True
    if backend == "signals":
        return SignalProcessTree(sandbox_id, freeze_timeout)
    if backend == "cgroup" or cgroup_v2_available():
        try:
            return CgroupProcessTree(sandbox_id, freeze_timeout)
        except RuntimeError:
            if forced:
                raise
            logger.warning("cgroup freezer unusable; falling back to signals")
    return SignalProcessTree(sandbox_id, freeze_timeout)


def process_is_frozen(pid: int) -> bool:
    """True if ``pid`` is stopped by a signal or sits in a frozen cgroup v2.

    A process in uninterruptible sleep with a pending ``SIGSTOP`` (e.g. a
    ``vfork()`` parent whose child was stopped before exec) counts as
    stopped: it cannot run user code before stopping.

    Note that processes frozen by the cgroup freezer look ``sleeping`` to
    psutil/ps; only ``cgroup.events`` tells that they are frozen.
    """
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return False
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return True
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return False
    if status == psutil.STATUS_DISK_SLEEP and _stop_pending(pid):
        return True
    cgpath = _cgroup2_path_of(pid)
    found = _find_cgroup2_mount()
    if cgpath is None or found is None:
        return False
    cgdir = _cgroup_dir(found[0], cgpath.removesuffix(" (deleted)"))
    return _read_events(cgdir).get("frozen") == "1"
