"""The frame codec: any frames survive any split of the byte stream; bad bytes are refused
for good; error frames carry typed errors."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxkit.errors import ERROR_TABLE, MalformedFrame, SandboxkitError
from sandboxkit.wire import MAX_META, MAX_PAYLOAD, Frame, FrameDecoder, FrameKind, encode_frame

_HEADER = struct.Struct("!BII")  # the layout the module docstring documents

_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
_json_value = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_meta = st.dictionaries(st.text(max_size=8), _json_value, max_size=5)
_frame = st.builds(
    Frame,
    kind=st.sampled_from(list(FrameKind)),
    meta=_meta,
    payload=st.binary(max_size=300),
)


def _raw(kind: int, meta: bytes, payload: bytes = b"") -> bytes:
    return _HEADER.pack(kind, len(meta), len(payload)) + meta + payload


# -- round trip under arbitrary splits -----------------------------------------------------


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(frames=st.lists(_frame, max_size=12), data=st.data())
def test_frames_survive_any_split(frames: list[Frame], data: st.DataObject) -> None:
    encoded = [encode_frame(f.kind, f.meta, f.payload) for f in frames]
    stream = b"".join(encoded)
    ends = []
    total = 0
    for blob in encoded:
        total += len(blob)
        ends.append(total)
    cuts = sorted(
        data.draw(st.lists(st.integers(0, len(stream)), max_size=20), label="split points")
    )
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]

    decoder = FrameDecoder()
    decoded: list[Frame] = []
    fed = 0
    for piece in pieces:  # empty pieces included: they must be harmless
        decoded.extend(decoder.feed(piece))
        fed += len(piece)
        # Every frame comes out as soon as its last byte is in, and not before.
        complete = [e for e in ends if e <= fed]
        assert len(decoded) == len(complete)
        assert decoder.pending == fed - (complete[-1] if complete else 0)
    assert decoded == frames
    assert [type(f.kind) for f in decoded] == [FrameKind] * len(frames)
    assert decoder.pending == 0


@settings(max_examples=50, deadline=None)
@given(frames=st.lists(_frame, min_size=1, max_size=4))
def test_frames_survive_byte_by_byte(frames: list[Frame]) -> None:
    stream = b"".join(encode_frame(f.kind, f.meta, f.payload) for f in frames)
    decoder = FrameDecoder()
    decoded = [frame for i in range(len(stream)) for frame in decoder.feed(stream[i : i + 1])]
    assert decoded == frames


def test_layout_matches_the_documented_header() -> None:
    blob = encode_frame(FrameKind.DATA, {"seq": 3}, b"\x00\xffbin")
    kind, meta_len, payload_len = _HEADER.unpack_from(blob)
    assert kind == FrameKind.DATA
    assert json.loads(blob[_HEADER.size : _HEADER.size + meta_len]) == {"seq": 3}
    assert blob[_HEADER.size + meta_len :] == b"\x00\xffbin"
    assert payload_len == len(b"\x00\xffbin")
    # An empty meta section (length 0) is the empty object.
    assert FrameDecoder().feed(_raw(FrameKind.END, b"")) == [Frame(FrameKind.END, {}, b"")]


def test_size_limits_are_inclusive() -> None:
    skeleton = len(json.dumps({"x": ""}, separators=(",", ":")))
    meta = {"x": "a" * (MAX_META - skeleton)}
    blob = encode_frame(FrameKind.KEEPALIVE, meta)
    assert len(blob) == _HEADER.size + MAX_META
    assert FrameDecoder().feed(blob) == [Frame(FrameKind.KEEPALIVE, meta)]
    with pytest.raises(ValueError):
        encode_frame(FrameKind.KEEPALIVE, {"x": "a" * (MAX_META - skeleton + 1)})
    with pytest.raises(ValueError):
        encode_frame(FrameKind.DATA, {}, bytes(MAX_PAYLOAD + 1))
    # A header announcing exactly the maximum payload is accepted (it waits for the bytes).
    decoder = FrameDecoder()
    assert decoder.feed(_HEADER.pack(FrameKind.DATA, 2, MAX_PAYLOAD) + b"{}") == []
    assert decoder.pending == _HEADER.size + 2


# -- malformed input -----------------------------------------------------------------------

_VALID = encode_frame(FrameKind.DATA, {"seq": 0}, b"ok")

MALFORMED = {
    "kind-zero": _HEADER.pack(0, 2, 0) + b"{}",
    "kind-unknown": _HEADER.pack(max(FrameKind) + 1, 2, 0) + b"{}",
    "kind-255": _HEADER.pack(255, 0, 0),
    "meta-too-long": _HEADER.pack(FrameKind.DATA, MAX_META + 1, 0),
    "payload-too-long": _HEADER.pack(FrameKind.DATA, 2, MAX_PAYLOAD + 1),
    "lengths-max-u32": _HEADER.pack(FrameKind.DATA, 2**32 - 1, 2**32 - 1),
    "meta-not-json": _raw(FrameKind.DATA, b"{seq: 1}"),
    "meta-truncated-json": _raw(FrameKind.DATA, b'{"seq": '),
    "meta-not-utf8": _raw(FrameKind.DATA, b'{"s": "\xff"}'),
    "meta-array": _raw(FrameKind.DATA, b"[1, 2]"),
    "meta-string": _raw(FrameKind.DATA, b'"seq"'),
    "meta-number": _raw(FrameKind.DATA, b"7"),
    "meta-null": _raw(FrameKind.DATA, b"null"),
}


@pytest.mark.parametrize("bad", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_frame_breaks_the_decoder_for_good(bad: bytes) -> None:
    decoder = FrameDecoder()
    assert decoder.feed(_VALID) == [Frame(FrameKind.DATA, {"seq": 0}, b"ok")]
    with pytest.raises(MalformedFrame) as raised:
        decoder.feed(bad)
    assert isinstance(raised.value, SandboxkitError)
    assert raised.value.status == 400
    # The stream position is lost: even perfectly valid bytes are refused from now on,
    # and refused means not taken in either.
    pending = decoder.pending
    for later in (_VALID, b"", _VALID[:3], _VALID * 3):
        with pytest.raises(MalformedFrame):
            decoder.feed(later)
        assert decoder.pending == pending


@pytest.mark.parametrize(
    "bad",
    [MALFORMED[k] for k in ("kind-zero", "kind-unknown", "meta-too-long", "payload-too-long")],
    ids=["kind-zero", "kind-unknown", "meta-too-long", "payload-too-long"],
)
def test_bad_header_is_refused_before_its_body_arrives(bad: bytes) -> None:
    # A header alone is enough to know: the decoder must not wait for (or buffer) 4 GiB.
    decoder = FrameDecoder()
    with pytest.raises(MalformedFrame):
        decoder.feed(bad[: _HEADER.size])


@settings(max_examples=100, deadline=None)
@given(
    before=st.lists(_frame, max_size=3),
    bad=st.sampled_from(sorted(MALFORMED)),
    split=st.integers(0, 2**16),
)
def test_malformed_frame_after_valid_frames_any_split(
    before: list[Frame], bad: str, split: int
) -> None:
    good = b"".join(encode_frame(f.kind, f.meta, f.payload) for f in before)
    stream = good + MALFORMED[bad]
    cut = min(split, len(stream))
    decoder = FrameDecoder()
    decoded: list[Frame] = []
    with pytest.raises(MalformedFrame):
        decoded.extend(decoder.feed(stream[:cut]))
        decoded.extend(decoder.feed(stream[cut:]))
    # Whatever came out before the failure is a prefix of the valid frames.
    assert decoded == before[: len(decoded)]
    with pytest.raises(MalformedFrame):
        decoder.feed(_VALID)


# -- error frames ----------------------------------------------------------------------------

_json_scalar = st.none() | st.integers(-(2**31), 2**31) | st.text(max_size=10) | st.floats(0, 1e6)


@pytest.mark.parametrize("cls", list(ERROR_TABLE.values()), ids=list(ERROR_TABLE))
@settings(max_examples=25, deadline=None)
@given(data=st.data(), message=st.text(min_size=1, max_size=30))
def test_error_frame_carries_the_typed_error(
    cls: type[SandboxkitError], data: st.DataObject, message: str
) -> None:
    values: dict[str, Any] = data.draw(
        st.fixed_dictionaries(
            {name: st.none() if name == "result" else _json_scalar for name in cls.fields}
        )
    )
    original = cls(message, **values)
    blob = encode_frame(FrameKind.ERROR, original.to_wire())
    (frame,) = FrameDecoder().feed(blob)
    assert frame.kind is FrameKind.ERROR
    error = frame.error()
    assert type(error) is cls
    assert error.message == message
    assert error.details == values


def test_error_frame_with_unknown_code_is_a_base_error() -> None:
    frame = Frame(FrameKind.ERROR, {"code": "from_the_future", "message": "m"})
    error = frame.error()
    assert type(error) is SandboxkitError
    assert error.message == "m"


# -- any input: only MalformedFrame, and broken for good afterwards --------------------------


def _nested(depth: int) -> bytes:
    return b'{"a":' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [1_000, 30_000])
def test_deeply_nested_metadata_is_malformed_not_a_recursion_error(depth: int) -> None:
    meta = _nested(depth)
    assert len(meta) <= MAX_META
    decoder = FrameDecoder()
    with pytest.raises(MalformedFrame):
        decoder.feed(_raw(FrameKind.DATA, meta))
    with pytest.raises(MalformedFrame):
        decoder.feed(_VALID)


def test_non_finite_numbers_in_metadata_are_malformed() -> None:
    # Python's json takes NaN and Infinity; they are not JSON and no frame carries them.
    for meta in (b'{"ts": NaN}', b'{"ts": Infinity}', b'{"ts": -Infinity}'):
        with pytest.raises(MalformedFrame):
            FrameDecoder().feed(_raw(FrameKind.DATA, meta))


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(
        st.binary(max_size=64)
        | st.builds(
            lambda kind, meta, tail: _HEADER.pack(kind, len(meta), len(tail)) + meta + tail,
            st.integers(0, 7) | st.integers(0, 255),
            st.binary(max_size=40)
            | st.sampled_from([b"{}", b"[]", b"null", _nested(5_000), b'{"a": NaN}']),
            st.binary(max_size=20),
        ),
        max_size=8,
    )
)
def test_arbitrary_bytes_raise_only_malformed_frame(chunks: list[bytes]) -> None:
    decoder = FrameDecoder()
    failed = False
    for chunk in chunks:
        try:
            frames = decoder.feed(chunk)
        except MalformedFrame:
            failed = True
            break
        assert all(isinstance(f.meta, dict) and type(f.kind) is FrameKind for f in frames)
    if failed:
        with pytest.raises(MalformedFrame):
            decoder.feed(_VALID)
