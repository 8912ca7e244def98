"""What ``/proc`` says about processes, read the way the freezer needs it: cheaply, without
psutil on the hot path, and safe against a pid the kernel handed to someone else.

A pid alone names a process only until it exits and the number is reused, so every
identity here is ``(pid, start time)`` (:class:`Ident`), and every signal goes through a
pidfd opened *before* the last check (:func:`send_verified`).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from sandboxkit._proc import pid_alive

__all__ = [
    "Ident",
    "ProcStat",
    "boot_ticks",
    "exit_status",
    "ident_of",
    "is_stopped",
    "namespace_init",
    "pid_alive",
    "pidfd_pid",
    "read_environ_var",
    "read_stat",
    "scan_processes",
    "send_to",
    "send_verified",
    "stop_pending",
]

logger = logging.getLogger(__name__)

_STOPPED_STATES: Final = frozenset({"T", "t"})
_DEAD_STATES: Final = frozenset({"Z", "X", "x"})
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Ident:
    """A process identity robust against pid reuse: start times differ."""

    pid: int
    starttime: int


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the freezer needs."""

    pid: int
    state: str
    ppid: int
    sid: int
    starttime: int
    """Clock ticks after boot."""

    @property
    def alive(self) -> bool:
        """True unless the process is a zombie or dead."""
        return self.state not in _DEAD_STATES

    @property
    def ident(self) -> Ident:
        return Ident(self.pid, self.starttime)


def read_stat(pid: int | str) -> ProcStat | None:
    """Parse ``/proc/<pid>/stat``; None if the process does not exist."""
    data = _read(f"/proc/{pid}/stat")
    if data is None:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        return ProcStat(
            pid=int(data[: data.find(b" ")]),
            state=rest[0].decode("ascii", "replace"),
            ppid=int(rest[1]),
            sid=int(rest[3]),
            starttime=int(rest[19]),
        )
    except (IndexError, ValueError):
        return None


_PIDFD_LINK: Final = "anon_inode:[pidfd]"


def pidfd_pid(fd: int) -> int | None:
    """The pid (in this process's PID namespace) of the process the pidfd ``fd`` refers
    to; None if ``fd`` is no pidfd, or of no live process."""
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != _PIDFD_LINK:
            return None
    except OSError:
        return None
    data = _read(f"/proc/self/fdinfo/{fd}")
    for line in (data or b"").splitlines():
        if line.startswith(b"Pid:"):
            try:
                pid = int(line.split()[1])
            except (IndexError, ValueError):
                return None
            return pid if pid > 0 else None
    return None


def namespace_init(pid: int) -> bool:
    """True if ``pid`` is the init (pid 1) of a PID namespace below this one: its
    ``NSpid`` (its pid in each namespace, outermost first) ends in 1. Such a process
    ignores every signal from outside its namespace but SIGKILL and SIGSTOP, unless it
    handles it."""
    data = _read(f"/proc/{pid}/status")
    for line in (data or b"").splitlines():
        if line.startswith(b"NSpid:"):
            pids = line.split()[1:]
            return len(pids) > 1 and pids[-1] == b"1"
    return False


def _read(path: str) -> bytes | None:
    """A small ``/proc`` file whole (one read: the kernel makes it in one go), or None.
    ``os.open`` rather than ``open()``: a scan reads every process's ``stat``, and the file
    object's set-up was half the cost of each."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


@functools.cache
def children_listed() -> bool:
    """Whether this kernel lists a thread's children in ``/proc`` (``CONFIG_PROC_CHILDREN``,
    which every major distribution's kernel has)."""
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children")


def children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s children, from each of its threads' ``children`` file (see
    :func:`children_listed`; a thread's own forks are listed under it). Empty if it is
    gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tids:
        data = _read(f"/proc/{pid}/task/{tid}/children")
        if data:
            found.extend(int(child) for child in data.split())
    return found


def exit_status(ident: Ident) -> int | None:
    """The wait status of ``ident`` while it is a zombie (ended, not yet reaped by its
    parent), as ``waitpid`` would give it to that parent (``/proc/<pid>/stat``'s 52nd
    field, Linux 3.5); None if it is not one. The kernel shows 0 there to a process that
    may not ptrace it: the daemon may ptrace its sandboxes' processes (as root, or as
    their user, owning their user namespace)."""
    data = _read(f"/proc/{ident.pid}/stat")
    if data is None:
        return None
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        if rest[0] != b"Z" or int(rest[19]) != ident.starttime:
            return None
        return int(rest[49])
    except (IndexError, ValueError):
        return None


def ident_of(pid: int | str) -> Ident | None:
    """The identity of a live process (``"self"`` works), or None."""
    st = read_stat(pid)
    return st.ident if st is not None and st.alive else None


def scan_processes() -> dict[int, ProcStat]:
    """Snapshot every process (thread-group leaders) listed in ``/proc``."""
    result: dict[int, ProcStat] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return result
    for name in names:
        if name.isdigit() and (st := read_stat(name)) is not None:
            result[st.pid] = st
    return result


def boot_ticks() -> int:
    """Now, in the clock of ``ProcStat.starttime`` (ticks after boot), or a little before.

    A process that started before this moment cannot have been started by what starts
    after it; the freezer uses that to skip reading most processes' environments. Older
    kernels count start times on the monotonic clock, newer ones on the boot-time clock;
    the monotonic one is never ahead of the other, so nothing new is ever skipped.
    """
    return int(time.clock_gettime(time.CLOCK_MONOTONIC) * _CLOCK_TICKS)


def read_environ_var(pid: int, name: str) -> str | None:
    """The value of ``name`` in the environment ``pid`` was started with (as of its last
    ``execve``), or None if absent or unreadable (another user's process, a kernel
    thread, gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    key = name.encode() + b"="
    for entry in data.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key) :].decode("utf-8", "replace")
    return None


def send_verified(pid: int, sig: int, still_ours: Callable[[int], bool]) -> bool:
    """Send ``sig`` to ``pid`` if ``still_ours(pid)`` holds; True if sent.

    The pidfd is opened first and the check made afterwards, so the signal reaches exactly
    the process that passed the check even if the pid is reused in between. Falls back to
    :func:`os.kill` where pidfds are unsupported.
    """
    fd = -1
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:
        fd = -1  # ENOSYS/EINVAL: an old kernel
    try:
        if not still_ours(pid):
            return False
        if fd >= 0:
            signal.pidfd_send_signal(fd, sig)
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


def send_to(ident: Ident, sig: int) -> bool:
    """Send ``sig`` to the process ``ident`` names, unless its pid now names another."""

    def same(pid: int) -> bool:
        st = read_stat(pid)
        return st is not None and st.alive and st.starttime == ident.starttime

    return send_verified(ident.pid, sig, same)


def stop_pending(pid: int) -> bool:
    """True if ``SIGSTOP`` is pending for ``pid`` (per ``/proc/<pid>/status``)."""
    bit = 1 << (signal.SIGSTOP - 1)
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit:
                    return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def is_stopped(st: ProcStat) -> bool:
    """True if the process is stopped, or can only stop next.

    A process in uninterruptible sleep (``D``) with a pending ``SIGSTOP`` cannot run user
    code again before stopping. This matters for ``vfork()``: the parent waits in ``D``
    until its child execs, and never will if the child got stopped first.
    """
    if st.state in _STOPPED_STATES:
        return True
    return st.state == "D" and stop_pending(st.pid)
