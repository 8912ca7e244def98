"""The HTTP/1.1 the raw transports speak with a daemon on loopback (RFC 9112): a request
written in one piece, a response head parsed by a small strict parser, and the chunked
transfer coding decoded in place.

The daemon's responses are a status line, a few fields and a Content-Length or chunked
body; h11, the parser httpx uses, validates every field with regexes and runs a state
machine per event, about 0.2 ms per request and response (issue 11), most of a
``run(["true"])``'s client CPU. What is not one of those shapes is refused here
(:class:`BadResponse`, :class:`BadChunk`), and the transports turn that into
``DaemonUnavailable``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from sandboxkit.errors import InvalidArgument

__all__ = [
    "BadChunk",
    "BadResponse",
    "ChunkedBody",
    "Head",
    "HeadReader",
    "encode_query",
    "encode_request",
    "request_fields",
]

MAX_HEAD = 64 * 1024
"""The largest response head accepted (the daemon's are ~150 bytes)."""
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-5][0-9][0-9])(?: [^\r\n]*)?\r\n")
_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([^\r\n]*?)[ \t]*\r\n")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_LINE = 4096
"""The longest chunk-size or trailer line accepted (the daemon's are a few bytes)."""
_HEX = frozenset(b"0123456789abcdefABCDEF")
_SIZE_LINE = re.compile(rb"([0-9a-fA-F]{1,16})(?:[ \t]*;[^\r\n]*)?\r\n")
"""A whole chunk-size line; anything else goes the long way (and may be refused there)."""
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_UNSAFE_FIELD = re.compile(r"[^\t\x20-\x7e]")
"""What a field may not hold: a line break (it would end the field), NUL, non-ASCII."""
_UNSAFE_TARGET = re.compile(r"[^\x21-\x7e]")
_TARGET_SAFE = "/?&=%:@!$'()*+,;"
"""Kept as they are when a target is percent-encoded (with letters, digits and ``_.-~``)."""


# -- the request ---------------------------------------------------------------------


def request_fields(host: str, headers: Mapping[str, str]) -> bytes:
    """The ``Host`` field and ``headers``, as written after a request line. A name or
    value that would break the request's framing (a line break: a token pasted with its
    newline) or is not ASCII is refused, before anything is sent."""
    fields = {"Host": host, **headers}
    for name, value in fields.items():
        if _UNSAFE_FIELD.search(name) or _UNSAFE_FIELD.search(value):
            raise InvalidArgument(
                f"the {name} header would hold a line break, a control character or "
                "non-ASCII text (a token or URL pasted with a newline?)",
                field=name,
            )
    return "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode("ascii")


