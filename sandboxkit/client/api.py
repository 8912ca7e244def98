"""The low-level HTTP client: JSON calls and framed streams, errors mapped to types."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from sandboxkit.client.raw_stream import RawStream, open_raw_stream
from sandboxkit.client.raw_unary import RawPool, encode_query
from sandboxkit.errors import (
    DaemonUnavailable,
    MalformedFrame,
    SandboxClosed,
    SandboxkitError,
    error_from_wire,
)
from sandboxkit.wire import Frame, FrameDecoder

__all__ = ["ApiClient", "FrameStream", "http_options"]

_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
_STREAM_TIMEOUT = httpx.Timeout(10.0, read=None)
# Streams are long-lived connections: no cap on how many one process holds to its daemon.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=32)
_LOOPBACK = ("127.", "localhost", "[::1]")
_LOOPBACK_HTTP = tuple(f"http://{host}" for host in _LOOPBACK)

_plain_http_context: ssl.SSLContext | None = None


def http_options(url: str) -> dict[str, Any]:
    """httpx client options for talking to ``url``. For plain HTTP the TLS settings are
    never used, but httpx builds an SSL context for every client, and its default one
    loads the CA bundle (~20 ms): hand it one unverifying context made once instead. On
    loopback, proxy settings from the environment do not apply."""
    global _plain_http_context
    scheme, _, rest = url.partition("://")
    if scheme != "http":
        return {}  # https: httpx's defaults, certificates verified
    if _plain_http_context is None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        _plain_http_context = context
    return {"verify": _plain_http_context, "trust_env": not rest.startswith(_LOOPBACK)}


@dataclass
class _Shared:
    """One daemon's connections: kept-alive raw sockets (a plain-HTTP daemon on
    loopback, see raw_unary) or else an httpx client."""

    http: httpx.AsyncClient | None
    pool: RawPool | None
    users: int = 0

    @property
    def closed(self) -> bool:
        if self.pool is not None:
            return self.pool.closed
        assert self.http is not None
        return self.http.is_closed

    async def aclose(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()
        if self.http is not None:
            await self.http.aclose()


# One connection pool per event loop and daemon, shared by every ApiClient of the
# process on that loop; closed when the last of them closes.
_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], _Shared]] = (
    weakref.WeakKeyDictionary()
)


def _new_shared(url: str, token: str | None, users: int = 0) -> _Shared:
    if url.startswith(_LOOPBACK_HTTP):
        return _Shared(None, RawPool(url, _auth(token)), users)
    return _Shared(_new_http(url, token), None, users)


def _acquire(url: str, token: str | None) -> _Shared:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # built outside a loop: a pool of its own
        return _new_shared(url, token, 1)
    pools = _shared.setdefault(loop, {})
    key = (url, token or "")
    entry = pools.get(key)
    if entry is None or entry.closed:
        entry = pools[key] = _new_shared(url, token)
    entry.users += 1
    return entry


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _new_http(
    url: str, token: str | None, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url,
        headers=_auth(token),
        timeout=_TIMEOUT,
        limits=_LIMITS,
        transport=transport,
        **http_options(url),
    )


class ApiClient:
    """A client of one daemon: JSON calls and framed streams.

    Every ApiClient of a process talking to the same daemon on the same event loop shares
    one connection pool (so a new sandbox costs no new client and no new connection); it
    closes with the last of them. A plain-HTTP daemon on loopback (the local one) is
    talked to over sockets of our own, below httpx (raw_unary for JSON calls, raw_stream
    for streams); anything else (TLS, a proxy) goes through httpx. ``transport`` is any
    httpx transport, with a pool of its own: tests may pass ``httpx.MockTransport`` to
    script responses.
    """

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: httpx.Timeout = _TIMEOUT,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self._timeout = timeout
        self._closed = False
        self._streams: set[httpx.Response] = set()
        self._headers = _auth(token)
        self._raw_streams: set[RawStream] = set()
        if transport is None:
            self._shared = _acquire(self.url, token)
        else:
            self._shared = _Shared(_new_http(self.url, token, transport), None, 1)
        # Below httpx (raw_unary, raw_stream) where httpx would talk plain TCP to
        # loopback anyway (no TLS, no proxy); else httpx.
        self._pool = self._shared.pool
        self._raw = self._pool is not None
        self._http_client = self._shared.http
        self._connect_timeout = timeout.connect
        self._read_timeout = timeout.read

    @property
    def _http(self) -> httpx.AsyncClient:
        assert self._http_client is not None, "a raw-socket client has no httpx client"
        return self._http_client

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` ran."""
        return self._closed or self._shared.closed

    async def aclose(self) -> None:
        """Close this client: any stream it left open, and the connection pool if no
        other client shares it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for response in list(self._streams):
            await response.aclose()
        for raw in list(self._raw_streams):
            raw.close()
        self._shared.users -= 1
        if self._shared.users <= 0:
            await self._shared.aclose()

    def _check_open(self) -> None:
        if self.closed:
            raise SandboxClosed(f"this client's connection to {self.url} was closed")

    async def call(self, method: str, path: str, json: Any = None, **params: Any) -> Any:
        """One JSON request; raises the typed error the daemon answered with."""
        query = {k: v for k, v in params.items() if v is not None}
        self._check_open()
        pool = self._pool
        if pool is not None:
            body = None if json is None else _encode_json(json)
            raw = await pool.request(
                method,
                path,
                encode_query(query) if query else "",
                body,
                connect_timeout=self._connect_timeout,
                timeout=self._read_timeout,
            )
            return _raw_json_or_raise(raw.status, raw.body)
        try:
            response = await self._http.request(
                method, path, json=json, params=query, timeout=self._timeout
            )
        except httpx.TransportError as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {exc!r}", url=self.url) from exc
        return _json_or_raise(response)

    async def alive(self, timeout: float) -> bool:
        """Whether the daemon answers ``GET /health`` (any answer) within ``timeout``: a
        silent stream asks, to tell a hung daemon from a stalled stream."""
        if self.closed:
            return False
        if self._pool is not None:
            return await self._pool.alive(timeout)
        try:
            await self._http.get("/health", timeout=timeout)
        except httpx.TransportError:
            return False
        return True

    @contextlib.asynccontextmanager
    async def stream(self, path: str, **params: Any) -> AsyncIterator[FrameStream]:
        """Open a framed stream; yields a :class:`FrameStream`, an async iterator of
        frames. The response is always closed on exit, so no half-open stream is left
        behind (F4)."""
        query = {k: v for k, v in params.items() if v is not None}
        self._check_open()
        if self._raw:
            async with open_raw_stream(self.url, path, query, self._headers) as raw:
                self._raw_streams.add(raw)
                try:
                    yield FrameStream(raw.chunks(), raw.batches() if raw.framed else None)
                finally:
                    self._raw_streams.discard(raw)
            return
        request = self._http.build_request("GET", path, params=query, timeout=_STREAM_TIMEOUT)
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {exc!r}", url=self.url) from exc
        self._streams.add(response)
        try:
            if response.status_code != 200:
                await response.aread()
                _json_or_raise(response)
            yield FrameStream(_body(response))
        finally:
            self._streams.discard(response)
            await response.aclose()


class FrameStream(AsyncIterator[Frame]):
    """The frames of one open stream: ``async for frame in stream`` — or
    :meth:`batches`, the frames each network read completed, one list per read (one
    iteration step per read instead of per frame, for readers at full rate)."""

    def __init__(
        self, body: AsyncIterator[bytes], batches: AsyncIterator[list[Frame]] | None = None
    ) -> None:
        self._body = body
        self._batches = batches  # frames decoded below (raw_stream), if they are
        self._frames = self._each()

    def batches(self) -> AsyncIterator[list[Frame]]:
        """Lists of frames, one per network read that completed any."""
        return self._batches if self._batches is not None else self._decode()

    async def _decode(self) -> AsyncIterator[list[Frame]]:
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


async def _body(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for data in response.aiter_raw():
            yield data
    except httpx.TransportError as exc:
        raise DaemonUnavailable(f"stream broke: {exc!r}", url=str(response.url)) from exc


_encode_json = msgspec.json.encode
_decode_json = msgspec.json.decode


def _raw_json_or_raise(status: int, content: bytes) -> Any:
    """As :func:`_json_or_raise`, for a response read below httpx."""
    body: Any = None
    json = bool(content)
    if json:
        try:
            body = _decode_json(content)
        except msgspec.DecodeError:
            json = False
    if status >= 400:
        error: SandboxkitError = error_from_wire(body, status)
        raise error
    if content and not json:
        raise MalformedFrame(f"daemon answered with non-JSON (HTTP {status})")
    return body


def _json_or_raise(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code >= 400:
        error: SandboxkitError = error_from_wire(body, response.status_code)
        raise error
    if body is None and response.content:
        raise MalformedFrame(f"daemon answered with non-JSON (HTTP {response.status_code})")
    return body
