"""How the client talks HTTP to a daemon: one :class:`Transport` protocol, two
implementations — raw sockets for a plain-HTTP daemon on loopback (the fast path),
httpx for everything else — and :func:`make_transport`, which picks one for a URL.

| module | concept |
|---|---|
| `base.py` | the `Transport` protocol; `FrameStream`, the frames of one open stream |
| `raw.py` | `RawTransport`: the loopback fast path |
| `raw_unary.py` | JSON requests over kept-alive sockets of our own (`RawPool`) |
| `raw_stream.py` | a stream read off its socket, chunked body decoded into frames in place |
| `frame_buffer.py` | `FrameBuffer`: the receive buffer whose frames are cut where they lie |
| `via_httpx.py` | `HttpxTransport`: TLS, proxies, a caller's own httpx transport |
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from sandboxkit.client.transport.base import CALL_TIMEOUT, FrameStream, Transport
from sandboxkit.client.transport.raw import RawTransport
from sandboxkit.client.transport.via_httpx import LOOPBACK, HttpxTransport, http_options

__all__ = [
    "CALL_TIMEOUT",
    "FrameStream",
    "HttpxTransport",
    "RawTransport",
    "Transport",
    "http_options",
    "make_transport",
]

_LOOPBACK_HTTP = tuple(f"http://{host}" for host in LOOPBACK)


def make_transport(
    url: str, headers: Mapping[str, str], transport: httpx.AsyncBaseTransport | None = None
) -> Transport:
    """The transport for the daemon at ``url``: raw sockets for plain HTTP on loopback
    unless an httpx ``transport`` is given; httpx otherwise."""
    if transport is None and url.startswith(_LOOPBACK_HTTP):
        return RawTransport(url, headers)
    return HttpxTransport(url, headers, transport)
