"""The SDK's frame handling refuses any frame it cannot use with MalformedFrame — never a
KeyError, ValueError or TypeError from deep inside — and is left consistent."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxkit.client.stream import GapInfo, ProcessStream
from sandboxkit.errors import MalformedFrame, SandboxkitError
from sandboxkit.wire import MAX_META, Frame, FrameDecoder, FrameKind, encode_frame

# The fields the frames carry, so that most examples hit a real field with a wrong value.
FIELDS = [
    "seq",
    "stream",
    "cursor",
    "first_available",
    "bytes_lost",
    "exit_code",
    "keepalive_interval",
    "process_state",
    "sandbox_state",
    "code",
    "message",
    "details",
]
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
METAS = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), JSON, max_size=6)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _stream() -> ProcessStream:
    gaps: list[GapInfo] = []
    return ProcessStream(
        None,  # type: ignore[arg-type]  # the handler never calls the daemon
        "sbx",
        1,
        cursor=0,
        on_stdout=lambda text: None,
        on_gap=gaps.append,
        lines=True,
    )


def _handle_all(loop: asyncio.AbstractEventLoop, frames: list[Frame]) -> None:
    stream = _stream()

    async def handle() -> None:
        for frame in frames:
            if await stream._handle(frame):
                return

    try:
        loop.run_until_complete(handle())
    except MalformedFrame:
        pass
    except SandboxkitError:
        # An error frame carries a typed error: the only other thing a frame may raise.
        assert any(f.kind is FrameKind.ERROR for f in frames)
    assert stream.cursor is None or int(stream.cursor) >= 0


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(FrameKind), meta=METAS, payload=st.binary(max_size=16))
def test_any_frame_fields(
    loop: asyncio.AbstractEventLoop, kind: FrameKind, meta: dict[str, Any], payload: bytes
) -> None:
    _handle_all(loop, [Frame(kind, meta, payload)])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(
        st.tuples(st.integers(0, 8), METAS, st.binary(max_size=8)) | st.binary(max_size=24),
        max_size=5,
    )
)
def test_any_bytes(loop: asyncio.AbstractEventLoop, parts: list[Any]) -> None:
    """Frames as bytes, well-formed or not, through the decoder and the handler."""
    raw = b""
    for part in parts:
        if isinstance(part, bytes):
            raw += part
            continue
        kind, meta, payload = part
        body = json.dumps(meta).encode()[:MAX_META]
        raw += struct.pack("!BII", kind, len(body), len(payload)) + body + payload
    try:
        frames = FrameDecoder().feed(raw)
    except MalformedFrame:
        return
    _handle_all(loop, frames)


def test_valid_frames_still_work(loop: asyncio.AbstractEventLoop) -> None:
    stream = _stream()
    frames = FrameDecoder().feed(
        encode_frame(FrameKind.START, {"cursor": 0, "keepalive_interval": 0.5})
        + encode_frame(FrameKind.DATA, {"seq": 0, "stream": "stdout", "offset": 0}, b"hi\n")
        + encode_frame(FrameKind.GAP, {"cursor": 1, "first_available": 3, "bytes_lost": 9})
        + encode_frame(FrameKind.KEEPALIVE, {"process_state": "running"})
        + encode_frame(FrameKind.END, {"exit_code": 0, "cursor": 4})
    )
    for frame in frames:
        loop.run_until_complete(stream._handle(frame))
    assert stream.ended and stream.exit_code == 0 and stream.cursor == 4
    assert stream.stdout == "hi\n" and stream.process_state == "exited"
    assert stream.gaps == [GapInfo(1, 3, 9)]