def encode_request(method: str, target: str, fields: bytes, body: bytes | None) -> bytes:
    """One request, head and JSON body, as the bytes written (``fields`` from
    :func:`request_fields`). A ``target`` with spaces, controls or non-ASCII text (a
    sandbox id as typed) is percent-encoded, as httpx would send it."""
    if _UNSAFE_TARGET.search(target):
        target = quote(target, safe=_TARGET_SAFE)
    head = f"{method} {target} HTTP/1.1\r\n".encode("ascii") + fields
    if body is not None:
        return (
            head
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
    if method in _WITH_BODY:
        return head + b"Content-Length: 0\r\n\r\n"
    return head + b"\r\n"


def encode_query(params: Mapping[str, Any]) -> str:
    """``params`` as a query string, values as httpx writes them (``true``/``false``)."""
    parts = []
    for key, value in params.items():
        if value is True or value is False:
            value = "true" if value else "false"
        parts.append(f"{quote(str(key), safe='')}={quote(str(value), safe='')}")
    return "&".join(parts)


# -- the response head ---------------------------------------------------------------


class BadResponse(Exception):
    """The bytes received are not an HTTP/1.1 response this client accepts."""


@dataclass(frozen=True)
class Head:
    """A parsed response head."""

    status: int
    size: int  # of the head, in bytes
    length: int | None  # Content-Length; None: chunked, or (if not chunked) until close
    chunked: bool
    keep_alive: bool


def parse_head(data: bytes | bytearray, end: int) -> Head:
    """Parse the response head in ``data[:end]`` (``end`` is just past its blank line).
    Strict: one status line, ``name: value`` fields (no folding, no bare LF), at most
    one framing (a valid Content-Length, or ``Transfer-Encoding: chunked``)."""
    match = _STATUS_LINE.match(data, 0, end)
    if match is None:
        raise BadResponse(f"bad status line {bytes(data[:40])!r}")
    minor, status = match[1], int(match[2])
    pos = match.end()
    length: int | None = None
    chunked = False
    close = minor == b"0"
    while pos < end - 2:
        field = _FIELD.match(data, pos, end)
        if field is None:
            raise BadResponse(f"bad header line {bytes(data[pos : pos + 40])!r}")
        pos = field.end()
        name = field[1].lower()
        if name == b"content-length":
            value = field[2]
            if _DIGITS.fullmatch(value) is None or (length is not None and length != int(value)):
                raise BadResponse(f"bad Content-Length {bytes(value[:40])!r}")
            length = int(value)
        elif name == b"transfer-encoding":
            if field[2].lower() != b"chunked" or chunked:
                raise BadResponse(f"unsupported Transfer-Encoding {bytes(field[2][:40])!r}")
            chunked = True
        elif name == b"connection":
            tokens = {t.strip().lower() for t in field[2].split(b",")}
            close = b"close" in tokens or (close and b"keep-alive" not in tokens)
    if pos != end - 2 or data[pos:end] != b"\r\n":
        raise BadResponse("bad end of head")
    if chunked and length is not None:
        raise BadResponse("both Content-Length and Transfer-Encoding")
    if status in (204, 304):
        length, chunked = 0, False
    keep_alive = not close and (chunked or length is not None)
    return Head(status, end, length, chunked, keep_alive)


class HeadReader:
    """A response head read from bytes as they arrive; interim (1xx) heads are skipped."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._scanned = 0  # bytes of _buffer searched for the end of the head

    @property
    def started(self) -> bool:
        """True once any byte of a response arrived."""
        return bool(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> tuple[Head, bytes] | None:
        """The head and the bytes after it once ``data`` completed it, else ``None``."""
        buffer = self._buffer
        buffer += data
        while True:
            end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))
            if end < 0:
                self._scanned = len(buffer)
                if len(buffer) > MAX_HEAD:
                    raise BadResponse("response head too long")
                return None
            head = parse_head(buffer, end + 4)
            if 100 <= head.status < 200:
                if head.status == 101:
                    raise BadResponse("unexpected 101 Switching Protocols")
                del buffer[: head.size]  # an interim response: the real one follows
                self._scanned = 0
                continue
            rest = bytes(buffer[head.size :])
            buffer.clear()
            self._scanned = 0
            return head, rest


# -- the chunked transfer coding -------------------------------------------------------


class BadChunk(Exception):
    """The body's chunked framing is broken."""


class ChunkedBody:
    """The HTTP/1.1 chunked transfer coding (RFC 9112, section 7.1), decoded incrementally:
    :meth:`feed` hands each piece of chunk data to ``out`` as a view into the bytes fed
    (nothing copied) and raises :class:`BadChunk` on bytes that break the framing.
    Chunk extensions and trailer fields are skipped."""

    def __init__(self) -> None:
        self._line = bytearray()  # a size or trailer line begun in earlier bytes
        self._left = 0  # bytes of the current chunk's data still to come
        self._crlf = 0  # bytes of the CRLF after chunk data still to come
        self._trailers = False  # after the last chunk: trailer lines, then an empty one
        self.done = False
        """True once the last chunk and the trailer section were read."""

    def feed(self, data: bytes | bytearray, out: Any, end: int | None = None) -> None:
        """Decode ``data`` (up to ``end``); call ``out(view)`` for each piece of chunk
        data in it."""
        with memoryview(data) as view:
            self.feed_at(data, 0, len(data) if end is None else end, lambda a, b: out(view[a:b]))

    def feed_at(self, data: bytes | bytearray, pos: int, end: int, out: Any) -> None:
        """Decode ``data[pos:end]``; call ``out(start, stop)`` with the offsets in
        ``data`` of each piece of chunk data in it (for a reader that keeps the data
        where it was received)."""
        while pos < end:
            if self.done:
                raise BadChunk("bytes after the end of the body")
            if self._left:
                take = min(self._left, end - pos)
                out(pos, pos + take)
                pos += take
                self._left -= take
                if self._left:
                    continue
                if data[pos : pos + 2] == b"\r\n":  # the usual case: the CRLF is here
                    pos += 2
                else:
                    self._crlf = 2
                continue
            if self._crlf:
                if data[pos] != (13 if self._crlf == 2 else 10):
                    raise BadChunk("chunk data not followed by CRLF")
                pos += 1
                self._crlf -= 1
                continue
            if not self._line and not self._trailers:
                # The usual case, in one step: a whole size line (and its extensions).
                match = _SIZE_LINE.match(data, pos, end)
                if match is not None:
                    self._left = int(match[1], 16)
                    self._trailers = not self._left
                    pos = match.end()
                    continue
            newline = data.find(b"\n", pos, end)
            if newline < 0:
                self._line += data[pos:end]
                if len(self._line) > _LINE:
                    raise BadChunk("chunk line too long")
                return
            if self._line:
                self._line += data[pos:newline]
                line = bytes(self._line)
                self._line.clear()
            else:
                line = bytes(data[pos:newline])
            pos = newline + 1
            self._line_done(line)

    def _line_done(self, line: bytes) -> None:
        if len(line) > _LINE or not line.endswith(b"\r"):
            raise BadChunk(f"bad chunk line {line[:40]!r}")
        line = line[:-1]
        if self._trailers:
            if not line:
                self.done = True
            return  # a trailer field: not used
        size = line.split(b";", 1)[0].strip(b" \t")
        if not size or len(size) > 16 or not _HEX.issuperset(size):
            raise BadChunk(f"bad chunk size {line[:40]!r}")
        self._left = int(size, 16)
        if not self._left:
            self._trailers = True
