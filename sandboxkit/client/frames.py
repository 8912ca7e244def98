"""What each kind of stream frame must carry, checked before the client acts on it.

A frame the client cannot use — a field missing, of the wrong type, out of range — is a
:class:`~sandboxkit.errors.MalformedFrame`, never a ``KeyError`` from deep inside the
stream; unknown fields are ignored (the daemon may add some).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from sandboxkit.errors import MalformedFrame
from sandboxkit.wire import FrameKind

__all__ = [
    "DataMeta",
    "EndMeta",
    "ErrorMeta",
    "GapMeta",
    "KeepaliveMeta",
    "StartMeta",
    "parse_meta",
]

Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
ExitCode = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31)]
Interval = Annotated[float, msgspec.Meta(gt=0, le=86400)]
State = str | None


class StartMeta(msgspec.Struct):
    """``start``: where the stream begins and how often keepalives come."""

    cursor: Seq
    keepalive_interval: Interval | None = None
    process_state: State = None
    sandbox_state: State = None
    state_seq: Seq | None = None
    """The sandbox's count of lifecycle transitions when the states were read."""
    requested_cursor: Seq | None = None
    """The cursor the client asked for; differs from ``cursor`` only under a fault-lab
    fan-out policy that cannot honour it (``blocking``/``kick``)."""
    fanout: str | None = None


class DataMeta(msgspec.Struct):
    """``data``: the chunk's sequence number and stream."""

    seq: Seq
    stream: str = "stdout"


class GapMeta(msgspec.Struct):
    """``gap``: output evicted between ``cursor`` and ``first_available``."""

    cursor: Seq
    first_available: Seq
    bytes_lost: Seq
    reason: Annotated[str, msgspec.Meta(max_length=64)] = "evicted"
    """``evicted`` (retention), or ``not_replayed`` (a lab policy ignored the cursor)."""


class KeepaliveMeta(msgspec.Struct):
    """``keepalive``: the states of the process and the sandbox."""

    process_state: State = None
    sandbox_state: State = None
    state_seq: Seq | None = None


class EndMeta(msgspec.Struct):
    """``end``: the exit code and the cursor after the last chunk."""

    exit_code: ExitCode | None = None
    cursor: Seq | None = None
    reason: str | None = None
    """Why it ended: ``exit``, or what ended it (``oom``, ``timeout``, ``user`` …)."""


class ErrorMeta(msgspec.Struct):
    """``error``: a typed error body (see :mod:`sandboxkit.errors`)."""

    code: str
    message: str = ""
    details: dict[str, Any] = msgspec.field(default_factory=dict)


_TYPES: dict[FrameKind, type[msgspec.Struct]] = {
    FrameKind.START: StartMeta,
    FrameKind.DATA: DataMeta,
    FrameKind.GAP: GapMeta,
    FrameKind.KEEPALIVE: KeepaliveMeta,
    FrameKind.END: EndMeta,
    FrameKind.ERROR: ErrorMeta,
}


def parse_meta(kind: FrameKind, meta: dict[str, Any]) -> Any:
    """The typed metadata of a frame of ``kind``; MalformedFrame if it cannot be."""
    try:
        return msgspec.convert(meta, _TYPES[kind], strict=True)
    except (msgspec.ValidationError, KeyError) as exc:
        raise MalformedFrame(f"bad {kind.name.lower()} frame: {exc}"[:300]) from None
