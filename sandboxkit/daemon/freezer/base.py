"""What every freezer does: hold all processes of one sandbox, freeze them, thaw them,
signal them — all of them, or all that one launch started.

A *launch* is one process the daemon starts (a leader) and everything it starts in turn.
Killing or restarting that process must end all of it, including what escaped the
leader's parentage and session, while the sandbox's other processes live on. Membership
of a launch is decided here, once, for both backends: among the sandbox's members, the
leader, its session, the processes whose owner mark (see
:mod:`~sandboxkit.daemon.freezer.marks`) names the launch, and everything below those.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Final

from sandboxkit.daemon.freezer.marks import MARK_VAR, Mark, MarkReader, daemon_ident, daemon_mark
from sandboxkit.daemon.freezer.proc import (
    Ident,
    ProcStat,
    ident_of,
    namespace_init,
    read_stat,
    send_to,
)
from sandboxkit.daemon.off_loop import off_loop

__all__ = ["DEFAULT_FREEZE_TIMEOUT", "SETTLE_AFTER", "Freezer"]

DEFAULT_FREEZE_TIMEOUT: Final = 2.0
"""Seconds allowed for a freeze to take effect."""

SETTLE_AFTER: Final = (0.005, 0.02, 0.1, 0.5)
"""Seconds after a contained launch's spawn (then after each look) that
:meth:`Freezer.settle_soon` settles it: its command is born 2-3 ms after the spawn, later
while the sandbox is paused; after the last, what is left stays."""

_MAX_ROUNDS: Final = 100
"""Signalling rescans while new processes keep appearing (a fork bomb ends the loop)."""


class Freezer(abc.ABC):
    """All processes of one sandbox, which can be frozen, thawed and signalled.

    Usage: spawn each process as ``launch_prefix() + argv`` with ``launch_env(launch)`` in
    its environment and ``start_new_session=True``, then call ``add(pid, launch)``; in a
    daemon, where other work runs meanwhile, both inside ``with launching(launch)``.
    """

    backend: str
    """``"cgroup"`` or ``"signals"``."""

    def __init__(self, sandbox_id: str, freeze_timeout: float) -> None:
        self.sandbox_id = sandbox_id
        self.freeze_timeout = freeze_timeout
        self._frozen = False
        self._closed = False
        self._marks = MarkReader()
        self._launches: dict[str, Ident] = {}
        self._launching: set[str] = set()

    # -- joining ---------------------------------------------------------------------

    @abc.abstractmethod
    def launch_prefix(self) -> list[str]:
        """The argv prefix to put before each process's argv (cgroup: a wrapper that joins
        the sandbox's cgroup before ``exec``; signals: nothing)."""

    def cgroup_joins(self) -> list[str]:
        """The ``cgroup.procs`` files a launch writes its pid to before anything else runs
        (what :meth:`launch_prefix` joins, for a wrapper that also does more: see
        :mod:`~sandboxkit.daemon.launch`)."""
        return []

    def launch_env(self, launch: str) -> dict[str, str]:
        """Environment for the process of ``launch``: its owner mark."""
        return {MARK_VAR: str(daemon_mark(self.sandbox_id, launch))}

    @contextlib.contextmanager
    def launching(self, launch: str) -> Iterator[None]:
        """Around a launch's spawn and its :meth:`add`: meanwhile it runs unregistered,
        and only its owner mark tells it is the sandbox's (the signals freezer then
        looks for it in all of ``/proc``)."""
        self._launching.add(launch)
        try:
            yield
        finally:
            self._launching.discard(launch)

    def add(
        self,
        pid: int,
        launch: str | None = None,
        *,
        contained: bool = False,
        born: ProcStat | None = None,
    ) -> None:
        """Register a newly started leader (of ``launch``, when it has one).
        ``contained``: it runs in a PID namespace of its own, whose init is its child
        (bubblewrap's), so nothing it starts can leave the tree below it. ``born``: it
        was forked by a member (the sandbox's launcher), and this is what ``/proc`` said
        of it then: a member from birth, not read again."""
        if self._closed:
            raise RuntimeError("freezer is closed")
        self._adopt(pid, contained, born)
        if launch is None:
            return
        ident = born.ident if born is not None else ident_of(pid)
        if ident is not None:
            self._launches[launch] = ident

    def settle(self, launch: str) -> bool:
        """After :meth:`add` of ``launch``'s ``contained`` leader, while it runs (blocking:
        in a thread): what the backend does once the launch's command is born; False to
        be asked again later, the command not being born yet. Nothing here (see
        :meth:`~sandboxkit.daemon.freezer.cgroup.CgroupFreezer.settle`)."""
        return True

    async def settle_soon(self, launch: str, running: Callable[[], bool]) -> None:
        """:meth:`settle` ``launch`` (in a thread) at each of :data:`SETTLE_AFTER` after
        its spawn until it is done, and only while ``running()``: most commands of a
        ``run`` are over by the first, and a look while they start competed with them
        (``run(["true"])`` +0.27 ms on 2 cores)."""
        for delay in SETTLE_AFTER:
            await asyncio.sleep(delay)  # sleep-ok: a pace; a process over by then needs nothing
            if self._closed or not running() or await off_loop(self.settle, launch):
                return

    @abc.abstractmethod
    def _adopt(self, pid: int, contained: bool, born: ProcStat | None) -> None:
        """Make ``pid`` a member (the backend's part of :meth:`add`)."""

    # -- membership ------------------------------------------------------------------

    @abc.abstractmethod
    def members(self) -> dict[int, ProcStat]:
        """Every live (non-zombie) process of the sandbox right now."""

    def pids(self) -> list[int]:
        """Every live process of the sandbox right now, sorted."""
        return sorted(self.members())

    def _is_ours(self, mark: Mark | None, launch: str | None = None) -> bool:
        """True if ``mark`` names this sandbox of this daemon (and ``launch``, if given)."""
        return (
            mark is not None
            and mark.sandbox_id == self.sandbox_id
            and mark.daemon == daemon_ident()
            and launch in (None, mark.launch)
        )

    def launch_members(self, launch: str) -> dict[int, ProcStat]:
        """The live processes ``launch`` started, wherever they went since."""
        members = self.members() if not self._closed else {}
        leader = self._launches.get(launch)
        # The leader's session (its sid is its pid) is the launch's while that pid is not
        # someone else's: a session id is reserved while any process holds it, but once the
        # session emptied, the pid may lead a new one.
        session = None
        if leader is not None:
            now = read_stat(leader.pid)
            session = leader.pid if now is None or now.starttime == leader.starttime else None
        chosen: set[int] = set()
        for st in members.values():
            if (
                st.ident == leader
                or st.sid == session
                or self._is_ours(self._marks.mark(st), launch)
            ):
                chosen.add(st.pid)
        children: dict[int, list[int]] = {}
        for st in members.values():
            children.setdefault(st.ppid, []).append(st.pid)
        stack = list(chosen)
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in chosen:
                    chosen.add(child)
                    stack.append(child)
        return {pid: members[pid] for pid in chosen}

    # -- acting ----------------------------------------------------------------------

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

        If they are not all stopped within ``freeze_timeout`` a warning is logged and the
        freezer stays frozen (the stop still takes effect, e.g. once an uninterruptible
        sleep ends).
        """

    @abc.abstractmethod
    async def thaw(self) -> None:
        """Continue every process of the sandbox."""

    @abc.abstractmethod
    def signal(self, sig: int) -> None:
        """Send ``sig`` to every live process of the sandbox.

        While frozen only ``SIGKILL`` acts at once; other signals are delivered on thaw.
        """

    def signal_launch(self, launch: str, sig: int, sent: set[Ident] | None = None) -> None:
        """Send ``sig`` to every live process ``launch`` started (see the module's
        docstring), rescanning while new ones appear. ``sent``: the processes that had it
        already (skipped), and those that get it now are added: a later call reaches only
        those born since."""
        if self._closed:
            return
        sent = set() if sent is None else sent
        for _ in range(_MAX_ROUNDS):
            members = self.launch_members(launch)
            new = [st.ident for st in _parents_first(members) if st.ident not in sent]
            if not new:
                return
            for ident in new:
                sent.add(ident)
                send_to(ident, sig)

    def end_empty_inits(self, launch: str) -> None:
        """SIGKILL each process of ``launch`` that is a PID namespace's init with no
        process left under it and no parent of the launch's: a SIGTERM from here does not
        reach it, and it has nothing to end gracefully. Bubblewrap's, when its monitor died
        of that SIGTERM before the namespace was set up (a kill just after the spawn),
        waits for the monitor forever, holding the command's pipes. One whose monitor
        lives has just lost its command and is passing on how it ended: killed then, the
        monitor reported the init's SIGKILL for the command's SIGTERM."""
        if self._closed:
            return
        members = self.launch_members(launch)
        parents = {st.ppid for st in members.values()}
        waiting = set(members)
        if (leader := self._launches.get(launch)) is not None:
            waiting.add(leader.pid)  # bubblewrap's monitor, out of the cgroup once settled
        for st in members.values():
            if st.pid not in parents and st.ppid not in waiting and namespace_init(st.pid):
                send_to(st.ident, signal.SIGKILL)

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the freezer holds (the cgroup). Idempotent, never raises.

        Processes are not killed (``signal(SIGKILL)`` first), but a frozen sandbox is
        thawed, so nothing stays stopped forever.
        """

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.sandbox_id!r} backend={self.backend}"
            f" frozen={self._frozen} closed={self._closed}>"
        )


def _parents_first(members: dict[int, ProcStat]) -> list[ProcStat]:
    """``members`` with each process before those below it. A shell signalled after the
    command it waits for may see that command die first and exit by itself (143, or
    whatever its script does next) instead of by the signal: the daemon, preempted between
    two ``kill()`` calls, made ``kill()`` of ``sh -c "sleep 60"`` report 143, not -15."""

    def depth(st: ProcStat) -> int:
        level, parent = 0, st.ppid
        while parent in members and level < len(members):
            level, parent = level + 1, members[parent].ppid
        return level

    return sorted(members.values(), key=depth)
