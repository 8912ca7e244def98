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
import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sandboxkit.errors import MalformedFrame, SandboxkitError, error_from_wire

__all__ = [
    "CONTENT_TYPE",
    "HEADER_SIZE",
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
HEADER_SIZE = _HEADER.size
"""Bytes of a frame's fixed header (kind, meta length, payload length)."""


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
    """One decoded frame: its kind, its metadata and (for ``data``) its payload.

    The payload is ``bytes``, except from :meth:`FrameDecoder.cut` with ``borrow``: a
    view into the reader's buffer, valid only until the reader reuses it."""

    kind: FrameKind
    meta: dict[str, Any] = field(default_factory=dict)
    payload: bytes | memoryview = b""

    def error(self) -> SandboxkitError:
        """The typed error an ``error`` frame carries."""
        return error_from_wire(self.meta)


_encode_meta = msgspec.json.Encoder().encode
"""Compact JSON, as UTF-8: a tenth of the json module's time for a data frame's metadata
(0.3 against 3.4 us), which the daemon encodes once per chunk of output. A float that is not
a number is written ``null`` (the json module's ``allow_nan=False`` raised): a frame carries
only what any JSON parser (and the decoder) takes."""


def encode_frame(
    kind: FrameKind, meta: dict[str, Any] | None = None, payload: bytes = b""
) -> bytes:
    """Encode one frame to bytes."""
    return encode_frame_head(kind, meta, len(payload)) + payload


def encode_frame_head(kind: FrameKind, meta: dict[str, Any] | None, payload_size: int) -> bytes:
    """The bytes of a frame before its payload (header and metadata): a frame is this
    followed by the ``payload_size`` payload bytes, so a sender can write the payload
    without copying it into one buffer with the head."""
    meta_bytes = _encode_meta(meta or {})
    if len(meta_bytes) > MAX_META or payload_size > MAX_PAYLOAD:
        raise ValueError("frame too large")
    return _HEADER.pack(kind, len(meta_bytes), payload_size) + meta_bytes


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, get whole frames back.

    Raises :class:`~sandboxkit.errors.MalformedFrame` on bytes that cannot be a frame; the
    decoder is then unusable (the stream position is lost).

    Frames are cut straight out of the bytes fed (one copy: the payload's own); only the
    unfinished frame at the end of a feed is kept, and the next feed completes it with just
    the bytes it lacks before going on in its own bytes (a stream read at full rate would
    otherwise copy every byte into a buffer and out again, issue 11).

    A reader that receives into a buffer of its own can keep the unfinished frame there
    instead and decode in place (:meth:`cut`, :meth:`frame_size`): the same frames and the
    same checks, and no byte of the stream copied but the payloads (issue 22).
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._broken = False

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Add bytes; return every frame they complete, in order."""
        if self._broken:
            raise MalformedFrame("decoder already failed on earlier bytes")
        frames: list[Frame] = []
        with memoryview(data) as view:
            start = self._finish_pending(view, frames) if self._buf else 0
            if start < 0:  # still inside the pending frame
                return frames
            try:
                pos = self._cut(view, start, frames)
            except MalformedFrame:
                self._buf += view[start:]
                raise
            if pos < len(view):
                self._buf += view[pos:]
        return frames

    def _finish_pending(self, view: memoryview, frames: list[Frame]) -> int:
        """Complete the frame begun in earlier bytes from the start of ``view``: where
        ``view``'s own frames begin, or -1 if it did not complete it (all taken in)."""
        buf = self._buf
        taken = 0
        if len(buf) < _HEADER.size:
            taken = _HEADER.size - len(buf)
            buf += view[:taken]
            if len(buf) < _HEADER.size:
                return -1
        try:
            size = self.frame_size(buf, 0)
        except MalformedFrame:
            buf += view[taken:]
            raise
        more = size - len(buf)
        buf += view[taken : taken + more]
        if len(buf) < size:
            return -1
        with memoryview(buf) as whole:
            try:
                self._cut(whole, 0, frames)
            except MalformedFrame:
                whole.release()
                buf += view[taken + more :]
                raise
        buf.clear()
        return taken + more

    def frame_size(self, buf: bytes | bytearray | memoryview, pos: int) -> int:
        """The whole size of the frame whose header is at ``pos``; MalformedFrame (and
        the decoder broken) if that header cannot be a frame's."""
        kind: int
        meta_len: int
        payload_len: int
        kind, meta_len, payload_len = _HEADER.unpack_from(buf, pos)
        if kind not in _KINDS or meta_len > MAX_META or payload_len > MAX_PAYLOAD:
            self._broken = True
            raise MalformedFrame(
                f"bad frame header: kind={kind} meta={meta_len} payload={payload_len}"
            )
        return _HEADER.size + meta_len + payload_len

    def cut(self, view: memoryview, pos: int, frames: list[Frame], borrow: bool = False) -> int:
        """Decode in place: append the whole frames of ``view`` from ``pos`` to
        ``frames`` and return where the first unfinished one begins (its bytes stay the
        caller's, to complete and cut again). With ``borrow`` the payloads are views
        into ``view``, not copies: the caller keeps those bytes until the frames are
        done with. Not to be mixed with :meth:`feed`."""
        if self._broken:
            raise MalformedFrame("decoder already failed on earlier bytes")
        return self._cut(view, pos, frames, borrow)

    def _cut(self, view: memoryview, pos: int, frames: list[Frame], borrow: bool = False) -> int:
        """Append the whole frames of ``view`` from ``pos``; where the first unfinished
        one begins."""
        end = len(view)
        head = _HEADER.size
        while end - pos >= head:
            kind, meta_len, payload_len = _HEADER.unpack_from(view, pos)
            if kind not in _KINDS or meta_len > MAX_META or payload_len > MAX_PAYLOAD:
                self.frame_size(view, pos)  # raises, with the reason
            meta_start = pos + head
            payload_start = meta_start + meta_len
            frame_end = payload_start + payload_len
            if frame_end > end:
                break
            if meta_len:
                try:
                    meta = _decode_meta(view[meta_start:payload_start])
                except (msgspec.MsgspecError, RecursionError) as exc:
                    # Not JSON, not UTF-8, NaN/Infinity, not an object, or nested past
                    # the parser's depth.
                    self._broken = True
                    raise MalformedFrame(
                        f"frame metadata is not a JSON object: {exc!r}"[:300]
                    ) from None
            else:
                meta = {}
            payload = view[payload_start:frame_end]
            frames.append(Frame(_KIND_OF[kind], meta, payload if borrow else bytes(payload)))
            pos = frame_end
        return pos

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buf)


_KINDS = frozenset(int(k) for k in FrameKind)
_KIND_OF = {int(k): k for k in FrameKind}

# msgspec's JSON is strict JSON (no NaN or Infinity, no lone surrogates) and several
# times faster than the json module; ``dict`` refuses metadata that is not an object.
_decode_meta = msgspec.json.Decoder(dict[str, Any]).decode
