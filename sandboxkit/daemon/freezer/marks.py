"""The owner mark: every process a sandbox starts carries, in its environment, which daemon,
sandbox and launch it belongs to — so it can be found after it left its parent, its
session and its process group, and after its daemon died.

``SANDBOXKIT_OWNER=<daemon pid>.<start time>.<pid namespace>.<uid>/<sandbox id>/<launch>``
(the daemon's pid, start time, pid namespace and user)

The pid namespace is there because pids are per namespace: a daemon in a container and one
on its host see the same process under different pids, and neither may judge the other's
marks (the host would take a live container daemon for dead). The uid is there because a
daemon reclaims only what its own user's daemons left: a root daemon never ends another
user's dead daemon's processes (marks without it, from before, are judged as before).

Children inherit their parent's environment, so a double-forked, setsid'd grandchild
still carries its leader's mark; ``/proc/<pid>/environ`` shows it to the daemon's user.
With the ``signals`` freezer (no cgroup) the mark is how a sandbox finds such processes,
and the only way a successor finds what a dead daemon left: a daemon that starts kills
every process marked by a daemon that no longer runs (:func:`reap_marked_orphans`) —
with their sessions and descendants, which share their fate.

What a mark cannot reach: a process that left the sandbox's parentage and sessions *and*
replaced its environment (``env -i``, a program that execs with a clean environment)
before the daemon looked, and processes of another user (their environment is not ours
to read). The cgroup freezer has no such gap.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Final

from sandboxkit.daemon.freezer.proc import (
    Ident,
    ProcStat,
    ident_of,
    pid_alive,
    read_environ_var,
    read_stat,
    scan_processes,
    send_to,
)

__all__ = [
    "MARK_VAR",
    "Mark",
    "MarkReader",
    "daemon_ident",
    "daemon_mark",
    "reap_marked_orphans",
]

MARK_VAR: Final = "SANDBOXKIT_OWNER"
_POLL_INTERVAL: Final = 0.01


@dataclass(frozen=True, slots=True)
class Mark:
    """A parsed owner mark."""

    daemon: Ident
    pidns: int
    sandbox_id: str
    launch: str
    uid: int | None = None
    """The daemon's user (None in a mark from before it was written)."""

    def __str__(self) -> str:
        daemon = f"{self.daemon.pid}.{self.daemon.starttime}.{self.pidns}"
        if self.uid is not None:
            daemon += f".{self.uid}"
        return f"{daemon}/{self.sandbox_id}/{self.launch}"

    @classmethod
    def parse(cls, text: str) -> Mark | None:
        daemon, _, rest = text.partition("/")
        sandbox_id, _, launch = rest.partition("/")
        try:
            parts = [int(part) for part in daemon.split(".")]
        except ValueError:
            return None
        if len(parts) not in (3, 4):
            return None
        uid = parts[3] if len(parts) == 4 else None
        return cls(Ident(parts[0], parts[1]), parts[2], sandbox_id, launch, uid)


def _pid_namespace() -> int:
    """This process's pid namespace (0 where the kernel does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@functools.cache
def _daemon_ident(pid: int) -> tuple[Ident, int]:
    ident = ident_of(pid)
    assert ident is not None, "this process runs"
    return ident, _pid_namespace()


def daemon_ident() -> Ident:
    """This process's identity (the ``os.getpid()`` argument keeps it right after a fork)."""
    return _daemon_ident(os.getpid())[0]


def daemon_mark(sandbox_id: str, launch: str) -> Mark:
    """The mark of a process this daemon starts for ``launch`` of ``sandbox_id``."""
    ident, pidns = _daemon_ident(os.getpid())
    return Mark(ident, pidns, sandbox_id, launch, os.geteuid())


