"""The fast path: a plain-HTTP daemon on loopback talked to over sockets of our own,
below httpx (:mod:`.raw_unary` for JSON calls, :mod:`.raw_stream` for streams). Where
httpx would talk plain TCP to loopback anyway (no TLS, no proxy) it only adds CPU per
call and per chunk; see those modules for what is measured."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import httpx
import msgspec

from sandboxkit.client.transport.base import FrameStream
from sandboxkit.client.transport.http11 import encode_query
from sandboxkit.client.transport.raw_stream import RawStream, open_raw_stream
from sandboxkit.client.transport.raw_unary import RawPool
from sandboxkit.errors import MalformedFrame, SandboxkitError, error_from_wire
from sandboxkit.wire import Frame

__all__ = ["RawFrameStream", "RawTransport"]

_encode_json = msgspec.json.encode
_decode_json = msgspec.json.decode


class RawFrameStream(FrameStream):
    """The frames of a stream read off its socket (decoded there, as bytes arrive)."""

    def __init__(self, raw: RawStream) -> None:
        super().__init__(raw.chunks())
        self._raw = raw

    def batches(self, borrow: bool = False) -> AsyncGenerator[list[Frame], None]:
        if self._raw.framed:
            return self._raw.batches(borrow)
        return super().batches(borrow)

    async def aclose(self) -> None:
        self._raw.close()

    def abort(self) -> None:
        self._raw.abort()


class RawTransport:
    """Kept-alive raw sockets to one plain-HTTP daemon on loopback."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        self.url = url
        self._headers = dict(headers)
        self.pool = RawPool(url, headers)
        """The kept-alive connections of JSON calls, lent to streams (each stream holds
        one for as long as it runs, and gives it back if its response ended whole)."""

    @property
    def closed(self) -> bool:
        return self.pool.closed

    async def request(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any],
        json: Any,
        timeout: httpx.Timeout,
    ) -> Any:
        raw = await self.pool.request(
            method,
            path,
            encode_query(query) if query else "",
            None if json is None else _encode_json(json),
            connect_timeout=timeout.connect,
            timeout=timeout.read,
        )
        return _json_or_raise(raw.status, raw.body)

    async def alive(self, timeout: float) -> bool:
        return await self.pool.alive(timeout)

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, query: Mapping[str, Any], json: Any = None
    ) -> AsyncIterator[FrameStream]:
        body = None if json is None else _encode_json(json)
        async with open_raw_stream(
            self.url, path, dict(query), self._headers, body, lender=self.pool
        ) as raw:
            yield RawFrameStream(raw)

    async def aclose(self) -> None:
        await self.pool.aclose()


def _json_or_raise(status: int, content: bytes) -> Any:
    """The JSON body of a response, or the typed error it carries."""
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
