"""Everything that is not a plain-HTTP daemon on loopback (TLS, a proxy, a transport
given by the caller such as ``httpx.MockTransport``): through an ``httpx.AsyncClient``."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

from sandboxkit.client.transport.base import CALL_TIMEOUT, FrameStream
from sandboxkit.errors import DaemonUnavailable, MalformedFrame, SandboxkitError, error_from_wire

__all__ = ["LOOPBACK", "HttpxFrameStream", "HttpxTransport", "http_options"]

_STREAM_TIMEOUT = httpx.Timeout(10.0, read=None)
# Streams are long-lived connections: no cap on how many one process holds to its daemon.
_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=32)
LOOPBACK = ("127.", "localhost", "[::1]")
"""How a loopback host name begins."""

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
    return {"verify": _plain_http_context, "trust_env": not rest.startswith(LOOPBACK)}


class HttpxFrameStream(FrameStream):
    """The frames of a stream read through httpx (decoded from its raw body)."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(_body(response))
        self._response = response

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxTransport:
    """One ``httpx.AsyncClient`` to one daemon; ``transport`` is any httpx transport
    (tests pass ``httpx.MockTransport`` to script responses)."""

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str],
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        self.client = httpx.AsyncClient(
            base_url=url,
            headers=dict(headers),
            timeout=CALL_TIMEOUT,
            limits=_LIMITS,
            transport=transport,
            **http_options(url),
        )

    @property
    def closed(self) -> bool:
        return self.client.is_closed

    async def request(
        self,
        method: str,
        path: str,
        query: Mapping[str, Any],
        json: Any,
        timeout: httpx.Timeout,
    ) -> Any:
        try:
            response = await self.client.request(
                method, path, json=json, params=dict(query), timeout=timeout
            )
        except httpx.TransportError as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {exc!r}", url=self.url) from exc
        return _json_or_raise(response)

    async def alive(self, timeout: float) -> bool:
        try:
            await self.client.get("/health", timeout=timeout)
        except httpx.TransportError:
            return False
        return True

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, query: Mapping[str, Any], json: Any = None
    ) -> AsyncIterator[FrameStream]:
        client = self.client
        request = client.build_request(
            "GET" if json is None else "POST",
            path,
            params=dict(query),
            json=json,
            timeout=_STREAM_TIMEOUT,
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {exc!r}", url=self.url) from exc
        try:
            if response.status_code != 200:
                await response.aread()
                _json_or_raise(response)
            yield HttpxFrameStream(response)
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


async def _body(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for data in response.aiter_raw():
            yield data
    except httpx.TransportError as exc:
        raise DaemonUnavailable(f"stream broke: {exc!r}", url=str(response.url)) from exc


def _json_or_raise(response: httpx.Response) -> Any:
    """The JSON body of a response, or the typed error it carries."""
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
