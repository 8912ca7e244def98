"""A sandbox's launcher slot: when its launcher (:mod:`~sandboxkit.daemon.launcher`)
is started, restarted and ended.

When it starts: once the daemon has made no sandbox and launched nothing for
:data:`~sandboxkit.daemon.standby.QUIET` seconds after the sandbox was made (a notebook's
first command then finds it; started in a burst of sandboxes, a launcher each slowed the
burst), or else by the sandbox's second command that fits, which waits for it: starting
it costs about what that command's launch the usual way would have, and every later
command is spared its own. The first command does not wait for one: started beside it or
before it, a launcher made ``create()`` + first command 1-2 ms slower on 2 cores. In
namespaces the commands it starts share its namespaces (one PID namespace, one loopback:
a pause freezes one bubblewrap PID 1, not one per command). It lives as long as its
sandbox and is paused, killed and recovered with it (a launch of the freezer's, carrying
its owner mark).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from sandboxkit.daemon.freezer import Freezer
from sandboxkit.daemon.launcher import Launcher, LauncherGone, program_fd
from sandboxkit.daemon.off_loop import off_loop
from sandboxkit.daemon.process_spec import Launch
from sandboxkit.daemon.spawn import Child, Process, start
from sandboxkit.daemon.standby import Quiet

__all__ = ["LauncherSlot", "slot_kind"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class LauncherSlot:
    """One sandbox's launcher: started :meth:`soon` after the sandbox is made (once the
    daemon is quiet), or by its second command (:meth:`ready`), restarted by the next
    command if it died (up to :data:`_RETRIES` failed starts in a row), ended by
    :meth:`close`."""

    _RETRIES: Final = 3

    def __init__(
        self,
        prepare: Callable[[str, tuple[int, ...]], Launch],
        freezer: Freezer,
        *,
        contained: bool,
        check_fds: Callable[[], None],
        quiet: Quiet | None = None,
    ) -> None:
        self._quiet = quiet or Quiet()
        self._prepare = prepare
        self._freezer = freezer
        self._contained = contained
        self._check_fds = check_fds
        self._launcher: Launcher | None = None
        self._starting: asyncio.Task[None] | None = None
        self._failures = 0
        self._asked = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reaping: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def running(self) -> Launcher | None:
        """The launcher, if it runs and answers."""
        launcher = self._launcher
        return launcher if launcher is not None and launcher.usable else None

    async def start(self) -> Launcher | None:
        """Start the launcher now, unless it runs (the spare sandbox's, made ahead:
        :mod:`~sandboxkit.daemon.spare`); the launcher, ``None`` if it did not start."""
        if (starting := self._fill()) is not None:
            await asyncio.shield(starting)
        return self.running

    def touch(self) -> None:
        """A launch of the sandbox's started the usual way (the daemon is not quiet)."""
        self._quiet.touch()

    async def ready(self) -> Launcher | None:
        """For a command that fits it: the launcher, started now if it is not (or waited
        for while it starts: about what a launch the usual way costs, which it then saves
        every later command); ``None`` if it could not be, and for the sandbox's first
        command if none is started yet: that one starts the usual way (started beside it,
        or before it, a launcher made ``create()`` + first command 1-2 ms slower on 2
        cores), and the launcher once the daemon is quiet, or with the next command."""
        self._quiet.touch()
        if (launcher := self.running) is not None:
            return launcher
        first, self._asked = not self._asked, True
        if first and self._starting is None:
            self.soon()
            return None
        starting = self._fill()
        if starting is None:
            return None
        # Shielded: a request that goes away leaves the start to finish for the next.
        await asyncio.shield(starting)
        return self.running

    def soon(self) -> None:
        """Start the launcher once the daemon has made no sandbox and launched nothing
        for :data:`~sandboxkit.daemon.standby.QUIET` seconds (a notebook's first command
        comes well after its ``create()``; started in a burst of sandboxes, a launcher
        each slowed the burst)."""
        self._quiet.touch()
        if self.running is None and self._starting is None and not self._closed:
            self._quiet.wait(self)

    def _fill(self) -> asyncio.Task[None] | None:
        """Start the launcher now (:class:`Quiet` and :meth:`ready` call it); the task
        that starts it, ``None`` if it runs, the slot closed or it failed too often."""
        if self._starting is not None:
            return self._starting
        if self._closed or self.running is not None or self._failures >= self._RETRIES:
            return None
        self._starting = self._own(self._start())
        return self._starting

    async def _start(self) -> None:
        old, self._launcher = self._launcher, None
        if old is not None:
            self._end(old)
        try:
            self._launcher = await self._launch()
            self._failures = 0
        except Exception as exc:
            self._failures += 1
            logger.debug("sandbox launcher did not start: %r", exc)
        finally:
            self._starting = None

    async def _launch(self) -> Launcher:
        self._check_fds()  # no launcher out of the descriptors a request needs
        program = program_fd()
        if program is None:
            raise LauncherGone
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        launch = secrets.token_hex(6)
        try:
            prepared = self._prepare(launch, (program, theirs.fileno()))
        except BaseException:
            ours.close()
            theirs.close()
            raise
        with self._freezer.launching(launch), contextlib.closing(prepared):
            try:
                popen = await off_loop(_start_detached, prepared)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            child = Child(popen, None)
            await child.join(None)
            launcher = Launcher(ours, child, launch)
            child.exited.add_done_callback(lambda _: launcher.close())
            try:
                await off_loop(self._freezer.add, popen.pid, launch, contained=self._contained)
                await asyncio.wait_for(launcher.hello, 10)
            except BaseException:
                self._end(launcher)
                raise
        if self._contained:
            self._own(self._freezer.settle_soon(launch, lambda: not launcher.broken))
        return launcher

    def closing(self) -> None:
        """Start no launcher any more (the sandbox is being killed: one started meanwhile
        would only be waited for, and compete with the daemon's next work)."""
        self._closed = True
        self._quiet.forget(self)

    async def close(self) -> None:
        """End the launcher (after the sandbox's processes were killed) and every task of
        the slot's."""
        self.closing()
        if self._starting is not None:
            self._starting.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._starting
        launcher, self._launcher = self._launcher, None
        if launcher is not None:
            self._end(launcher)
        tasks = list(self._tasks - self._reaping)
        for task in tasks:
            task.cancel()
        # The reaping is not cancelled: each waits for a launcher killed already.
        await asyncio.gather(*tasks, *self._reaping, return_exceptions=True)

    def _end(self, launcher: Launcher) -> None:
        """Close its socket (it ends on its own) and kill and reap its leader in the
        background: the launcher alone, not what it started (its commands outlive it; in
        namespaces bubblewrap's PID 1 adopts them, and reaps until none is left)."""
        launcher.close()
        launcher.child.close()
        reaping = self._own(_exited(launcher.child))
        self._reaping.add(reaping)
        reaping.add_done_callback(self._reaping.discard)

    def _own(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _exited(child: Child) -> None:
    await child.exited


def _start_detached(prepared: Launch) -> Process:
    """Spawn a launcher (in a thread), its stdin, stdout and stderr ``/dev/null``: it
    writes nothing, and its commands get pipes of their own."""
    with open(os.devnull, "rb") as null:
        popen, _ = start(
            prepared.argv,
            cwd=prepared.cwd,
            env=prepared.env,
            terminal=null.fileno(),
            pass_fds=prepared.pass_fds,
        )
    return popen


def slot_kind(standby: str) -> str:
    """What each sandbox keeps started for its commands under ``DaemonConfig.standby``
    (``sandboxkit status`` says it): ``launcher``; ``shell``, a standby
    (:mod:`~sandboxkit.daemon.standby`), also where ``on`` finds no launcher built at
    install; or ``off``."""
    if standby == "on":
        return "launcher" if program_fd() is not None else "shell"
    return standby
