"""The stream frame codec shared by the daemon and the client.

A process stream is a sequence of binary frames::

    +------+-------------+----------------+-----------+-------------+
    | kind | meta length | payload length | meta JSON | payload     |
    | u8   | u32 BE      | u32 BE         | (object)  | (raw bytes) |
    +------+-------------+----------------+-----------+-------------+

``meta`` is a small JSON object; ``payload`` carries output bytes untouched, so streams are
binary-safe. Kinds: ``start``, ``data`` (seq, stream, offset, ts), ``gap`` (cursor,
first_available, bytes_lost), ``keepalive`` (process and sandbox state), ``end`` (exit code)
and ``error`` (a typed error body from :mod:`sandboxkit.errors`).
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from sandboxkit.errors import MalformedFrame, SandboxkitError, error_from_wire

__all__ = [
    "CONTENT_TYPE",
    "MAX_META",
    "MAX_PAYLOAD",
    "Frame",
    "FrameDecoder",
    "FrameKind",
    "encode_frame",
    "encode_frame_head",
]

CONTENT_TYPE = "application/x-sandboxkit-frames"
MAX_META = 64 * 1024
MAX_PAYLOAD = 16 * 1024 * 1024
_HEADER = struct.Struct("!BII")


class FrameKind(enum.IntEnum):
    """The kinds of frame a process stream carries."""

    START = 1
    DATA = 2
    GAP = 3
    KEEPALIVE = 4
    END = 5
    ERROR = 6


@dataclass(frozen=True)
class Frame:
    """One decoded frame: its kind, its metadata and (for ``data``) its payload."""

    kind: FrameKind
    meta: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""

    def error(self) -> SandboxkitError:
        """The typed error an ``error`` frame carries."""
        return error_from_wire(self.meta)


def encode_frame(
    kind: FrameKind, meta: dict[str, Any] | None = None, payload: bytes = b""
) -> bytes:
    """Encode one frame to bytes."""
    return encode_frame_head(kind, meta, len(payload)) + payload


def encode_frame_head(kind: FrameKind, meta: dict[str, Any] | None, payload_size: int) -> bytes:
    """The bytes of a frame before its payload (header and metadata): a frame is this
    followed by the ``payload_size`` payload bytes, so a sender can write the payload
    without copying it into one buffer with the head."""
    # allow_nan=False: a frame carries only what any JSON parser (and the decoder) takes.
    meta_bytes = json.dumps(meta or {}, separators=(",", ":"), allow_nan=False).encode()
    if len(meta_bytes) > MAX_META or payload_size > MAX_PAYLOAD:
        raise ValueError("frame too large")
    return _HEADER.pack(kind, len(meta_bytes), payload_size) + meta_bytes


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, get whole frames back.

    Raises :class:`~sandboxkit.errors.MalformedFrame` on bytes that cannot be a frame; the
    decoder is then unusable (the stream position is lost).
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._broken = False

    def feed(self, data: bytes) -> list[Frame]:
        """Add bytes; return every frame they complete, in order."""
        if self._broken:
            raise MalformedFrame("decoder already failed on earlier bytes")
        self._buf += data
        frames: list[Frame] = []
        pos = 0
        buf = self._buf
        while len(buf) - pos >= _HEADER.size:
            kind, meta_len, payload_len = _HEADER.unpack_from(buf, pos)
            if kind not in _KINDS or meta_len > MAX_META or payload_len > MAX_PAYLOAD:
                self._broken = True
                raise MalformedFrame(
                    f"bad frame header: kind={kind} meta={meta_len} payload={payload_len}"
                )
            end = pos + _HEADER.size + meta_len + payload_len
            if len(buf) < end:
                break
            meta_start = pos + _HEADER.size
            try:
                meta = _load_meta(bytes(buf[meta_start : meta_start + meta_len]) or b"{}")
            except (ValueError, RecursionError) as exc:
                # Not JSON, not UTF-8, NaN/Infinity, or nested past the parser's depth.
                self._broken = True
                raise MalformedFrame(f"frame metadata is not JSON: {exc!r}"[:300]) from None
            if not isinstance(meta, dict):
                self._broken = True
                raise MalformedFrame("frame metadata is not a JSON object")
            payload = bytes(buf[meta_start + meta_len : end])
            frames.append(Frame(FrameKind(kind), meta, payload))
            pos = end
        if pos:
            del buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buf)


_KINDS = frozenset(int(k) for k in FrameKind)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _load_meta(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_refuse_constant)
