"""The slice of the Connect RPC protocol that envd speaks: the JSON codec over HTTP/1.1.

Unary calls are a JSON request body answered with a JSON body (``application/json``); an
error is a Connect error body ``{"code": ..., "message": ...}`` with the HTTP status of
its code. Streams (``application/connect+json``) are 5-byte envelopes (``>BI``: flags,
length) around JSON messages; flag ``0x02`` marks the end-of-stream message, ``{}`` or
``{"error": {...}}``. A streaming response is always HTTP 200: its error travels in the
end-of-stream message.

Written here rather than taken from ``connectrpc``'s server: that one needs generated
protobuf classes, which exist only inside the e2b SDK, and the daemon does not depend on
the SDK. This module is the whole protocol surface, so it stays small.
"""

from __future__ import annotations

import json
import struct
from typing import Any, TypeVar

import msgspec

from sandboxkit.errors import (
    ConsumerKicked,
    FileNotFound,
    InvalidArgument,
    OutputGap,
    PayloadTooLarge,
    ProcessNotFound,
    ResourceExhausted,
    ResultUnavailable,
    SandboxClosed,
    SandboxkitError,
    SandboxNotFound,
    SandboxPaused,
    StdinBusy,
    StdinSeqMismatch,
    StreamStalled,
    Unauthorized,
)

__all__ = [
    "END_STREAM",
    "STREAM_CONTENT_TYPE",
    "ConnectError",
    "EnvelopeReader",
    "decode",
    "end_stream",
    "envelope",
    "from_sandboxkit",
]

STREAM_CONTENT_TYPE = "application/connect+json"
END_STREAM = 0x02
_ENVELOPE = struct.Struct(">BI")
M = TypeVar("M")
MAX_MESSAGE = 4 * 1024 * 1024
"""Largest request message accepted (bytes): stdin data and process configs are small."""

_HTTP_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class ConnectError(Exception):
    """An RPC failure with its Connect code (one of the keys of ``_HTTP_STATUS``)."""

    def __init__(self, code: str, message: str) -> None:
        assert code in _HTTP_STATUS, code
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        """The HTTP status of a unary error response with this code."""
        return _HTTP_STATUS[self.code]

    def to_json(self) -> dict[str, str]:
        """The Connect error body."""
        return {"code": self.code, "message": self.message}


# How the SDK shows each code matters more than the code's name: ``resource_exhausted``
# reaches e2b users as RateLimitException ("try again later"), so it is used only where
# retrying later is the right advice (stdin backpressure), never for a kicked stream.
_CODES: list[tuple[type[SandboxkitError], str]] = [
    (SandboxNotFound, "not_found"),  # -> NotFoundException
    (ProcessNotFound, "not_found"),
    (ResultUnavailable, "not_found"),
    (FileNotFound, "not_found"),
    (InvalidArgument, "invalid_argument"),  # -> InvalidArgumentException
    (PayloadTooLarge, "invalid_argument"),
    (Unauthorized, "unauthenticated"),  # -> AuthenticationException
    (SandboxPaused, "failed_precondition"),  # -> SandboxException
    (SandboxClosed, "failed_precondition"),
    (StdinSeqMismatch, "failed_precondition"),
    (StdinBusy, "resource_exhausted"),  # -> RateLimitException: retry later, as it says
    (ResourceExhausted, "resource_exhausted"),  # out of descriptors: retry later too
    (ConsumerKicked, "aborted"),  # -> SandboxException: reconnect with connect(pid)
    (OutputGap, "data_loss"),
    (StreamStalled, "deadline_exceeded"),  # -> TimeoutException
]


def from_sandboxkit(exc: SandboxkitError) -> ConnectError:
    """The Connect error for a typed sandboxkit error (``internal`` if unmapped)."""
    message = f"{exc.code}: {exc}"
    if isinstance(exc, ConsumerKicked):
        message += " (the process runs on: reattach with commands.connect(pid))"
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return ConnectError(code, message)
    return ConnectError("internal", message)


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    """One enveloped JSON message."""
    body = json.dumps(message, separators=(",", ":")).encode()
    return _ENVELOPE.pack(flags, len(body)) + body


def end_stream(error: ConnectError | None = None) -> bytes:
    """The end-of-stream envelope: ``{}``, or ``{"error": ...}``."""
    return envelope({"error": error.to_json()} if error else {}, END_STREAM)


class EnvelopeReader:
    """Incremental envelope decoder for a request stream: feed bytes, get messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return every message they complete (end-of-stream ones dropped).
        Raises ConnectError (``invalid_argument``) on a compressed or oversized message."""
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= _ENVELOPE.size:
            flags, size = _ENVELOPE.unpack_from(self._buf)
            if flags & 0x01:
                raise ConnectError("invalid_argument", "compressed messages are not supported")
            if size > MAX_MESSAGE:
                raise ConnectError("invalid_argument", f"message of {size} bytes is too large")
            end = _ENVELOPE.size + size
            if len(self._buf) < end:
                break
            raw = bytes(self._buf[_ENVELOPE.size : end])
            del self._buf[:end]
            if not flags & END_STREAM:
                out.append(raw)
        return out

    @property
    def pending(self) -> int:
        """Bytes received that do not complete an envelope."""
        return len(self._buf)


def decode(raw: bytes, model: type[M]) -> M:
    """A request message as ``model`` (proto3 JSON: unknown fields ignored, numbers may
    come as strings, bytes as base64); else ConnectError ``invalid_argument``."""
    try:
        return msgspec.json.decode(raw or b"{}", type=model, strict=False)
    except msgspec.ValidationError as exc:
        raise ConnectError("invalid_argument", f"bad request message: {exc}") from None
    except msgspec.DecodeError:
        raise ConnectError("invalid_argument", "the request message is not JSON") from None