class MarkReader:
    """Reads marks, remembering each process's answer.

    A process's environment changes only when it execs. Remembering the first answer per
    ``(pid, start time)`` keeps a member a member after it execs with a clean environment
    (it was ours when we first looked), and keeps a freeze's repeated scans from
    re-reading every process's environment.
    """

    def __init__(self) -> None:
        self._seen: dict[Ident, Mark | None] = {}

    def mark(self, st: ProcStat) -> Mark | None:
        ident = st.ident
        if ident not in self._seen:
            text = read_environ_var(st.pid, MARK_VAR)
            self._seen[ident] = Mark.parse(text) if text is not None else None
        return self._seen[ident]

    def forget_others(self, live: dict[int, ProcStat]) -> None:
        """Drop what is remembered of processes no longer in ``live``."""
        self._seen = {i: m for i, m in self._seen.items() if i.pid in live}


def _daemon_dead(daemon: Ident) -> bool:
    if daemon.pid == os.getpid():
        return False
    st = read_stat(daemon.pid)
    if st is None:
        return not pid_alive(daemon.pid)  # hidden from /proc but running: not dead
    return not st.alive or st.starttime != daemon.starttime


def _orphans(procs: dict[int, ProcStat], marks: MarkReader) -> dict[int, int]:
    """Processes of dead daemons (pid -> daemon pid): the marked ones, the members of
    their sessions and everything below them."""
    own = {0, 1, os.getpid()}
    pidns = _daemon_ident(os.getpid())[1]
    dead: dict[Ident, bool] = {}
    found: dict[int, int] = {}
    for st in procs.values():
        if st.pid in own or not st.alive:
            continue
        mark = marks.mark(st)
        if mark is None or mark.pidns != pidns:
            continue  # not marked, or by a daemon whose pids are not ours to look up
        if mark.uid is not None and mark.uid != os.geteuid():
            continue  # another user's daemon's: not ours to end
        if mark.daemon not in dead:
            dead[mark.daemon] = _daemon_dead(mark.daemon)
        if dead[mark.daemon]:
            found[st.pid] = mark.daemon.pid
    # A session id cannot be reused while any process holds it, so the sessions of marked
    # processes are theirs — unless its leader runs unmarked (a session we did not make).
    protected = {0, 1, os.getsid(0)}
    sessions: dict[int, int] = {}
    for pid, daemon in found.items():
        sid = procs[pid].sid
        leader = procs.get(sid)
        if sid not in protected and (leader is None or not leader.alive or sid in found):
            sessions[sid] = daemon
    for st in procs.values():
        if st.pid not in own and st.alive and st.sid in sessions and st.pid not in found:
            found[st.pid] = sessions[st.sid]
    children: dict[int, list[int]] = {}
    for st in procs.values():
        children.setdefault(st.ppid, []).append(st.pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found and child not in own and procs[child].alive:
                found[child] = found.get(procs[child].ppid, 0)
                stack.append(child)
    return found


def reap_marked_orphans(timeout: float = 2.0) -> list[dict[str, Any]]:
    """Kill every process left by a daemon that no longer runs, found by owner mark (see
    the module's docstring for what cannot be found). One report per dead daemon
    (blocking; reads the environment of every process once, then of new ones)."""
    marks = MarkReader()
    killed: dict[int, set[Ident]] = {}
    deadline = time.monotonic() + timeout
    while True:
        procs = scan_processes()
        found = _orphans(procs, marks)
        if not found:
            break
        for pid, daemon in found.items():
            ident = procs[pid].ident
            # SIGKILL works on stopped processes too: no SIGCONT needed first.
            if send_to(ident, signal.SIGKILL):
                killed.setdefault(daemon, set()).add(ident)
        if time.monotonic() >= deadline:
            break
        marks.forget_others(procs)
        time.sleep(_POLL_INTERVAL)  # sleep-ok: the killed leave /proc asynchronously
    return [
        {"found": "processes", "daemon_pid": daemon, "processes_killed": len(idents)}
        for daemon, idents in sorted(killed.items())
    ]
