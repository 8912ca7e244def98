"""A process's pipes and pty, as the event loop sees them: its output appended to its log
as it arrives (the producer never waits for a reader), its stdin written without blocking
the loop and bounded like a pipe's (the spawn itself is :mod:`sandboxkit.daemon.spawn`).

The owner is the process (:class:`~sandboxkit.daemon.process.ManagedProcess`), seen here
only as an :class:`Owner`: where output goes and whether its stdin has drained.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Protocol

__all__ = ["Output", "Owner", "PtyInput", "PtyReader", "StdinFlow"]


class Owner(Protocol):
    """What the transports here need of the process they serve."""

    stdin_drained: asyncio.Event
    """Set while nothing waits in the daemon's stdin buffer for the process."""

    def capture(self, stream: str, data: bytes) -> None:
        """Record output from one of the process's streams."""


class Output(asyncio.Protocol):
    """One output pipe (``stdout`` or ``stderr``): appends to the log as it arrives, so
    the producer never waits; ``on_closed`` once the pipe reached its end."""

    def __init__(self, process: Owner, stream: str, on_closed: Callable[[], None]) -> None:
        self._process = process
        self._stream = stream
        self._on_closed = on_closed

    def data_received(self, data: bytes) -> None:
        self._process.capture(self._stream, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_closed()


class StdinFlow(asyncio.Protocol):
    """The stdin pipe's flow control: ``stdin_drained`` is clear while anything waits in
    the transport's buffer (its limits are set to 0 by the process)."""

    def __init__(self, process: Owner) -> None:
        self._process = process

    def pause_writing(self) -> None:
        self._process.stdin_drained.clear()

    def resume_writing(self) -> None:
        self._process.stdin_drained.set()


class PtyInput(asyncio.WriteTransport):
    """A pty process's stdin: written to the pty master with ``os.write``, the rest buffered
    and flushed when the master is writable (``loop.add_writer``), bounded like a pipe's
    (``stdin_drained`` is clear while anything waits here).

    Not ``loop.connect_write_pipe`` on a dup of the master: uvloop's write-pipe transport
    reads its fd to notice the peer closing, and on a pty master that read takes the
    child's output away from the output reader (tests/test_lifecycle.py under
    ``SANDBOXKIT_EVENT_LOOP=uvloop``)."""

    def __init__(self, process: Owner, master: int) -> None:
        super().__init__()
        self._process = process
        self._fd = master
        self._loop = asyncio.get_running_loop()
        self._buffer = bytearray()
        self._closing = False
        os.set_blocking(master, False)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not data:
            return
        if not self._buffer:
            written = self._os_write(data)
            if written is None or written == len(data):
                return
            data = memoryview(data)[written:]
            self._loop.add_writer(self._fd, self._flush)
            self._process.stdin_drained.clear()
        self._buffer += data

    def _os_write(self, data: bytes | bytearray | memoryview) -> int | None:
        """Bytes the master took; ``None``: it is gone (the child side closed, EIO)."""
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError:
            self.abort()
            return None

    def _flush(self) -> None:
        written = self._os_write(self._buffer)
        if written is None:
            return
        del self._buffer[:written]
        if not self._buffer:
            self._loop.remove_writer(self._fd)
            self._process.stdin_drained.set()

    def get_write_buffer_size(self) -> int:
        return len(self._buffer)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # always high=0: drained means nothing waits here

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._buffer.clear()
        self._loop.remove_writer(self._fd)
        self._process.stdin_drained.set()


class PtyReader(asyncio.Protocol):
    def __init__(self, process: Owner) -> None:
        self._process = process
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._process.capture("pty", data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
