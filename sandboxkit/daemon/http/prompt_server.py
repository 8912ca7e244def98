"""uvicorn's server, stopping as soon as it is told to.

uvicorn's own loop looks at ``should_exit`` between 0.1 s sleeps, and its shutdown sleeps a
fixed 0.1 s, then polls the connections at that pace: about 0.2 s per stop, paid by every
in-process daemon (the test suite starts hundreds) and by each of its servers in turn.
:class:`PromptServer` waits on an event that :meth:`~PromptServer.wake` sets instead, and
watches the closed connections go at a finer pace. What a stop does is uvicorn's: stop
accepting, close idle connections (the others after their response), let requests finish
within ``timeout_graceful_shutdown`` then cancel them, run the lifespan's shutdown.

This subclass leans on uvicorn's ``Server`` attributes (``servers``, ``server_state``,
``lifespan``, ``force_exit``) as of uvicorn 0.3x-0.5x; ``tests/test_teardown.py`` fails
if a stop waits on uvicorn's own sleeps again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from types import FrameType

import uvicorn

__all__ = ["PromptServer"]

TICK = 0.1
"""How often the serving loop runs uvicorn's housekeeping (the Date header, once a
second, and the max-requests limit), as uvicorn does; a stop does not wait for it."""

DRAIN_POLL = 0.005
"""While stopping: how often to look whether the closed connections are gone (one leaves
uvicorn's set a loop iteration after its transport closes)."""


class PromptServer(uvicorn.Server):
    """``uvicorn.Server`` whose stop takes milliseconds: set ``should_exit``, then
    :meth:`wake`."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None

    def wake(self) -> None:
        """Make the serving loop look at ``should_exit`` now (from any thread)."""
        loop, woken = self._loop, self._woken
        if loop is not None and woken is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                loop.call_soon_threadsafe(woken.set)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.wake()

    async def main_loop(self) -> None:
        # Both set before the first look at should_exit: a stop either finds them and
        # wakes the wait, or has set should_exit before that look.
        self._woken = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), TICK)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.close_connections(sockets)
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def close_connections(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown without its fixed sleeps."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()
        loop = asyncio.get_running_loop()
        grace = self.config.timeout_graceful_shutdown  # None: as long as they take
        deadline = loop.time() + (math.inf if grace is None else grace)
        while (state.connections or state.tasks) and not self.force_exit:
            if loop.time() >= deadline:
                for task in list(state.tasks):
                    task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
                break
            await asyncio.sleep(DRAIN_POLL)
        for server in self.servers:
            await server.wait_closed()
