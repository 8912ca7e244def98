"""A process's pipes and pty, as the event loop sees them: its output appended to its log
as it arrives (the producer never waits for a reader), its stdin written without blocking
the loop and bounded like a pipe's, and 1 MiB pipe buffers.

The owner is the process (:class:`~sandboxkit.daemon.process.ManagedProcess`), seen here
only as an :class:`Owner`: where output goes and whether its stdin has drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from typing import Protocol

__all__ = ["Capture", "Owner", "PtyInput", "PtyReader", "widen_pipes"]


class Owner(Protocol):
    """What the transports here need of the process they serve."""

    stdin_drained: asyncio.Event
    """Set while nothing waits in the daemon's stdin buffer for the process."""

    def capture(self, stream: str, data: bytes) -> None:
        """Record output from one of the process's streams."""


class Capture(asyncio.SubprocessProtocol):
    """Appends pipe output to the log as it arrives: the producer never waits."""

    def __init__(self, process: Owner) -> None:
        self._process = process
        self.exited = asyncio.get_running_loop().create_future()
        self.pipes_closed = asyncio.get_running_loop().create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._process.capture("stdout" if fd == 1 else "stderr", data)

    # The stdin pipe's flow control (asyncio routes it to the subprocess protocol).
    def pause_writing(self) -> None:
        self._process.stdin_drained.clear()

    def resume_writing(self) -> None:
        self._process.stdin_drained.set()

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.pipes_closed.done():
            self.pipes_closed.set_result(None)


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


_PIPE_SIZE = 1024 * 1024


def widen_pipes(transport: asyncio.SubprocessTransport) -> None:
    """Ask for 1 MiB pipe buffers: a chatty process then blocks, and the daemon wakes,
    a sixteenth as often as with the default 64 KiB (best effort: capped by the system)."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:
        return
    for fd in (1, 2):
        pipe = transport.get_pipe_transport(fd)
        handle = pipe.get_extra_info("pipe") if pipe is not None else None
        if handle is not None:
            # The pipe may already be closed by a process that exited at once.
            with contextlib.suppress(OSError, ValueError):
                fcntl.fcntl(handle.fileno(), set_size, _PIPE_SIZE)
