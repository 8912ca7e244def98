"""Sending a span of a segment file (:class:`~sandboxkit.daemon.file_span.FileSpan`) as
one chunk of a chunked HTTP/1.1 body, with ``os.sendfile``: the frames go from the page
cache to the socket without entering Python; only the chunk's size line and its closing
``CRLF`` are written from here (issue 22, zero-copy fan-out).

The socket is written directly, as ``_AsgiSink.send_parts`` (``daemon/app.py``) does for
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
from collections.abc import Awaitable, Callable
from typing import Any

from sandboxkit.daemon.file_span import FileSpan
from sandboxkit.daemon.tcp_peer import PENDING_BYTES

__all__ = ["TornSpan", "send_span"]


class TornSpan(OSError):
    """The file gave fewer bytes than the span being sent: the body chunk is cut."""


async def send_span(
    sock: int, span: FileSpan, transport: Any, writable: Callable[[], Awaitable[None]]
) -> None:
    """Send ``span`` as one body chunk on socket ``sock``, whose ``transport`` holds
    nothing now; ``writable()`` returns once the transport is empty again."""
    # (Tried: TCP_CORK around the three writes, so that the size line and the CRLF do
    # not leave as packets of their own. It cost more CPU per GB than it saved, at 1
    # and at 16 consumers: two more syscalls per span, and the push at uncork.)
    head = b"%x\r\n" % span.size
    sent = _try_write(sock, head)
    if sent < len(head):  # the kernel is full: the rest through the transport
        transport.write(head[sent:])
        await writable()
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
    sent = _try_write(sock, b"\r\n")
    if sent < 2:  # (the next send waits for the transport to be empty first)
        transport.write(b"\r\n"[sent:])


def _try_write(sock: int, data: bytes) -> int:
    try:
        return os.write(sock, data)
    except OSError:  # full, or broken (then the transport says so)
        return 0
