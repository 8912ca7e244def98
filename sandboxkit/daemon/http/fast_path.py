"""A stream's body chunks straight to uvicorn's connection: the fast path, and the one
module of the daemon's HTTP layer that reaches into uvicorn's and asyncio's private
internals.

The ASGI wrappers and h11 cost more per send than the socket write itself at full rate
(benchmarks/compare.py, P7), so an HTTP/1.1 stream's body chunks are framed here and
written to uvicorn's transport, after the same flow control. What that relies on, and
what happens on a version without it:

- uvicorn's ``send`` is a method of its request cycle (``send.__self__``), which has
  :data:`CYCLE_ATTRIBUTES` (``transport``, ``flow``, ``disconnected``) and whose ``flow``
  (uvicorn's ``FlowControl``) has :data:`FLOW_ATTRIBUTES` (``write_paused``, ``drain``).
  A cycle of uvicorn's without one of them is not used: the stream takes the plain ASGI
  path — the same bytes, but slower, each send copied whole into the transport, and a
  peer that stops reading shown as blocked only once the server's buffers are full — and
  a warning names what is missing and the installed uvicorn's version, once per class.
- asyncio's socket transport is ``asyncio.selector_events._SelectorSocketTransport``: the
  socket is then written here, gathered, while the transport holds nothing (see
  :meth:`AsgiSink.send_parts`). Without that class every transport is treated as uvloop's
  is: given whole sends (the same bytes; asyncio copies them, issue 19's memory).
  uvloop's ``uvloop.loop.TCPTransport`` is written the same way, where it exists.

``tests/test_http_internals.py`` checks each of these on the real classes of the
installed uvicorn and asyncio, and fails naming the attribute and the version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from asyncio import selector_events
from typing import Any

import uvicorn
from starlette.types import Scope, Send

from sandboxkit._compat import within
from sandboxkit.daemon.file_span import FileSpan
from sandboxkit.daemon.sendfile_writer import SpanWriter, TornSpan
from sandboxkit.daemon.tcp_peer import (
    PENDING_BYTES,
    SEND_BUFFER,
    size_send_buffer,
    window_closed_for,
)

__all__ = [
    "CYCLE",
    "CYCLE_ATTRIBUTES",
    "FLOW_ATTRIBUTES",
    "SELECTOR_TRANSPORT",
    "AsgiSink",
    "expose_cycle",
    "missing_internals",
    "split",
]

logger = logging.getLogger(__name__)

CYCLE = "sandboxkit.http_cycle"
"""Scope key of uvicorn's request cycle for this request (see :func:`expose_cycle`)."""

CYCLE_ATTRIBUTES = ("transport", "flow", "disconnected")
"""What the fast path reads of uvicorn's request cycle."""

FLOW_ATTRIBUTES = ("write_paused", "drain")
"""What it uses of the cycle's flow control (uvicorn's ``FlowControl``)."""

SELECTOR_TRANSPORT: Any = getattr(selector_events, "_SelectorSocketTransport", ())
"""asyncio's own socket transport (private, hence looked up: ``()`` matches nothing), and
uvloop's, which writes its socket the same way (directly while it holds nothing)."""
with contextlib.suppress(ImportError):
    import uvloop

    SELECTOR_TRANSPORT = (SELECTOR_TRANSPORT, getattr(uvloop.loop, "TCPTransport", ()))

_IOV_MAX = 1024
_TCP_CORK: int | None = getattr(socket, "TCP_CORK", None)  # Linux
_warned: set[type] = set()


def missing_internals(cycle: object) -> list[str]:
    """What the fast path relies on that ``cycle`` lacks (``flow.drain``, say); empty
    when it can be used."""
    missing = [name for name in CYCLE_ATTRIBUTES if not hasattr(cycle, name)]
    flow = getattr(cycle, "flow", None)
    if flow is not None:
        missing += [f"flow.{name}" for name in FLOW_ATTRIBUTES if not hasattr(flow, name)]
    return missing


def expose_cycle(scope: Scope, send: Send) -> None:
    """Puts uvicorn's request cycle into the scope, for a stream to read its socket's state
    (a peer that takes no more bytes shows as blocked at once, not once the server's
    buffers are full) and to write body chunks straight to its connection. A server whose
    ``send`` has not that shape gets the plain ASGI path; a uvicorn whose cycle lacks
    part of it says so (see the module's docstring)."""
    cycle = getattr(send, "__self__", None)
    if cycle is None:
        return  # a plain function: not uvicorn (a test client, another server)
    missing = missing_internals(cycle)
    if not missing:
        scope[CYCLE] = cycle
        return
    kind = type(cycle)
    if kind.__module__.startswith("uvicorn.") and kind not in _warned:
        _warned.add(kind)
        logger.warning(
            "uvicorn %s: %s.%s has no %s, which sandboxkit's stream fast path uses; "
            "streams take the plain ASGI path (correct, slower)",
            uvicorn.__version__,
            kind.__module__,
            kind.__qualname__,
            ", ".join(missing),
        )


