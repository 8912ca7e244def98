"""The low-level HTTP client: JSON calls and framed streams, errors mapped to types."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from sandboxkit.errors import DaemonUnavailable, MalformedFrame, SandboxkitError, error_from_wire
from sandboxkit.wire import Frame, FrameDecoder

__all__ = ["ApiClient"]

_TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class ApiClient:
    """One connection pool to one daemon.

    ``transport`` is any httpx transport: the default talks TCP; tests may pass
    ``httpx.MockTransport`` to script responses.
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
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` ran."""
        return self._http.is_closed

    async def aclose(self) -> None:
        """Close the connection pool (and with it any stream left open)."""
        await self._http.aclose()

    async def call(self, method: str, path: str, json: Any = None, **params: Any) -> Any:
        """One JSON request; raises the typed error the daemon answered with."""
        query = {k: v for k, v in params.items() if v is not None}
        try:
            response = await self._http.request(method, path, json=json, params=query)
        except httpx.TransportError as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {exc!r}", url=self.url) from exc
        return _json_or_raise(response)

    @contextlib.asynccontextmanager
    async def stream(self, path: str, **params: Any) -> AsyncIterator[AsyncIterator[Frame]]:
        """Open a framed stream; yields an iterator of frames. The response is always
        closed on exit, so no half-open stream is left behind (F4)."""
        query = {k: v for k, v in params.items() if v is not None}
        request = self._http.build_request(
            "GET", path, params=query, timeout=httpx.Timeout(10.0, read=None)
        )
        try:
            response = await self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise DaemonUnavailable(f"cannot reach the daemon: {exc!r}", url=self.url) from exc
        try:
            if response.status_code != 200:
                await response.aread()
                _json_or_raise(response)
            yield _frames(response)
        finally:
            await response.aclose()


async def _frames(response: httpx.Response) -> AsyncIterator[Frame]:
    decoder = FrameDecoder()
    try:
        async for data in response.aiter_raw():
            for frame in decoder.feed(data):
                yield frame
    except httpx.TransportError as exc:
        raise DaemonUnavailable(f"stream broke: {exc!r}", url=str(response.url)) from exc
    if decoder.pending:
        raise MalformedFrame(f"stream ended inside a frame ({decoder.pending} bytes)")


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
