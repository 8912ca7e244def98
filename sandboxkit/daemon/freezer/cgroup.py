"""The cgroup freezer: one cgroup v2 per sandbox, ``<base>/sandboxkit-<daemon pid>/sb-<id>``.

Processes join race-free through the launch prefix, a ``/bin/sh`` wrapper that writes its
own pid to ``cgroup.procs`` and then execs the real program, so every descendant is born
inside. Nothing leaves a cgroup by forking, double-forking or ``setsid()``, so freezing
(``cgroup.freeze``) and killing (``cgroup.kill``) reach every process, and membership is
one read of ``cgroup.procs`` — no walk of ``/proc``.

An isolated launch's bubblewrap monitor is born inside too, and moved out once the
command is (:meth:`CgroupFreezer.settle`): it is not the sandbox's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import select
import signal
import threading
import time
from pathlib import Path
from typing import Final

from sandboxkit.daemon.freezer.base import DEFAULT_FREEZE_TIMEOUT, Freezer
from sandboxkit.daemon.freezer.cgroupfs import (
    cgroup2_mount,
    cgroup2_path_of,
    cgroup_base,
    cgroup_pids,
    rmdir_tree,
)
from sandboxkit.daemon.freezer.daemon_cgroup import (
    LAUNCHERS_SUFFIX,
    daemon_cgroup,
    defer_removal,
)
from sandboxkit.daemon.freezer.proc import (
    ProcStat,
    children_of,
    ident_of,
    read_stat,
    send_verified,
)

__all__ = ["CgroupFreezer"]

logger = logging.getLogger(__name__)

_LOOK_AGAIN: Final = 0.001
"""Seconds a freeze re-reads ``cgroup.events`` each turn of the loop before it waits."""
_FIRST_RECHECK: Final = 0.0002
_MAX_RECHECK: Final = 0.005
_CLOSE_WAIT: Final = 0.5


def _dir_name(sandbox_id: str) -> str:
    """A safe cgroup directory name for a sandbox id."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", sandbox_id)[:100]
    return f"sb-{cleaned or 'anon'}"