def split(
    parts: list[bytes | memoryview], n: int
) -> tuple[list[bytes | memoryview], list[bytes | memoryview]]:
    """The concatenation of ``parts`` cut after its first ``n`` bytes, as two lists of
    the same objects (a part cut in two becomes two views of it: nothing is copied)."""
    for i, part in enumerate(parts):
        if n < len(part):
            if n == 0:
                return parts[:i], parts[i:]
            view = memoryview(part)
            return [*parts[:i], view[:n]], [view[n:], *parts[i + 1 :]]
        n -= len(part)
    return parts, []


class AsgiSink:
    """A consumer's transport: the body of one chunked HTTP response.

    Given uvicorn's request cycle (an HTTP/1.1 response, so chunked), body chunks go
    straight to its connection, framed as uvicorn would frame them and after the same flow
    control: the ASGI wrappers and h11 cost more per send than the socket write itself at
    full rate (benchmarks/compare.py, P7). The response's start and end still go through
    ASGI, so the server's own state stays right."""

    def __init__(self, send: Send, cycle: Any = None) -> None:
        self._send = send
        self._cycle = cycle
        transport = getattr(cycle, "transport", None)
        self._socket = None if transport is None else transport.get_extra_info("socket")
        self._send_buffer = SEND_BUFFER  # inherited from the listener
        self._fd: int | None = None  # asyncio's own transport: see send_parts
        self._limits: tuple[int, int] | None = None
        if isinstance(transport, SELECTOR_TRANSPORT) and self._socket is not None:
            self._fd = self._socket.fileno()
            # Paused as soon as it holds a byte, resumed once it holds none: what this
            # stream hands it is then all the transport holds (see send_parts).
            self._limits = transport.get_write_buffer_limits()
            transport.set_write_buffer_limits(high=0)
        self._closing = False
        self._holding = False  # the head held back (see hold_head)
        self._torn = False  # a body chunk was cut short (see send_parts)
        self._spans: SpanWriter | None = None  # made by the first send_file
        self._gone = asyncio.Event()  # never set: waited on until the stream is cancelled
        self.closed = asyncio.Event()

    def hold_head(self) -> None:
        """Keep what is written next (the response's head) in the kernel until the first
        body chunk follows it (``TCP_CORK``): they leave in one packet, and the reader (a
        ``run()``, while its command runs) wakes once for both instead of once for each
        (``benchmarks/compare.py`` P5, docs/performance.md)."""
        if _TCP_CORK is not None and self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 1)
                self._holding = True

    def _release_head(self) -> None:
        if self._holding and self._socket is not None:
            self._holding = False
            with contextlib.suppress(OSError):
                self._socket.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 0)

    def window_closed_for(self) -> float | None:
        """How long the peer has taken no bytes while some wait in the socket."""
        return None if self._socket is None else window_closed_for(self._socket)

    def size_send_buffer(self, nbytes: int) -> None:
        """Let the kernel hold about ``nbytes`` for this peer (see tcp_peer)."""
        if self._socket is not None:
            self._send_buffer = size_send_buffer(self._socket, nbytes, self._send_buffer)

    async def send_parts(self, parts: list[bytes | memoryview], size: int) -> None:
        """Send the concatenation of ``parts`` as one body chunk.

        The parts are the consumer's chunks as the log holds them (shared by every
        consumer, or views of a mapped segment): they are written as they are, and what
        the kernel does not take waits in ``parts``, not in a copy. asyncio's transport
        copies what it is given, so it is given at most :data:`PENDING_BYTES` at a time,
        and the next part goes to the socket once it wrote that (issue 19: a 1 MiB send's
        rest, copied, per consumer, was most of the daemon's memory at 400 consumers).
        uvloop's keeps references to the parts themselves: it gets the whole send."""
        cycle = self._cycle
        if cycle is None or self._torn:
            await self.send(b"".join(parts))
            return
        chunk = self._body_chunk(parts, size)
        if self._fd is None:
            await self._writable()
            cycle.transport.writelines(chunk)
            self._release_head()
            return
        await self._writable()
        while chunk := self._write(chunk, PENDING_BYTES):
            try:
                await self._writable()
            except BaseException:
                # Cancelled (a kick, the peer gone) inside a body chunk: nothing
                # may follow it on this connection, which ends after what the
                # transport holds; the client reattaches from its cursor.
                self._torn = True
                cycle.transport.close()
                raise

    def send_now(self, parts: list[bytes | memoryview], size: int) -> int | None:
        """Send the concatenation of ``parts`` as one body chunk at once, without waiting,
        if that can be done: the connection takes bytes now (its transport holds none)
        and ``size`` is at most :data:`PENDING_BYTES`, so whatever the kernel does not
        take the transport may hold. Returns how many bytes it holds then (0: the kernel
        took them all; :meth:`drain` waits for the rest); ``None``: nothing was sent
        (:meth:`send_parts` then sends it, waiting its turn). A consumer at the head of
        its log sends from the producer's own turn this way (``Consumer``, P3 in
        docs/performance.md)."""
        cycle = self._cycle
        if (
            cycle is None
            or self._fd is None
            or self._torn
            or self._holding
            or size > PENDING_BYTES
            or cycle.flow.write_paused
            or cycle.disconnected
            or cycle.transport.is_closing()
        ):
            return None
        chunk = self._body_chunk(parts, size)
        rest = self._write(chunk, sum(map(len, chunk)))
        assert not rest  # (all of it taken, by the kernel or the transport)
        return int(cycle.transport.get_write_buffer_size())

    async def drain(self) -> None:
        """Returns once the transport holds nothing of this stream's: what the kernel did
        not take of a :meth:`send_now`."""
        if self._cycle is not None:
            await self._writable()

    def _body_chunk(self, parts: list[bytes | memoryview], size: int) -> list[bytes | memoryview]:
        # One chunk of the chunked body (after what a span left owed: see SpanWriter).
        owed = self._spans.take_pending() if self._spans is not None else b""
        return [owed + b"%x\r\n" % size, *parts, b"\r\n"]

    def _write(self, chunk: list[bytes | memoryview], most: int) -> list[bytes | memoryview]:
        """Write ``chunk`` to the socket, gathered, as far as the kernel takes it, and
        then up to ``most`` bytes more to the transport; returns what is left.

        Called only while the transport holds nothing (its limits pause it at one byte),
        so the socket can be written here, in order. A piece the kernel does not take
        is copied to the transport, which writes it when the socket takes more and then
        resumes this stream: a bounded copy."""
        assert self._fd is not None
        batch = chunk[:_IOV_MAX]
        try:
            sent = os.writev(self._fd, batch)
        except OSError:  # full, or broken: the transport reports that its own way
            sent = 0
        self._release_head()
        chunk = split(batch, sent)[1] + chunk[_IOV_MAX:]
        if chunk:
            piece, chunk = split(chunk, most)
            self._cycle.transport.write(b"".join(piece))
        return chunk

    async def send_file(self, span: FileSpan) -> None:
        """Send a span of a segment file as one body chunk, with ``sendfile`` (see
        :mod:`~sandboxkit.daemon.sendfile_writer`); copied where the socket is not ours
        to write."""
        if self._cycle is None or self._fd is None or self._torn:
            data = span.read()
            if data is not None:  # (a file shrunk under it: the next read tells the gap)
                await self.send(data)
            return
        await self._writable()
        if self._spans is None:
            self._spans = SpanWriter(self._fd)
        try:
            await self._spans.send(span, self._cycle.transport, self._writable)
        except BaseException as exc:
            # Cut inside a body chunk (cancelled, or the file shorter than its span):
            # nothing may follow on this connection; the client reattaches.
            self._torn = True
            self._cycle.transport.close()
            if isinstance(exc, TornSpan):
                await self._gone.wait()
            raise

    async def _writable(self) -> None:
        """Returns once the connection takes more bytes; waits for the stream to be
        cancelled if its peer is gone."""
        cycle = self._cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected or cycle.transport.is_closing():
            # The peer is gone (the transport may know before uvicorn does): nothing more
            # to write. Wait for the disconnect to cancel this stream rather than drop
            # bytes in a loop that never yields.
            await self._gone.wait()

    async def send(self, data: bytes) -> None:
        if self._torn:
            return  # a body chunk was cut short: the connection is closing
        if self._cycle is not None and data:
            await self.send_parts([data], len(data))
            return
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def close(self) -> None:
        self._release_head()  # (a stream that ended before its first chunk)
        if self._closing:
            return
        self._closing = True
        if self._spans is not None:
            owed = self._spans.take_pending()
            self._spans.close()
            if owed and not self._torn and not self._cycle.transport.is_closing():
                self._cycle.transport.write(owed)  # (before the body's end, in order)
        if self._torn:
            self.closed.set()
            return
        if self._limits is not None and not self._cycle.transport.is_closing():
            low, high = self._limits
            self._cycle.transport.set_write_buffer_limits(high, low)
        # A peer that stopped reading must not hold this up: bounded, best effort.
        with contextlib.suppress(Exception):
            await within(
                self._send({"type": "http.response.body", "body": b"", "more_body": False}),
                0.1,
            )
        self.closed.set()
