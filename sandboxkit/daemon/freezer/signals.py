"""The signals freezer, for where no cgroup v2 is writable: ``SIGSTOP``/``SIGCONT`` sent to
each member, found in ``/proc``.

Members are the registered leaders, everything below them (by parent pid), every process
in a leader's session (double-forked daemons, reparented to init, keep it), and every
process carrying the sandbox's owner mark (see :mod:`~sandboxkit.daemon.freezer.marks`;
it catches what also left the session with ``setsid()``). A process cannot hide from all
four unless it replaces its environment after leaving; the cgroup freezer has no such gap.

Finding the last two means reading every process on the host (0.5-1 ms for a hundred).
Where every launch is *contained* (an isolated sandbox: each leader is bubblewrap's
monitor, whose child is the init of a PID namespace of the launch's own), nothing can
leave the tree below the leaders: a process cannot leave its PID namespace, and orphans
go to its init. Membership is then a walk down ``/proc/<pid>/task/<tid>/children`` from
the leaders, tens of microseconds, as long as every leader lives and no launch is between
its spawn and its :meth:`~Freezer.add`. A monitor exits with its command, and what the
command left running inside lives on under the host's init (so does all of it when the
monitor is killed): from then on, the scan.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterable
from typing import Final

from sandboxkit.daemon.freezer.base import DEFAULT_FREEZE_TIMEOUT, Freezer
from sandboxkit.daemon.freezer.proc import (
    Ident,
    ProcStat,
    boot_ticks,
    children_listed,
    children_of,
    is_stopped,
    read_stat,
    scan_processes,
    send_to,
)

__all__ = ["SignalFreezer"]

logger = logging.getLogger(__name__)

_FIRST_RECHECK: Final = 0.0005
_MAX_RECHECK: Final = 0.005


class SignalFreezer(Freezer):
    """A sandbox's processes tracked by parentage, session and owner mark; frozen with
    ``SIGSTOP``."""

    backend = "signals"

    def __init__(self, sandbox_id: str, freeze_timeout: float = DEFAULT_FREEZE_TIMEOUT) -> None:
        super().__init__(sandbox_id, freeze_timeout)
        self._leaders: set[Ident] = set()
        self._sids: set[int] = set()
        self._stopped: set[Ident] = set()
        self._open = False
        """Whether any launch was not contained (then membership always takes a scan)."""
        self._own_sid = os.getsid(0)
        # Nothing that started before the sandbox can carry its mark: older processes'
        # environments need not be read.
        self._born = boot_ticks() - 1

    def launch_prefix(self) -> list[str]:
        """No wrapper needed (always ``[]``)."""
        if self._closed:
            raise RuntimeError("freezer is closed")
        return []

    def _adopt(self, pid: int, contained: bool, born: ProcStat | None) -> None:
        """Register a leader and its session.

        A leader should be started with ``start_new_session=True``: one in the daemon's
        own session is tracked without it. A leader that already exited (even reaped)
        still counts: its session (``sid == pid``) may hold orphans.
        """
        if pid in (0, 1, os.getpid()):
            raise ValueError(f"refusing to manage pid {pid}")
        st = born if born is not None else read_stat(pid)
        if st is not None and st.alive:
            self._leaders.add(st.ident)
        # Gone already: assume it led its session. A session id cannot be reused while a
        # process of that session remains, and sessions nobody holds are dropped next scan.
        sid = st.sid if st is not None else pid
        if sid in (0, 1, self._own_sid):
            logger.warning("pid %d shares the daemon's session %d; not tracked by it", pid, sid)
        else:
            self._sids.add(sid)
        if not contained:
            self._open = True

    def members(self) -> dict[int, ProcStat]:
        """Live members right now (a walk down from the leaders where that finds them
        all, else one scan of ``/proc``)."""
        walked = self._walk()
        if walked is not None:
            return walked
        procs = scan_processes()
        self._leaders = {
            ident
            for ident in self._leaders
            if (st := procs.get(ident.pid)) is not None and st.starttime == ident.starttime
        }
        self._sids &= {st.sid for st in procs.values()}
        excluded = {0, 1, os.getpid()}
        roots = {ident.pid for ident in self._leaders}
        for st in procs.values():
            if st.sid in self._sids or (
                st.starttime >= self._born and self._is_ours(self._marks.mark(st))
            ):
                roots.add(st.pid)
        self._marks.forget_others(procs)
        children: dict[int, list[int]] = {}
        for st in procs.values():
            children.setdefault(st.ppid, []).append(st.pid)
        members: dict[int, ProcStat] = {}
        stack = [p for p in roots if p not in excluded]
        while stack:
            pid = stack.pop()
            if pid in members or pid in excluded or pid not in procs:
                continue
            members[pid] = procs[pid]
            stack.extend(children.get(pid, ()))
        return {pid: st for pid, st in members.items() if st.alive}

    def _walk(self) -> dict[int, ProcStat] | None:
        """Every member, found below the leaders alone; None unless that is sure to be all
        of them (see the module's docstring)."""
        if self._open or self._launching or not children_listed():
            return None
        found: dict[int, ProcStat] = {}
        for ident in tuple(self._leaders):  # add() runs in a thread
            st = read_stat(ident.pid)
            if st is None or not st.alive or st.starttime != ident.starttime:
                return None  # what it contained may live on elsewhere
            found[st.pid] = st
        if not self._sids <= found.keys():
            return None  # a session whose leader is gone may still hold processes
        stack = list(found)
        while stack:
            parent = stack.pop()
            for pid in children_of(parent):
                # Still its child: not a pid freed and reused since the list was read.
                if pid not in found and (st := read_stat(pid)) is not None and st.ppid == parent:
                    found[pid] = st
                    stack.append(pid)
        return {pid: st for pid, st in found.items() if st.alive}

    def _stop_new(self, members: Iterable[ProcStat]) -> bool:
        """SIGSTOP members not stopped yet; True if any was new."""
        found = False
        for st in members:
            if st.ident in self._stopped:
                continue
            found = True
            self._stopped.add(st.ident)
            send_to(st.ident, signal.SIGSTOP)
        return found

    async def freeze(self) -> None:
        """SIGSTOP every member until no new one appears, then wait for them to stop."""
        if self._closed:
            raise RuntimeError("freezer is closed")
        self._frozen = True
        deadline = time.monotonic() + self.freeze_timeout
        # A process forked between a scan and its parent's SIGSTOP is found by the next
        # scan; once a scan finds nothing new, every member has a pending SIGSTOP (which
        # makes a concurrent fork() restart), so no more members can appear.
        members = self.members()
        while self._stop_new(members.values()) and time.monotonic() < deadline:
            members = self.members()
        # Stopped processes must run to stop: usually within a scheduler tick. Until they
        # all did, only their own states are read again (a scan of /proc costs as much as
        # reading each of tens of members); then one scan, for any member it missed (a
        # process stopped forks nothing more). The interval grows rather than spin.
        recheck = _FIRST_RECHECK
        while True:
            if not self._stop_new(members.values()) and all(
                is_stopped(st) for st in members.values()
            ):
                return
            if time.monotonic() >= deadline:
                running = [p for p, s in members.items() if not is_stopped(s)]
                logger.warning(
                    "sandbox %s: pids %s not stopped after %.1fs",
                    self.sandbox_id,
                    running,
                    self.freeze_timeout,
                )
                return
            await asyncio.sleep(recheck)
            recheck = min(recheck * 2, _MAX_RECHECK)
            members = _restat(members)
            if all(is_stopped(st) for st in members.values()):
                members = self.members()

    def _continue_all(self) -> None:
        """SIGCONT every process we stopped: every member there was when the freeze
        ended, already stopped or not (a member that appeared since was never stopped:
        a stopped process forks nothing). No scan of ``/proc``, which on a host of many
        processes is most of a resume."""
        for ident in self._stopped:
            send_to(ident, signal.SIGCONT)
        self._stopped.clear()
        self._frozen = False

    async def thaw(self) -> None:
        """SIGCONT every member."""
        if self._closed:
            raise RuntimeError("freezer is closed")
        self._continue_all()

    def signal(self, sig: int) -> None:
        """Signal every member, rescanning while new members appear."""
        if self._closed:
            return
        sent: set[Ident] = set()
        for _ in range(100):
            new = [st.ident for st in self.members().values() if st.ident not in sent]
            if not new:
                break
            for ident in new:
                sent.add(ident)
                send_to(ident, sig)

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


def _restat(members: dict[int, ProcStat]) -> dict[int, ProcStat]:
    """The same processes read again (those that exited, or whose pid was reused, gone)."""
    fresh: dict[int, ProcStat] = {}
    for pid, old in members.items():
        st = read_stat(pid)
        if st is not None and st.alive and st.starttime == old.starttime:
            fresh[pid] = st
    return fresh
