"""Owned background tasks: strongly referenced, cancelled and awaited on close (F9) — and
the closed state of the client object that owns them."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from sandboxkit.errors import SandboxClosed

__all__ = ["TaskOwner"]

T = TypeVar("T")


class TaskOwner:
    """Holds every background task a client object starts, so none is garbage-collected
    before it runs and none outlives the object. Once closed, :meth:`check` raises
    :class:`~sandboxkit.errors.SandboxClosed` saying why, so that no call on a closed
    client reaches a closed connection pool."""

    def __init__(self, sandbox_id: str = "") -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.sandbox_id = sandbox_id
        self.closed = False
        self.closed_because: str | None = None

    def check(self) -> None:
        """Raise :class:`SandboxClosed` if this client was closed."""
        if not self.closed:
            return
        sid = self.sandbox_id or "(unknown)"
        if self.closed_because == "killed":
            message = (
                f"sandbox {sid} was killed (by kill() or at the end of its `with` block); "
                "create a new one with Sandbox.create()"
            )
        else:
            message = (
                f"this client of sandbox {sid} was closed with close(); the sandbox keeps "
                f"running until its timeout — reattach with Sandbox.connect({sid!r})"
            )
        raise SandboxClosed(message, sandbox_id=sid, reason=self.closed_because or "closed")

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Start ``coro`` as an owned task."""
        if self.closed:
            coro.close()
            self.check()
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout: float) -> None:
        """Give the tasks up to ``timeout`` seconds to finish on their own (after a kill
        their streams are reading the end frame with the exit code)."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def aclose(self, because: str = "closed") -> None:
        """Cancel every task still running and wait for all of them. ``because`` (unless
        a reason was set before) is what :meth:`check` will say."""
        if self.closed_because is None:
            self.closed_because = because
        self.closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
