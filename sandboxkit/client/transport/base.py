"""What every transport offers :class:`~sandboxkit.client.api.ApiClient`: the
:class:`Transport` protocol, and :class:`FrameStream`, the frames of one open stream.

A transport is one way of talking HTTP to one daemon (raw sockets on loopback, httpx
otherwise), as httpx's ``AsyncBaseTransport`` is for httpx: the client above it holds one
and never asks which. A transport owns its connections and maps what the daemon answered
to the typed errors of :mod:`sandboxkit.errors`; the client above owns the bookkeeping
(closed or not, which streams it opened, the query's ``None`` values left out).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import httpx

from sandboxkit.errors import MalformedFrame
from sandboxkit.wire import Frame, FrameDecoder

__all__ = ["CALL_TIMEOUT", "FrameStream", "Transport"]

CALL_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
"""A JSON call's bounds: 10 s to connect, 30 s for the whole answer."""


class FrameStream(AsyncIterator[Frame]):
    """The frames of one open stream: ``async for frame in stream`` — or
    :meth:`batches`, the frames each network read completed, one list per read (one
    iteration step per read instead of per frame, for readers at full rate).

    A transport hands its own subclass, which knows how to close the connection under it
    (:meth:`aclose`, :meth:`abort`)."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self._body = body
        self._frames = self._each()

    def batches(self, borrow: bool = False) -> AsyncGenerator[list[Frame], None]:
        """Lists of frames, one per network read that completed any. ``borrow``: the
        payloads may be views into the transport's buffer, valid only until the next
        batch is asked for (a transport that decodes in place then copies none). A
        reader that stops before the end closes it (``contextlib.aclosing``), rather
        than leave it to the garbage collector and the loop."""
        return self._decode()

    async def _decode(self) -> AsyncGenerator[list[Frame], None]:
        decoder = FrameDecoder()
        async for data in self._body:
            frames = decoder.feed(data)
            if frames:
                yield frames
        if decoder.pending:
            raise MalformedFrame(f"stream ended inside a frame ({decoder.pending} bytes)")

    async def _each(self) -> AsyncIterator[Frame]:
        async for batch in self.batches():
            for frame in batch:
                yield frame

    async def __anext__(self) -> Frame:
        return await self._frames.__anext__()

    async def aclose(self) -> None:
        """Close the stream's connection (a stream's connection is never reused)."""

    def abort(self) -> None:
        """Drop the connection at once, as a network failure would (for tests that cut
        streams). Not every transport can."""
        raise NotImplementedError(f"{type(self).__name__} cannot abort its connection")


class Transport(Protocol):
    """HTTP to one daemon: JSON calls, framed streams, a liveness check.

    Implementations: :class:`~sandboxkit.client.transport.raw.RawTransport` (kept-alive
    sockets of our own, for a plain-HTTP daemon on loopback: the fast path) and
    :class:`~sandboxkit.client.transport.via_httpx.HttpxTransport` (everything else)."""

    url: str
    """The daemon's base URL, without a trailing slash."""

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` ran (or the connections were closed under it)."""
        ...

    async def request(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any],
        json: Any,
        timeout: httpx.Timeout,
    ) -> Any:
        """One JSON request: the decoded answer, or the typed error the daemon answered
        with (DaemonUnavailable when it cannot be reached or does not answer)."""
        ...

    async def alive(self, timeout: float) -> bool:
        """Whether the daemon answers ``GET /health`` (any answer) within ``timeout``."""
        ...

    def stream(
        self, path: str, query: Mapping[str, Any], json: Any = None
    ) -> AbstractAsyncContextManager[FrameStream]:
        """``GET path`` (``POST`` with a ``json`` body) as a framed stream, open once the
        daemon answered 200 (else its typed error); the connection is closed on exit,
        whatever happens (F4)."""
        ...

    async def aclose(self) -> None:
        """Close every connection. Idempotent."""
        ...
