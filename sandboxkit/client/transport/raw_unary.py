"""JSON requests to a plain-HTTP loopback daemon over kept-alive sockets of our own, below
httpx: the request written in one write, the response head parsed by a small strict
parser (:mod:`.http11`, shared with the streams of :mod:`.raw_stream`), the body decoded
with msgspec.

A unary request (pause, resume, get, run) is a few hundred bytes each way, and on
loopback the client's own CPU is most of its latency (issue 11: ~1.1 ms per request
in httpx, httpcore and anyio against ~0.5 ms in the daemon).

Connections are reused (LIFO, at most :data:`MAX_IDLE` idle, each for at most
:data:`MAX_IDLE_AGE` seconds idle, short of the daemon's keep-alive timeout). One that the
daemon closed while idle (a restart) is noticed before it is written to and dropped; one
that it closes after the request went out without answering a byte is retried once on a
new connection if the request is idempotent, else the request fails with
DaemonUnavailable (the daemon may have acted on it).

A hung daemon (stopped, its event loop blocked) still has its connections accepted by
the kernel, and answers nothing. A request with no whole response after
:data:`PROBE_AFTER` seconds asks the daemon's ``/health`` on another connection; no
answer within :data:`PROBE_TIMEOUT` fails the request with DaemonUnavailable at once,
rather than at the end of its own timeout (30 s by default: a request the daemon is
merely slow to answer, e.g. one waiting on a kill grace, runs on).
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

from sandboxkit._compat import within
from sandboxkit.client.transport.http11 import (
    BadChunk,
    BadResponse,
    ChunkedBody,
    Head,
    HeadReader,
    encode_request,
    request_fields,
)
from sandboxkit.errors import DaemonUnavailable

__all__ = ["RawPool", "RawResponse"]

PROBE_AFTER = 2.0
"""Seconds without a whole response after which a request checks the daemon is alive."""
PROBE_TIMEOUT = 2.0
"""Seconds the daemon has to answer that check before it is taken for hung."""
MAX_IDLE = 32
"""Idle connections kept per daemon (as httpx's max_keepalive_connections)."""
MAX_IDLE_AGE = 4.0
"""Seconds an idle connection is reused for at most. The daemon closes a connection idle
for its keep-alive timeout (5 s by default); a request written to it just as that happens
is lost, and one that is not idempotent (a start) cannot be sent again."""
READ_SIZE = 64 * 1024
"""Bytes a connection reads at most at a time, into its pool's buffer (see
:class:`_Connection`): a small answer in one read, a large one in a few dozen."""
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})


@dataclass(frozen=True)
class RawResponse:
    """A complete response."""

    status: int
    body: bytes


class _Dropped(Exception):
    """The daemon closed the connection before it sent a byte of the response."""


class _Hung(Exception):
    """The daemon did not answer a health probe while a request waited on it."""


