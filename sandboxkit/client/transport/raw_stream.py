"""A process stream read straight off its socket, below httpx's per-chunk layers (httpcore,
anyio): the request written and the response head parsed as the unary calls do
(:mod:`.http11`), then the chunked body decoded into frames as the bytes arrive.

A stream is one long response read at full rate, where every layer's cost per chunk
counts (issue 11: the SDK consumer's CPU per GB against a bare httpx reader, and the
latency from a child's line to the callback). So the socket is read into one buffer kept
for the whole stream (no fresh 256 KiB object per read for the kernel to fault in), and
the body's chunk framing is taken apart in place, each chunk's bytes going straight to
the frame decoder: a payload byte is copied once after the kernel's copy (into its
frame) instead of five times through h11's buffers (httpx's parser), and a line costs no
per-event parser machinery. Used for plain-HTTP daemons when no custom httpx transport was
given; everything else goes through httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

from sandboxkit._compat import within
from sandboxkit.client.transport.frame_buffer import FrameBuffer
from sandboxkit.client.transport.http11 import (
    BadChunk,
    BadResponse,
    ChunkedBody,
    Head,
    HeadReader,
    encode_query,
    encode_request,
    request_fields,
)
from sandboxkit.errors import DaemonUnavailable, MalformedFrame, SandboxkitError, error_from_wire
from sandboxkit.wire import Frame, FrameKind

__all__ = ["Lender", "RawStream", "open_raw_stream"]

_BUFFER = 128 * 1024
"""While the stream is busy with frames it has (a slow callback), the reader takes at
most this much more from the socket, then stops reading until the stream waits again:
a reader that falls behind must show as behind at the daemon (its lag, its gaps), not
fill client memory. A stream that takes each read's frames before the next (the usual
case) is never paused, which would cost two system calls and a round of Python per
read."""
_MIN_READ = 4096
_RECEIVE_BUFFER = 256 * 1024
"""The socket's receive buffer every stream starts with, and goes back to whenever it is
busy (the kernel doubles it): left to autotune it grows to tens of MB, and a reader that
stopped reading would not show as behind at the daemon until all of that filled."""
_MAX_RECEIVE_BUFFER = 1024 * 1024
"""The receive buffer of a stream that keeps up: one that waits for bytes and finds the
kernel holding as much as the smaller buffer takes. Its reads take up to twice as much
(the daemon sends up to 1 MiB at a time to a fast reader), and every read costs a round
of the event loop and of Python, and the kernel's window updates: compare.py P7's
client CPU per GB fell by a fifth. A stream that falls behind (busy when bytes come) goes
back to :data:`_RECEIVE_BUFFER` at once (the daemon's send buffer follows its consumer
the same way, ``daemon/tcp_peer.py``)."""
_OPEN_TIMEOUT = 10.0
_FINISH = 1.0
"""Seconds a stream closed after its last frame waits for the end of its body (the
chunked terminator, sent just after), to give its connection back for reuse."""
_ERROR_BODY = 1024 * 1024


class Lender(Protocol):
    """Kept-alive connections a stream can take over and give back: a stream then costs
    no connection set-up (and its end no teardown) when one is idle — about a millisecond
    of a ``run(["true"])`` on loopback (the unary pool, :mod:`.raw_unary`)."""

    async def lend(self, connect_timeout: float) -> Any:
        """A connection (``.transport``, ``.connection_lost``): idle, else new."""

    def take_back(self, conn: Any) -> None:
        """``conn``, its response read whole, is idle again."""

    def discard(self, conn: Any) -> None:
        """``conn`` is closed: forget it."""


class _Reader(asyncio.BufferedProtocol):
    """The socket's bytes, received into one buffer kept for the whole stream: to a
    :class:`~.http11.HeadReader` until the response head is read, then (a chunked 200)
    through a :class:`~.http11.ChunkedBody` into the frame decoder, as they arrive.

    Not ``asyncio.StreamReader`` (nor a plain ``Protocol``): each read would be a new
    256 KiB object — fresh memory the kernel faults in page by page, the largest single
    cost of a stream read at full rate — and StreamReader copies every byte into its
    buffer and out again on top."""

    def __init__(self, lender: Lender | None = None, lent: Any = None) -> None:
        self.transport: asyncio.Transport | None = None
        self._lender = lender
        self._lent = lent
        """The lender's connection this stream took over (``None``: a connection of its
        own): given back if the response ends whole, else closed and discarded."""
        self.keep_alive = False
        self._last: FrameKind | None = None  # the kind of the last frame cut
        self._finishing: asyncio.TimerHandle | None = None
        self._buffer = FrameBuffer()
        self._socket: Any = None  # set by size_receive_buffer: the socket it sizes
        self._receive_buffer = 0  # the size last set (0: none)
        self._unread = 0
        self._paused = False
        self._closed = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._heads = HeadReader()
        self.head: Head | None = None
        self._early = bytearray()  # body bytes read before start_frames or chunks
        # The body, once it is read as frames (see start_frames).
        self._body: ChunkedBody | None = None
        self._frames: list[Frame] = []

    # -- the event loop's side -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport instances, only alike)
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        space = self._buffer.space()
        if self._waiter is not None:
            # The stream takes these bytes at once: as many as there are room for, so
            # that a read takes all the kernel holds (several of the daemon's sends, a
            # frame and the start of the next) and a GB costs fewer reads, each a round
            # of the event loop and of Python.
            return space
        room = max(_BUFFER - self._unread, _MIN_READ)
        return space if len(space) <= room else space[:room]

    def buffer_updated(self, nbytes: int) -> None:
        if self._error is not None:
            return
        try:
            if self._body is not None:
                self._take(nbytes)
            elif self.head is not None:
                self._early += self._buffer.space()[:nbytes]
            elif (got := self._heads.feed(self._buffer.space()[:nbytes])) is not None:
                self.head, rest = got
                self._early += rest
        except BadResponse as exc:
            self._fail(DaemonUnavailable(f"stream broke: {exc}"[:300]))
            return
        self._unread += nbytes
        if self._waiter is None:  # busy with frames: it may be falling behind
            if self._receive_buffer > _RECEIVE_BUFFER:
                self._size_receive_buffer(_RECEIVE_BUFFER)
            if self._unread >= _BUFFER and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        elif nbytes >= _RECEIVE_BUFFER and self._receive_buffer == _RECEIVE_BUFFER:
            self._size_receive_buffer(_MAX_RECEIVE_BUFFER)  # it keeps up (see above)
        self._wake()

    def size_receive_buffer(self, sock: Any) -> None:
        """Size ``sock``'s receive buffer (this stream's connection's) from now on: at
        first :data:`_RECEIVE_BUFFER`, then by how the stream keeps up."""
        self._socket = sock
        self._receive_buffer = 0
        self._size_receive_buffer(_RECEIVE_BUFFER)

    def _size_receive_buffer(self, size: int) -> None:
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        except (OSError, AttributeError):
            return  # not a socket that can be sized: left as it is
        self._receive_buffer = size

    def eof_received(self) -> bool:
        self._end()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            error = DaemonUnavailable(f"stream broke: {exc!r}"[:300])
            error.__cause__ = exc
            self._fail(error)
        self._end()
        self._stop_finishing()
        if self._lent is not None:
            self._lent.connection_lost(exc)  # the lender's own bookkeeping (its ``lost``)
            assert self._lender is not None
            self._lender.discard(self._lent)
            self._lent = None

    def _end(self) -> None:
        self._closed = True
        if self._body is not None and not self._body.done:
            self._fail(DaemonUnavailable("stream broke: connection closed inside the body"))
        self._wake()

    def _take(self, nbytes: int) -> None:
        """``nbytes`` were received into the buffer's space: their frames, in place."""
        assert self._body is not None
        buffer = self._buffer
        start, end = buffer.received(nbytes)
        try:
            self._body.feed_at(buffer.raw, start, end, buffer.piece)
            cut = len(self._frames)
            buffer.cut(self._frames)
            if len(self._frames) > cut:
                self._last = self._frames[-1].kind
        except BadChunk as exc:
            self._fail(DaemonUnavailable(f"stream broke: {exc}"[:300]))
        except MalformedFrame as exc:
            self._fail(exc)
        if self._finishing is not None:
            self.release()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    # -- the connection's end ----------------------------------------------------------

    def release(self) -> None:
        """The stream is done with the connection: a lent one whose response was read
        whole goes back to its lender; one whose last frame came (its ``end``, or an
        ``error``) waits up to :data:`_FINISH` for the body's terminator first; any
        other is closed."""
        transport = self.transport
        if transport is None:
            return
        body = self._body
        clean = (
            self._lent is not None
            and self.keep_alive
            and body is not None
            and self._error is None
            and not self._closed
            and not self._frames
            and not self._buffer.pending
        )
        if clean and body is not None and body.done:
            self._stop_finishing()
            if self._paused:  # it fell behind and stopped reading: the next user reads
                self._paused = False
                transport.resume_reading()
            lender, lent = self._lender, self._lent
            assert lender is not None
            # Let go of it: this may run inside a read (the body's end arriving), whose
            # rest must not touch the connection (pausing it for a large read, above all).
            self._lent = None
            self.transport = None
            lender.take_back(lent)
        elif clean and self._last in (FrameKind.END, FrameKind.ERROR):
            if self._finishing is None:
                loop = asyncio.get_running_loop()
                self._finishing = loop.call_later(_FINISH, self._give_up)
                if self._paused:
                    self._paused = False
                    transport.resume_reading()
        else:
            self._give_up()

    def _give_up(self) -> None:
        self._stop_finishing()
        if self.transport is not None:
            self.transport.close()

    def _stop_finishing(self) -> None:
        if self._finishing is not None:
            self._finishing.cancel()
            self._finishing = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        # Everything received so far is taken: let the socket be read again.
        self._unread = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- the stream's side -----------------------------------------------------------

    async def read_head(self) -> Head:
        """The response head, waiting for its bytes."""
        while self.head is None:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise DaemonUnavailable("stream broke: closed before the response head")
            await self._wait()
        return self.head

    def start_frames(self) -> None:
        """Read the rest of the body (chunked) as frames: see :meth:`batches`."""
        self._body = ChunkedBody()
        rest, self._early = self._early, bytearray()
        while rest and self._error is None:  # body bytes read with the head
            space = self._buffer.space()
            size = min(len(space), len(rest))
            space[:size] = rest[:size]
            del rest[:size]
            self._take(size)
        if self._closed:
            self._end()

    async def plain_chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (a body not read as frames: an error's),
        framed as its head says: a length, chunked, or to the connection's end."""
        head = await self.read_head()
        chunks = ChunkedBody() if head.chunked else None
        left = head.length
        while True:
            data, self._early = bytes(self._early), bytearray()
            if chunks is not None:
                pieces: list[memoryview] = []
                try:
                    chunks.feed(data, pieces.append)
                except BadChunk as exc:
                    raise DaemonUnavailable(f"stream broke: {exc}"[:300]) from exc
                data = b"".join(pieces)
            elif left is not None:
                if len(data) > left:
                    raise DaemonUnavailable("stream broke: bytes after the end of the body")
                left -= len(data)
            if data:
                yield data
            if left == 0 or (chunks is not None and chunks.done):
                return
            if self._error is not None:
                raise self._error
            if self._closed:
                if chunks is None and left is None:
                    return  # a body delimited by the end of the connection
                raise DaemonUnavailable("stream broke: connection closed inside the body")
            await self._wait()

    async def batches(self, borrow: bool = False) -> AsyncGenerator[list[Frame], None]:
        """The frames each read completed; the end of the body ends it. With ``borrow``
        the payloads are views into the receive buffer, valid until the next batch is
        asked for (no copy: a consumer that only decodes them never needs one)."""
        body = self._body
        buffer = self._buffer
        assert body is not None
        while True:
            if self._frames:
                frames, self._frames = self._frames, []
                if not borrow:
                    frames = [_owned(frame) for frame in frames]
                    buffer.release()
                yield frames
                if not self._frames:  # done with every frame cut so far
                    buffer.release()
                continue
            if self._error is not None:
                raise self._error
            if body.done:
                if self._buffer.pending:
                    raise MalformedFrame(
                        f"stream ended inside a frame ({self._buffer.pending} bytes)"
                    )
                return
            await self._wait()


def _owned(frame: Frame) -> Frame:
    """``frame`` with a payload of its own (not a view into the receive buffer)."""
    if type(frame.payload) is memoryview:
        return Frame(frame.kind, frame.meta, bytes(frame.payload))
    return frame


class RawStream:
    """An open stream's body: :meth:`batches` (frames) or :meth:`chunks` (bytes)."""

    def __init__(self, reader: _Reader) -> None:
        self._reader = reader

    @property
    def framed(self) -> bool:
        """True if the body is read as frames (:meth:`batches`), not bytes."""
        return self._reader._body is not None

    def batches(self, borrow: bool = False) -> AsyncGenerator[list[Frame], None]:
        """The body's frames, in lists: the frames each read completed (``borrow``:
        see :meth:`_Reader.batches`)."""
        return self._reader.batches(borrow)

    def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes (a body not read as frames)."""
        return self._reader.plain_chunks()

    async def body(self) -> bytes:
        """The whole body (an error's), up to a bound."""
        parts: list[bytes] = []
        size = 0
        async for data in self.chunks():
            parts.append(data)
            size += len(data)
            if size > _ERROR_BODY:
                break
        return b"".join(parts)

    def close(self) -> None:
        """Done with the connection: given back for reuse if the response ended whole
        (see :meth:`_Reader.release`), else closed."""
        self._reader.release()

    def abort(self) -> None:
        """Drop the connection at once, unsent bytes and all (as a network failure)."""
        if self._reader.transport is not None:
            self._reader.transport.abort()


@contextlib.asynccontextmanager
async def open_raw_stream(
    url: str,
    path: str,
    query: dict[str, Any],
    headers: dict[str, str],
    body: bytes | None = None,
    lender: Lender | None = None,
) -> AsyncIterator[RawStream]:
    """GET ``path`` (POST the JSON ``body``, if given) on the plain-HTTP daemon at
    ``url``, on a connection of the ``lender``'s if given; yields the open stream once
    its status is 200 (a chunked body is read as frames: :meth:`RawStream.batches`),
    raises the daemon's typed error otherwise. On exit the connection is given back if
    the response was read whole, else closed."""
    parts = urlsplit(url)
    host = (parts.hostname or "127.0.0.1").strip("[]")
    port = parts.port or 80
    target = parts.path.rstrip("/") + path
    if query:
        target += "?" + encode_query(query)
    request = encode_request(
        "GET" if body is None else "POST", target, request_fields(parts.netloc, headers), body
    )
    if lender is not None:
        lent = await lender.lend(_OPEN_TIMEOUT)
        reader = _Reader(lender, lent)
        lent.transport.set_protocol(reader)
        reader.connection_made(lent.transport)
    else:
        try:
            # within(), not asyncio.wait_for: before 3.12 wait_for swallows a cancellation
            # that arrives as the connection opens, and a disconnect() would wait forever.
            loop = asyncio.get_running_loop()
            _, reader = await within(loop.create_connection(_Reader, host, port), _OPEN_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {exc!r}", url=url) from exc
    sock = reader.transport.get_extra_info("socket") if reader.transport else None
    if sock is not None:
        reader.size_receive_buffer(sock)
    stream = RawStream(reader)
    try:
        assert reader.transport is not None
        reader.transport.write(request)
        try:
            head = await within(reader.read_head(), _OPEN_TIMEOUT)
        except TimeoutError as exc:
            raise DaemonUnavailable(f"stream broke: {exc!r}"[:300], url=url) from exc
        if head.status != 200:
            error_body = await stream.body()
            try:
                parsed = json.loads(error_body)
            except ValueError:
                parsed = None
            error: SandboxkitError = error_from_wire(parsed, head.status)
            raise error
        if head.chunked:
            reader.keep_alive = head.keep_alive
            reader.start_frames()
        yield stream
    finally:
        stream.close()
