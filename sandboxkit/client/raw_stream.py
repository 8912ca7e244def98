"""A process stream read straight off its socket: large reads parsed by h11, the HTTP/1.1
parser httpx itself uses, without httpx's per-chunk layers (httpcore, anyio).

A stream is one long response read at full rate, where every layer's cost per chunk
counts (issue 11: the SDK consumer's CPU per GB against a bare httpx reader). Used for
plain-HTTP daemons when no custom httpx transport was given; everything else goes
through httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode, urlsplit

import h11

from sandboxkit._compat import within
from sandboxkit.errors import DaemonUnavailable, SandboxkitError, error_from_wire

__all__ = ["RawStream", "open_raw_stream"]

_READ = 256 * 1024
"""Bytes asked of the socket per read (the daemon sends up to 256 KiB at a time)."""
_BUFFER = 64 * 1024
"""The reader stops taking from the socket at twice this much unread: a reader that falls
behind must show as behind at the daemon (its lag, its gaps), not fill client memory."""
_OPEN_TIMEOUT = 10.0
_ERROR_BODY = 1024 * 1024


class RawStream:
    """An open stream's body: :meth:`chunks` yields the bytes of each read."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: h11.Connection
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._conn = conn

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, as it arrives: all the body bytes of each read, joined."""
        conn, reader = self._conn, self._reader
        pieces: list[bytes] = []
        while True:
            try:
                event = conn.next_event()
            except h11.ProtocolError as exc:
                raise DaemonUnavailable(f"stream broke: {exc!r}"[:300]) from exc
            if type(event) is h11.Data:
                pieces.append(bytes(event.data))
                continue
            if pieces:
                yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
                pieces = []
            if event is h11.NEED_DATA:
                conn.receive_data(await _read(reader))
            elif type(event) is h11.EndOfMessage:
                return
            else:
                raise DaemonUnavailable(f"stream broke: unexpected {event!r}"[:300])

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
        """Drop the connection (a stream's connection is never reused)."""
        self._writer.close()


async def _read(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read(_READ)
    except OSError as exc:
        raise DaemonUnavailable(f"stream broke: {exc!r}") from exc


@contextlib.asynccontextmanager
async def open_raw_stream(
    url: str, path: str, query: dict[str, Any], headers: dict[str, str]
) -> AsyncIterator[RawStream]:
    """GET ``path`` on the plain-HTTP daemon at ``url``; yields the open stream once its
    status is 200, raises the daemon's typed error otherwise, and always closes the
    connection on exit."""
    parts = urlsplit(url)
    host = (parts.hostname or "127.0.0.1").strip("[]")
    port = parts.port or 80
    target = parts.path.rstrip("/") + path
    if query:
        target += "?" + urlencode(query)
    try:
        # within(), not asyncio.wait_for: before 3.12 wait_for swallows a cancellation
        # that arrives as the connection opens, and a disconnect() would wait forever.
        reader, writer = await within(
            asyncio.open_connection(host, port, limit=_BUFFER), _OPEN_TIMEOUT
        )
    except (OSError, TimeoutError) as exc:
        raise DaemonUnavailable(f"cannot reach the daemon: {exc!r}", url=url) from exc
    conn = h11.Connection(h11.CLIENT)
    stream = RawStream(reader, writer, conn)
    try:
        request = h11.Request(
            method="GET",
            target=target,
            headers=[("Host", parts.netloc), *headers.items()],
        )
        writer.write(conn.send(request) + conn.send(h11.EndOfMessage()))
        try:
            response = await within(_head(conn, reader), _OPEN_TIMEOUT)
        except (h11.ProtocolError, TimeoutError) as exc:
            raise DaemonUnavailable(f"stream broke: {exc!r}"[:300], url=url) from exc
        if response.status_code != 200:
            body = await stream.body()
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            error: SandboxkitError = error_from_wire(parsed, response.status_code)
            raise error
        yield stream
    except h11.ProtocolError as exc:
        raise DaemonUnavailable(f"stream broke: {exc!r}"[:300], url=url) from exc
    finally:
        stream.close()


async def _head(conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Response:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await _read(reader))
        elif type(event) is h11.Response:
            return event
        elif type(event) is not h11.InformationalResponse:
            raise DaemonUnavailable(f"stream broke: unexpected {event!r}"[:300])