class _Connection(asyncio.BufferedProtocol):
    """One kept-alive connection: a request at a time, its response collected as the
    bytes arrive and handed over whole.

    Its bytes are received into ``read_into``, a buffer its pool keeps for all its
    connections on one event loop, and copied out at once (a few hundred bytes, for most
    answers). As a plain ``asyncio.Protocol``, every read was a new object of the loop's
    read size (256 KiB) shrunk to the answer's: in a process whose allocator maps blocks
    of that size (glibc's threshold stays at 128 KiB until a block over it is freed
    whole), three system calls a read, a sixth of a small call's time in the client
    (measured). The buffer can be shared: the event loop hands a connection a buffer and
    then the bytes read into it, with no other connection's read in between (asyncio's
    and uvloop's alike), and :meth:`buffer_updated` keeps no view of it."""

    def __init__(self, read_into: memoryview) -> None:
        self._read_into = read_into
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()
        """Done once the connection is closed (and its socket with it)."""
        self.reusable = False
        self.idle_since = 0.0
        """The event loop's time when it last went back to the pool."""
        self._waiter: asyncio.Future[RawResponse] | None = None
        self._heads = HeadReader()
        self._head: Head | None = None
        self._chunks: ChunkedBody | None = None
        self._body = bytearray()
        self._timer: asyncio.TimerHandle | None = None

    # -- the event loop's side -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport instances, only alike)
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_into

    def buffer_updated(self, nbytes: int) -> None:
        data = bytes(self._read_into[:nbytes])
        waiter = self._waiter
        if waiter is None or waiter.done():
            # Bytes nobody asked for: the connection is out of step; never reuse it.
            self.reusable = False
            self.close()
            return
        try:
            response = self._take(data)
        except (BadResponse, BadChunk) as exc:
            self.reusable = False
            self.close()
            waiter.set_exception(BadResponse(str(exc)))
            return
        if response is not None:
            waiter.set_result(response)

    def eof_received(self) -> bool:
        self._ended()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._ended(exc)
        if not self.lost.done():
            self.lost.set_result(None)

    def _ended(self, exc: Exception | None = None) -> None:
        self.reusable = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        head = self._head
        if head is not None and head.length is None and not head.chunked:
            # A body delimited by the end of the connection: this is its end.
            waiter.set_result(RawResponse(head.status, bytes(self._body)))
            return
        error: Exception = (
            _Dropped()
            if head is None and not self._heads.started
            else BadResponse("closed mid-response")
        )
        error.__cause__ = exc
        waiter.set_exception(error)

    def _take(self, data: bytes) -> RawResponse | None:
        head = self._head
        if head is None:
            got = self._heads.feed(data)
            if got is None:
                return None
            head, data = got
            self._head = head
            self.reusable = head.keep_alive
            if head.chunked:
                self._chunks = ChunkedBody()
        if head.chunked:
            chunks = self._chunks
            assert chunks is not None
            if data:
                chunks.feed(data, self._body.extend)
            if chunks.done:
                return RawResponse(head.status, bytes(self._body))
            return None
        self._body += data
        if head.length is None or len(self._body) < head.length:
            return None  # (no length: until the connection closes)
        if len(self._body) > head.length:
            self.reusable = False  # bytes after the response: out of step
        return RawResponse(head.status, bytes(self._body[: head.length]))

    # -- the request's side ----------------------------------------------------------

    def idle_and_open(self) -> bool:
        """True if the connection can carry a request: open, and nothing (an EOF, a
        reset) waiting to be read that the event loop has not handled yet."""
        transport = self.transport
        if not self.reusable or transport is None or transport.is_closing():
            return False
        sock = transport.get_extra_info("socket")
        # poll, not select: a notebook process may hold more than select's 1024 fds.
        poller = select.poll()
        try:
            poller.register(sock.fileno(), select.POLLIN)
            return not poller.poll(0)  # readable while idle: EOF, a reset, or junk
        except (OSError, ValueError):
            return False

    async def request(
        self,
        data: bytes,
        timeout: float | None,
        probe: Callable[[], Awaitable[bool]] | None = None,
    ) -> RawResponse:
        """Write ``data`` (one whole request) and wait for the whole response; after
        :data:`PROBE_AFTER` seconds without it, ``probe()`` (is the daemon alive?) runs,
        and ``False`` fails the request with :class:`_Hung`."""
        transport = self.transport
        assert transport is not None
        self._heads = HeadReader()
        self._body.clear()
        self._head = None
        self._chunks = None
        self.reusable = False  # until a response says otherwise
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[RawResponse] = loop.create_future()
        self._waiter = waiter
        transport.write(data)
        # One timer per request: at PROBE_AFTER it starts the check and sleeps on to the
        # timeout (most requests end before either).
        checks: list[asyncio.Task[None]] = []
        if probe is not None and (timeout is None or timeout > PROBE_AFTER):
            self._timer = loop.call_later(PROBE_AFTER, self._check_alive, probe, checks, timeout)
        elif timeout is not None:
            self._timer = loop.call_later(timeout, self._time_out, timeout)
        try:
            return await waiter
        finally:
            self._waiter = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for task in checks:  # owned: never outlives the request
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            if not waiter.done() or waiter.cancelled() or waiter.exception() is not None:
                self.reusable = False
                self.close()

    def _check_alive(
        self,
        probe: Callable[[], Awaitable[bool]],
        checks: list[asyncio.Task[None]],
        timeout: float | None,
    ) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        loop = asyncio.get_running_loop()
        if timeout is not None:
            self._timer = loop.call_later(timeout - PROBE_AFTER, self._time_out, timeout)

        async def check() -> None:
            if not await probe() and not waiter.done():
                waiter.set_exception(
                    _Hung(f"no answer to a health check within {PROBE_TIMEOUT:g} s")
                )

        checks.append(loop.create_task(check()))

    def _time_out(self, timeout: float) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError(f"no whole response within {timeout:g} s"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class RawPool:
    """Kept-alive connections to one plain-HTTP daemon on loopback, for JSON requests."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        self.url = url
        self._host = (parts.hostname or "127.0.0.1").strip("[]")
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._fields = request_fields(parts.netloc, headers)
        self._idle: list[_Connection] = []
        self._read_into = memoryview(bytearray())  # the reads of the loop's connections
        self._all: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def encode(self, method: str, path: str, query: str, body: bytes | None) -> bytes:
        """One request, head and body, as the bytes written."""
        target = self._prefix + path + ("?" + query if query else "")
        return encode_request(method, target, self._fields, body)

    async def request(
        self,
        method: str,
        path: str,
        query: str = "",
        body: bytes | None = None,
        *,
        connect_timeout: float | None = 10.0,
        timeout: float | None = 30.0,
        probe: bool = True,
    ) -> RawResponse:
        """Send one request and return its whole response; DaemonUnavailable if the
        daemon cannot be reached, closes the connection without answering (after one
        retry on a new connection, for an idempotent request on a reused one), answers
        with bytes that are not a response, or does not answer within ``timeout``."""
        data = self.encode(method, path, query, body)
        retried = False
        while True:
            if self.closed:
                raise DaemonUnavailable("this client's connection pool was closed", url=self.url)
            conn, reused = await self._get(connect_timeout)
            try:
                response = await conn.request(data, timeout, self.alive if probe else None)
            except _Hung as exc:
                raise DaemonUnavailable(f"the daemon is hung: {exc}", url=self.url) from exc
            except _Dropped as exc:
                if reused and not retried and method in _IDEMPOTENT:
                    retried = True
                    continue
                raise DaemonUnavailable(
                    "the daemon closed the connection without answering", url=self.url
                ) from exc.__cause__
            except BadResponse as exc:
                raise DaemonUnavailable(f"bad response from the daemon: {exc}", url=self.url) from (
                    exc.__cause__ or exc
                )
            except TimeoutError as exc:
                raise DaemonUnavailable(f"the daemon did not answer: {exc}", url=self.url) from exc
            self._put(conn)
            return response

    async def alive(self, timeout: float | None = None) -> bool:
        """Whether the daemon answers ``GET /health`` (any answer) within ``timeout``
        (default :data:`PROBE_TIMEOUT`)."""
        bound = PROBE_TIMEOUT if timeout is None else timeout
        try:
            await within(
                self.request("GET", "/health", connect_timeout=bound, timeout=bound, probe=False),
                bound,
            )
        except (DaemonUnavailable, TimeoutError):
            return False
        return True

    async def _get(self, connect_timeout: float | None) -> tuple[_Connection, bool]:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # connections belong to the loop that opened them
            self._drop_idle()
            self._loop = loop
            self._read_into = memoryview(bytearray(READ_SIZE))  # never two loops' reads
        idle = self._idle
        fresh = loop.time() - MAX_IDLE_AGE
        while idle:
            conn = idle.pop()
            if conn.idle_since > fresh and conn.idle_and_open():
                return conn, True
            self._discard(conn)
        try:
            # within(), not asyncio.wait_for: see raw_stream.open_raw_stream.
            opening = loop.create_connection(
                lambda: _Connection(self._read_into), self._host, self._port
            )
            _, conn = await within(opening, connect_timeout)
        except (OSError, TimeoutError) as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {exc!r}", url=self.url) from exc
        self._all.add(conn)
        if self.closed:  # closed while this one opened
            self._discard(conn)
            raise DaemonUnavailable("this client's connection pool was closed", url=self.url)
        return conn, False

    async def lend(self, connect_timeout: float) -> _Connection:
        """A connection for a stream to take over (its own protocol on the transport,
        see :class:`~.raw_stream.Lender`): an idle one, else a new one."""
        conn, _ = await self._get(connect_timeout)
        return conn

    def take_back(self, conn: _Connection) -> None:
        """A lent connection whose response was read whole: idle again."""
        assert conn.transport is not None
        conn.transport.set_protocol(conn)
        conn.reusable = True
        self._put(conn)

    def discard(self, conn: _Connection) -> None:
        """A lent connection that was closed."""
        self._discard(conn)

    def _put(self, conn: _Connection) -> None:
        if conn.reusable and not self.closed and len(self._idle) < MAX_IDLE:
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
        else:
            self._discard(conn)

    def _discard(self, conn: _Connection) -> None:
        conn.close()
        self._all.discard(conn)

    def _drop_idle(self) -> None:
        for conn in self._idle:
            self._discard(conn)
        self._idle.clear()

    @property
    def connections(self) -> int:
        """Connections open now (idle or carrying a request)."""
        return sum(1 for conn in self._all if not conn.lost.done())

    async def aclose(self) -> None:
        """Close every connection and wait until their sockets are closed. Idempotent."""
        self.closed = True
        conns = list(self._all)
        self._idle.clear()
        self._all.clear()
        for conn in conns:
            conn.close()
        running = asyncio.get_running_loop()
        waits = [c.lost for c in conns if not c.lost.done() and c.lost.get_loop() is running]
        if waits:
            await asyncio.wait(waits, timeout=5.0)
