"""The low-level client of one daemon: JSON calls and framed streams, errors mapped to
types, over whichever :mod:`~sandboxkit.client.transport` suits the daemon's URL."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from sandboxkit.client.transport import (
    CALL_TIMEOUT,
    FrameStream,
    Transport,
    http_options,
    make_transport,
)
from sandboxkit.errors import SandboxClosed

__all__ = ["ApiClient", "FrameStream", "http_options"]


@dataclass
class _Shared:
    """One daemon's transport, and how many ApiClients use it."""

    transport: Transport
    users: int = 0


# One transport (its connection pool) per event loop and daemon, shared by every
# ApiClient of the process on that loop; closed when the last of them closes.
_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], _Shared]] = (
    weakref.WeakKeyDictionary()
)


def _acquire(url: str, token: str | None) -> _Shared:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # built outside a loop: a pool of its own
        return _Shared(make_transport(url, _auth(token)), 1)
    pools = _shared.setdefault(loop, {})
    key = (url, token or "")
    entry = pools.get(key)
    if entry is None or entry.transport.closed:
        entry = pools[key] = _Shared(make_transport(url, _auth(token)))
    entry.users += 1
    return entry


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class ApiClient:
    """A client of one daemon: JSON calls and framed streams.

    Every ApiClient of a process talking to the same daemon on the same event loop shares
    one transport (so a new sandbox costs no new client and no new connection); it closes
    with the last of them. A plain-HTTP daemon on loopback (the local one) is talked to
    over sockets of our own (:class:`~sandboxkit.client.transport.RawTransport`); anything
    else (TLS, a proxy) through httpx. ``transport`` is any httpx transport, with a pool
    of its own: tests may pass ``httpx.MockTransport`` to script responses.
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: httpx.Timeout = CALL_TIMEOUT,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self._timeout = timeout
        self._closed = False
        self.streams: set[FrameStream] = set()
        """The streams this client opened and has not closed yet."""
        if transport is None:
            self._shared = _acquire(self.url, token)
        else:
            self._shared = _Shared(make_transport(self.url, _auth(token), transport), 1)
        self.transport: Transport = self._shared.transport
        """How this client reaches its daemon (shared with the other clients of it)."""

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` ran."""
        return self._closed or self.transport.closed

    async def aclose(self) -> None:
        """Close this client: any stream it left open, and the transport if no other
        client shares it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for stream in list(self.streams):
            await stream.aclose()
        self._shared.users -= 1
        if self._shared.users <= 0:
            await self.transport.aclose()

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxClosed(f"this client's connection to {self.url} was closed")

    async def call(self, method: str, path: str, json: Any = None, **params: Any) -> Any:
        """One JSON request; raises the typed error the daemon answered with."""
        query = {k: v for k, v in params.items() if v is not None}
        self._check_open()
        return await self.transport.request(method, path, query, json, self._timeout)

    async def alive(self, timeout: float) -> bool:
        """Whether the daemon answers ``GET /health`` (any answer) within ``timeout``: a
        silent stream asks, to tell a hung daemon from a stalled stream."""
        if self.closed:
            return False
        return await self.transport.alive(timeout)

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, json: Any = None, **params: Any
    ) -> AsyncIterator[FrameStream]:
        """Open a framed stream (``GET``; ``POST`` with a ``json`` body); yields a
        :class:`FrameStream`, an async iterator of frames. The response is always closed
        on exit, so no half-open stream is left behind (F4)."""
        query = {k: v for k, v in params.items() if v is not None}
        self._check_open()
        async with self.transport.stream(path, query, json) as frames:
            self.streams.add(frames)
            try:
                yield frames
            finally:
                self.streams.discard(frames)
