"""Helpers shared by the test modules (imported as ``support``)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def poll(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.01
) -> Any:
    """Wait until ``predicate()`` (sync or async) returns something truthy, and return it;
    fail after ``timeout`` seconds. A poll with a deadline, not a synchronisation point."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


class ChunkedDecoder:
    """Incremental decoder of an HTTP/1.1 chunked body (for raw-socket consumers)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._left = -1  # bytes left in the current chunk; -1: a size line is next
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """Add raw body bytes; return the payload bytes they complete."""
        self._buf += data
        out = bytearray()
        while self._buf and not self.done:
            if self._left < 0:
                end = self._buf.find(b"\r\n")
                if end < 0:
                    break
                size = int(bytes(self._buf[:end]).split(b";")[0], 16)
                del self._buf[: end + 2]
                if size == 0:
                    self.done = True
                    break
                self._left = size
            elif self._left > 0:
                take = min(self._left, len(self._buf))
                out += self._buf[:take]
                del self._buf[:take]
                self._left -= take
            else:
                if len(self._buf) < 2:
                    break
                assert self._buf[:2] == b"\r\n", bytes(self._buf[:8])
                del self._buf[:2]
                self._left = -1
        return bytes(out)
