"""The body of one envd streaming response, and what ends it besides its own work.

Both streaming services (a process's events, a directory's watch) answer the same way: the
body takes one writer at a time (events and keepalives), and the stream ends when its work
ends, when the client leaves, or when the deadline the client set passes, with keepalives
sent meanwhile at the pace it asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.types import Receive, Send

from sandboxkit._compat import within

__all__ = ["StreamBody", "StreamGuards"]


class StreamBody:
    """The body of one streaming response; one writer at a time (events, keepalives)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._lock = asyncio.Lock()
        self.finished = False

    async def write(self, data: bytes) -> None:
        async with self._lock:
            if self.finished:
                return
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, tail: bytes) -> None:
        """Write the end-of-stream envelope and end the body (bounded: the peer may
        have stopped reading)."""
        if self.finished:
            return
        with contextlib.suppress(Exception):
            await within(self._finish(tail), 0.5)
        self.finished = True

    async def _finish(self, tail: bytes) -> None:
        async with self._lock:
            if self.finished:
                return
            self.finished = True
            await self._send({"type": "http.response.body", "body": tail, "more_body": False})


class StreamGuards:
    """The tasks that end a stream besides its work (the client leaving, the deadline)
    and the keepalives written while it runs: wait on :attr:`tasks` with the work, then
    :meth:`cancel` them."""

    def __init__(
        self,
        receive: Receive,
        body: StreamBody,
        keepalive: bytes,
        interval: float | None,
        deadline: float | None,
    ) -> None:
        self.tasks: set[asyncio.Future[Any]] = {asyncio.ensure_future(_client_gone(receive))}
        self.deadline: asyncio.Future[None] | None = None
        if deadline is not None:
            self.deadline = asyncio.ensure_future(asyncio.sleep(deadline))
            self.tasks.add(self.deadline)
        if interval is not None:
            self.tasks.add(asyncio.ensure_future(_keepalives(body, keepalive, interval)))

    @property
    def expired(self) -> bool:
        """The deadline passed (not merely cancelled with the rest)."""
        return self.deadline is not None and self.deadline.done() and not self.deadline.cancelled()

    async def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _keepalives(body: StreamBody, message: bytes, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)  # sleep-ok: the pace the client asked for
        await body.write(message)


async def _client_gone(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
