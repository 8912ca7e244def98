"""Sending a span of a segment file (:class:`~sandboxkit.daemon.file_span.FileSpan`) as
one chunk of a chunked HTTP/1.1 body, with ``os.sendfile``: the frames go from the page
cache to the socket without entering Python; only the chunk's size line and its closing
``CRLF`` are written from here (issue 22, zero-copy fan-out).

The socket is written directly, as ``AsgiSink.send_parts`` (``daemon/http/fast_path.py``) does for
frames in memory: only while the connection's transport holds nothing (its write buffer
limits pause the stream at one byte), so the bytes go out in order. When the kernel
takes no more, a bounded piece (:data:`~sandboxkit.daemon.tcp_peer.PENDING_BYTES`) is
copied to the transport, which writes it when the socket drains and resumes the stream
once empty: a consumer that falls behind holds at most that piece in memory, and costs
the others nothing.

A file that gives fewer bytes than its span (shrunk after the store checked its size:
see :mod:`~sandboxkit.daemon.file_span`) raises :class:`TornSpan`: the chunk already
announced its size, so nothing may follow on this connection, which the caller ends;
the client sees the connection end inside a frame, never a frame with wrong bytes, and
reattaches from its cursor.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from sandboxkit.daemon.file_span import FileSpan
from sandboxkit.daemon.tcp_peer import PENDING_BYTES

__all__ = ["SpanWriter", "TornSpan"]


class TornSpan(OSError):
    """The file gave fewer bytes than the span being sent: the body chunk is cut."""


class SpanWriter:
    """Sends spans on one connection's socket ``fd`` (its transport holding nothing).

    A span's size line and its closing ``CRLF`` would each be a packet of their own,
    which on loopback the kernel delivers in the writer's time: profiled at one
    consumer, the two small writes cost more than the ``sendfile``. So the size line
    goes with ``MSG_MORE`` (it leaves with the file's first bytes), and the ``CRLF`` is
    kept back for the front of whatever this connection writes next
    (:meth:`take_pending`): the frames it closes are whole before it, so no reader waits
    for it. (``TCP_CORK`` around the writes cost more than it saved: measured.)
    """

    def __init__(self, fd: int) -> None:
        # A socket object of its own (a duplicate descriptor) for ``send`` with flags.
        self._sock = socket.socket(fileno=os.dup(fd))
        self._sock.setblocking(False)
        self._pending = b""

    def take_pending(self) -> bytes:
        """The bytes owed before anything else is written here (then no longer owed)."""
        pending, self._pending = self._pending, b""
        return pending

    def close(self) -> None:
        self._sock.close()

    async def send(
        self, span: FileSpan, transport: Any, writable: Callable[[], Awaitable[None]]
    ) -> None:
        """Send ``span`` as one body chunk; ``writable()`` returns once the transport is
        empty again."""
        head = self.take_pending() + b"%x\r\n" % span.size
        try:
            sent = self._sock.send(head, socket.MSG_MORE)
        except OSError:  # full, or broken (then the transport says so)
            sent = 0
        if sent < len(head):  # the kernel is full: the rest through the transport
            transport.write(head[sent:])
            await writable()
        await _send_file(self._sock.fileno(), span, transport, writable)
        self._pending = b"\r\n"


async def _send_file(
    sock: int, span: FileSpan, transport: Any, writable: Callable[[], Awaitable[None]]
) -> None:
    position, end = span.position, span.position + span.size
    while position < end:
        try:
            sent = os.sendfile(sock, span.fd, position, end - position)
        except OSError:  # full (or broken: the transport reports that, on its write)
            sent = -1
        if sent == 0:
            raise TornSpan(f"segment file ends {end - position} bytes short of its span")
        if sent > 0:
            position += sent
            continue
        # The kernel is full: a bounded copy to the transport (see the module).
        piece = os.pread(span.fd, min(PENDING_BYTES, end - position), position)
        if not piece:
            raise TornSpan(f"segment file ends {end - position} bytes short of its span")
        transport.write(piece)
        position += len(piece)
        await writable()