class CgroupFreezer(Freezer):
    """A sandbox's processes held in a dedicated cgroup v2 with its freezer."""

    backend = "cgroup"

    def __init__(self, sandbox_id: str, freeze_timeout: float = DEFAULT_FREEZE_TIMEOUT) -> None:
        """Create the sandbox's cgroup; RuntimeError if impossible."""
        super().__init__(sandbox_id, freeze_timeout)
        base = cgroup_base()
        if base is None:
            raise RuntimeError("no writable cgroup v2 hierarchy with a freezer")
        try:
            name = _dir_name(sandbox_id)
            suffix, attempts = 0, 0
            while True:
                # Made again if another host of this process removed it as it closed.
                parent = daemon_cgroup(base)
                path = parent / (f"{name}-{suffix}" if suffix else name)
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    suffix += 1
                except FileNotFoundError:
                    attempts += 1
                    if attempts > 3:
                        raise
        except OSError as exc:
            raise RuntimeError(f"cannot create sandbox cgroup: {exc}") from exc
        self.path: Path = path
        self._procs_file = path / "cgroup.procs"
        self._launchers = parent / (path.name + LAUNCHERS_SUFFIX) / "cgroup.procs"
        # Between settle's last look at `_closed` and its move, a close must not remove
        # what the move then makes again (settle runs in a thread, close on the loop).
        self._settling = threading.Lock()
        mount = cgroup2_mount()
        # The cgroup's path as /proc/<pid>/cgroup shows it, for membership checks.
        self._cgpath = "/" + str(path.relative_to(mount)) if mount is not None else ""
        # Kept open: pause and resume are one write each, and opening a cgroupfs file
        # costs more than writing it.
        self._events = os.open(path / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
        self._freeze = os.open(path / "cgroup.freeze", os.O_WRONLY | os.O_CLOEXEC)

    def launch_prefix(self) -> list[str]:
        """``/bin/sh`` wrapper that joins the cgroup, then execs the argv."""
        if self._closed:
            raise RuntimeError("freezer is closed")
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self._procs_file)]

    def cgroup_joins(self) -> list[str]:
        """The cgroup's ``cgroup.procs``."""
        if self._closed:
            raise RuntimeError("freezer is closed")
        return [str(self._procs_file)]

    def _contains(self, pid: int) -> bool:
        """True if ``pid`` is in this cgroup or one below it."""
        cgpath = cgroup2_path_of(pid)
        if cgpath is None or not self._cgpath:
            return False
        return cgpath == self._cgpath or cgpath.startswith(self._cgpath + "/")

    def _adopt(self, pid: int, contained: bool, born: ProcStat | None) -> None:
        """Move ``pid`` into the cgroup unless the launch prefix already did, or it was
        ``born`` to a member (a process is born in its parent's cgroup).

        Only ``pid`` itself moves: children it forked before stay outside, which is why
        processes are spawned through :meth:`launch_prefix`.
        """
        if born is None and not self._contains(pid):
            self._move(pid, self._procs_file)

    def settle(self, launch: str) -> bool:
        """Once bwrap's PID 1 (the child of ``launch``'s leader, bwrap's monitor) has
        forked the command, inside the cgroup, move the monitor to a cgroup of the
        sandbox's beside it (its name ends in ``.bwrap``): it only waits for the command,
        and each task in the cgroup is one more for the kernel to freeze and wake on
        every pause and resume (the monitor, PID 1 and the command: +0.07 to +0.10 ms of a
        0.5 ms pause + resume of four processes, benchmarks/isolation.py). Nothing of the
        sandbox's can follow it or reach it: it forks nothing more, and it is outside the
        sandbox's PID namespace. PID 1 stays: it is inside, the sandbox's user may ptrace
        it (bwrap leaves it dumpable), and code put there must pause and die with the
        sandbox. False while the command is not born yet (a pause holds bwrap's set-up)."""
        leader = self._launches.get(launch)
        if leader is None or self._closed:
            return True
        monitor = leader.pid
        inits = children_of(monitor)
        if not inits or not children_of(inits[0]):
            return ident_of(monitor) != leader  # gone, or not born yet
        with self._settling:
            if self._closed:
                return True
            try:
                self._launchers.parent.mkdir(exist_ok=True)
                # Checked just before it moves, by its start time (a pid is reused only
                # once its process is reaped).
                if ident_of(monitor) == leader:
                    self._move(monitor, self._launchers)
            except OSError as exc:
                logger.debug("bwrap's monitor stays in %s: %s", self.path, exc)
        return True

    @staticmethod
    def _move(pid: int, procs: Path) -> None:
        """Write ``pid`` to ``procs``; a process already gone is no error."""
        try:
            procs.write_text(f"{pid}\n")
        except ProcessLookupError:
            pass  # already gone
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise

    def members(self) -> dict[int, ProcStat]:
        """Live processes of the cgroup (zombies excluded)."""
        result: dict[int, ProcStat] = {}
        for pid in cgroup_pids(self.path):
            st = read_stat(pid)
            if st is not None and st.alive:
                result[pid] = st
        self._marks.forget_others(result)
        return result

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    async def freeze(self) -> None:
        """Set ``cgroup.freeze`` and wait for ``frozen 1`` in ``cgroup.events``."""
        if self._closed:
            raise RuntimeError("freezer is closed")
        os.pwrite(self._freeze, b"1", 0)
        self._frozen = True
        # Sleeping processes are frozen 60-80 us after the write (12 as soon as 4): the
        # file is read again on each turn of the loop for a while (other work runs in
        # between), rather than after a timer's first interval, which was most of a pause.
        looks_until = time.monotonic() + _LOOK_AGAIN
        while not _frozen(self._events):
            if time.monotonic() >= looks_until:
                await self._wait_frozen(self._events)
                return
            await asyncio.sleep(0)

    async def _wait_frozen(self, events: int) -> None:
        """Wait until ``cgroup.events`` says frozen, or ``freeze_timeout`` passes.

        The file is pollable (``POLLPRI`` when it changes), so the wait is an epoll fd on
        the event loop. But the kernel sends at most one such notification per cgroup per
        10 ms (``cgroup_file_notify``), and one was likely just sent, for the thaw or the
        freeze request; a freeze that takes 0.3 ms would then be seen after up to 10 ms.
        So the file is also re-read on a short, growing interval.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.freeze_timeout
        changed = asyncio.Event()
        with select.epoll() as poller:
            poller.register(events, select.EPOLLPRI | select.EPOLLERR)
            loop.add_reader(poller.fileno(), changed.set)
            try:
                recheck = _FIRST_RECHECK
                while not _frozen(events):
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        logger.warning(
                            "cgroup %s not frozen after %.1fs", self.path, self.freeze_timeout
                        )
                        return
                    changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), min(recheck, remaining))
                    recheck = min(recheck * 2, _MAX_RECHECK)
            finally:
                loop.remove_reader(poller.fileno())

    async def thaw(self) -> None:
        """Clear ``cgroup.freeze`` (thawing needs no wait: nothing is left to stop)."""
        if self._closed:
            raise RuntimeError("freezer is closed")
        os.pwrite(self._freeze, b"0", 0)
        self._frozen = False

    def signal(self, sig: int) -> None:
        """Signal every process; ``SIGKILL`` through ``cgroup.kill`` where the kernel has it."""
        if self._closed:
            return
        if sig == signal.SIGKILL and (self.path / "cgroup.kill").exists():
            try:
                self._write("cgroup.kill", "1")
                return
            except OSError as exc:
                logger.debug("cgroup.kill failed (%s), signalling pids", exc)
        # Repeat while new processes show up (forks racing with us).
        sent: set[int] = set()
        for _ in range(100):
            new = [p for p in self.members() if p not in sent]
            if not new:
                break
            for pid in new:
                sent.add(pid)
                send_verified(pid, sig, self._contains)

    def close(self) -> None:
        """Thaw if needed and remove the cgroup (best effort; retried later if busy)."""
        with self._settling:
            if self._closed:
                return
            self._closed = True
        try:
            if self._frozen:
                with contextlib.suppress(OSError):
                    os.pwrite(self._freeze, b"0", 0)
                self._frozen = False
            os.close(self._events)
            os.close(self._freeze)
            # Killed processes leave the cgroup asynchronously, and bwrap's once their
            # commands did: retry briefly, but do not wait for processes that still run.
            deadline = time.monotonic() + _CLOSE_WAIT
            busy = False
            for path in (self.path, self._launchers.parent):
                while not busy and not rmdir_tree(path):
                    busy = bool(self.members()) or time.monotonic() >= deadline
                    if not busy:
                        time.sleep(0.002)  # sleep-ok: exiting processes leave shortly
                if busy:
                    logger.debug("cgroup %s still busy; removal deferred", path)
                    defer_removal(path)
        except Exception:  # never raise from close
            logger.exception("error closing cgroup %s", self.path)
            defer_removal(self.path)
            defer_removal(self._launchers.parent)


def _frozen(events: int) -> bool:
    """Whether ``cgroup.events`` (an open fd) says frozen. Reading from offset 0 also
    re-arms its poll notification."""
    return b"frozen 1" in os.pread(events, 256, 0)
