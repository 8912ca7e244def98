"""The spare sandbox: one sandbox made ahead, with its launcher up, that the next
``create()`` asking for the daemon's defaults is given instead of a new one.

Why: a sandbox's first command is its most expensive. Its launch joins the sandbox's
cgroups and, isolated, makes its namespaces (bubblewrap: a user, mount, PID, IPC, UTS and
network namespace, a tmpfs and its binds, about 2 ms on 2 cores) before the command
execs; only later commands are forks of the sandbox's launcher
(:mod:`~sandboxkit.daemon.launcher`). A notebook's ``Sandbox.create()`` then its first
``run()`` paid all of it while someone waited. The spare pays it while no one does: it is
made once the daemon is quiet (:class:`~sandboxkit.daemon.standby.Quiet`: no sandbox made
and no launch for 20 ms, as for the launchers), so a burst of creates never waits for
it or competes with it, and the create that takes it gets a sandbox whose first command
is a fork, as E2B hands out sandboxes from a pool of started ones.

What the taker gets is a sandbox like any other, never used: its directories were made
empty for it and no code of anyone's ran in it (the launcher is the daemon's program,
exec'd from a sealed memfd). Its identity is the taker's from then on: its envs, metadata,
timeouts, its creation time and its ``sandbox.created`` event, none of which a launcher
or a namespace holds (each command's environment is sent with it). A request that asks
for something made at creation (other limits, ``isolation`` or network than the
daemon's defaults, a fault lab) gets a new sandbox, and the spare waits.

The spare is not one of the host's sandboxes until taken: not listed, not counted, no
idle timeout, no events (its journal is its own until then). It is ended with the host,
and a dead daemon's spare goes with the rest of its root and cgroups
(:mod:`~sandboxkit.daemon.recovery`). What it costs while it waits: a sleeping launcher
and bubblewrap's PID 1 (0.2 MB), a cgroup, two directories, a few descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from sandboxkit.daemon.launcher_slot import LauncherSlot
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.standby import Quiet

__all__ = ["Spare"]

logger = logging.getLogger(__name__)


class Spare:
    """The host's spare sandbox: made :meth:`soon` (once the daemon is quiet), given
    away by :meth:`take`, ended by :meth:`close`. ``make`` makes a sandbox with the
    daemon's defaults, not yet the host's. One that could not be made is tried again
    after the next create that takes none (so never more often than sandboxes are
    made), unless its sandboxes have no launcher: then a spare would save nothing."""

    def __init__(self, make: Callable[[], Awaitable[ManagedSandbox]], quiet: Quiet) -> None:
        self._make = make
        self._quiet = quiet
        self._sandbox: ManagedSandbox | None = None
        self._making: asyncio.Task[None] | None = None
        self._useless = False
        self._closed = False
        self._ending: set[asyncio.Future[None]] = set()

    @property
    def sandbox(self) -> ManagedSandbox | None:
        """The spare, while one is made and not taken."""
        return self._sandbox

    def soon(self) -> None:
        """Make the spare once the daemon is quiet, unless there is one."""
        if self._sandbox is None and self._making is None and not self._closed:
            self._quiet.wait(self)

    def take(self, isolated: bool) -> ManagedSandbox | None:
        """The spare, if one is made, ``isolated`` as asked (what the kernel allows can
        differ from when it was made) and its launcher answers; ``None`` otherwise (the
        caller makes a sandbox). Taken, it is no longer the spare's, and the next is made
        :meth:`soon`; one whose launcher stopped answering is ended and made anew."""
        if self._sandbox is not None and (self._sandbox.plan is not None) != isolated:
            return None
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None and not _launcher_up(sandbox):
            self._own(self._end(sandbox))
            sandbox = None
        self.soon()
        return sandbox

    def _fill(self) -> asyncio.Task[None] | None:
        """Make the spare now (:class:`Quiet` calls it); the task that makes it."""
        if self._sandbox is not None or self._closed or self._useless:
            return None
        if self._making is None:
            self._making = asyncio.get_running_loop().create_task(self._made())
        return self._making

    async def _made(self) -> None:
        sandbox: ManagedSandbox | None = None
        try:
            sandbox = await self._make()
            if not isinstance(sandbox.standby, LauncherSlot):
                # A launch here is one exec (no cgroup to join, nothing to make): a
                # spare would save nothing but a directory, for every create to come.
                self._useless = True
                raise RuntimeError("its sandboxes have no launcher")
            await sandbox.standby.start()
            if not _launcher_up(sandbox):
                raise RuntimeError("its launcher did not start")
        except BaseException as exc:  # cancelled by close() too: nothing half made stays
            if sandbox is not None:
                await self._end(sandbox)
            if not isinstance(exc, Exception):
                raise
            logger.debug("spare sandbox not made: %r", exc)
            return
        finally:
            self._making = None
        if self._closed:  # closed while its launcher started
            await self._end(sandbox)
        else:
            self._sandbox = sandbox

    def _own(self, work: Awaitable[None]) -> None:
        # Ended with the host: close() waits for every task of the spare's.
        task = asyncio.ensure_future(work)
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def close(self) -> None:
        """End the spare, and stop making one."""
        self._closed = True
        self._quiet.forget(self)
        if self._making is not None:
            self._making.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._making
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            self._own(self._end(sandbox))
        await asyncio.gather(*self._ending, return_exceptions=True)

    @staticmethod
    async def _end(sandbox: ManagedSandbox) -> None:
        await sandbox.kill(reason="shutdown")
        await sandbox.release()


def _launcher_up(sandbox: ManagedSandbox) -> bool:
    slot = sandbox.standby
    return isinstance(slot, LauncherSlot) and slot.running is not None
