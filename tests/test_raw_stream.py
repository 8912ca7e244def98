"""The stream reader below httpx: the chunked body is decoded exactly however the bytes are
split, and whatever a server sends, the client raises only its typed errors."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxkit.client.transport import raw_stream
from sandboxkit.client.transport.frame_buffer import READ_SIZE, FrameBuffer
from sandboxkit.client.transport.http11 import BadChunk, ChunkedBody
from sandboxkit.client.transport.raw import RawFrameStream
from sandboxkit.client.transport.raw_stream import open_raw_stream
from sandboxkit.errors import DaemonUnavailable, MalformedFrame, SandboxkitError
from sandboxkit.wire import Frame, FrameKind, encode_frame


def _chunked(parts: list[bytes], extensions: list[bytes], trailers: list[bytes]) -> bytes:
    out = b""
    for i, part in enumerate(parts):
        if part:
            ext = extensions[i % len(extensions)] if extensions else b""
            out += b"%x%s\r\n%s\r\n" % (len(part), ext, part)
    out += b"0\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"
    return out


def _splits(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def _decode(pieces: list[bytes]) -> tuple[bytes, ChunkedBody]:
    body = ChunkedBody()
    out: list[bytes] = []
    for piece in pieces:
        body.feed(piece, lambda view: out.append(bytes(view)))
    return b"".join(out), body


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.binary(max_size=300), max_size=8),
    extensions=st.lists(st.sampled_from([b"", b";a=1", b"; name", b' ;x="y"']), max_size=3),
    trailers=st.lists(st.sampled_from([b"X-A: 1", b"Trailer-B: two"]), max_size=2),
    cuts=st.lists(st.integers(0, 4000), max_size=12),
)
def test_chunked_body_survives_any_split(
    parts: list[bytes], extensions: list[bytes], trailers: list[bytes], cuts: list[int]
) -> None:
    encoded = _chunked(parts, extensions, trailers)
    got, body = _decode(_splits(encoded, cuts))
    assert got == b"".join(parts)
    assert body.done
    with pytest.raises(BadChunk):  # nothing may follow the end
        body.feed(b"x", lambda view: None)


def test_chunked_body_byte_by_byte_and_unfinished() -> None:
    encoded = _chunked([b"hello", b"\r\n\x00world"], [], [])
    got, body = _decode([encoded[i : i + 1] for i in range(len(encoded))])
    assert got == b"hello\r\n\x00world" and body.done
    got, body = _decode([encoded[:-1]])
    assert got == b"hello\r\n\x00world" and not body.done


@pytest.mark.parametrize(
    "bad",
    [
        b"zz\r\nab\r\n",  # not hex
        b"\r\nab\r\n",  # no size
        b"2\nab\r\n",  # LF without CR
        b"2\r\nabX\r\n",  # data not followed by CRLF
        b"2\r\nab\rX",
        b"1" * 17 + b"\r\n",  # a size past 64 bits
        b"-1\r\n",
        b"9" * 5000,  # a line without end
    ],
)
def test_broken_chunk_framing_is_refused(bad: bytes) -> None:
    with pytest.raises(BadChunk):
        ChunkedBody().feed(bad, lambda view: None)


@settings(max_examples=300, deadline=None)
@given(data=st.lists(st.binary(max_size=64), max_size=6))
def test_any_bytes_raise_only_bad_chunk(data: list[bytes]) -> None:
    body = ChunkedBody()
    with contextlib.suppress(BadChunk):
        for piece in data:
            body.feed(piece, lambda view: bytes(view))


# -- the whole reader against a server sending anything ----------------------------------

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-sandboxkit-frames\r\n"
_FRAMES = encode_frame(FrameKind.START, {"cursor": 0}) + encode_frame(
    FrameKind.DATA, {"seq": 0}, b"\xffdata\xe2\x82"
)


@contextlib.asynccontextmanager
async def _server(responses: list[bytes]) -> AsyncIterator[str]:
    """A loopback server answering each connection with the next bytes of ``responses``
    (sent in two writes, then closed)."""
    queue = list(responses)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        data = queue.pop(0)
        writer.write(data[: len(data) // 2])
        await writer.drain()
        writer.write(data[len(data) // 2 :])
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def _read(url: str) -> list[Frame]:
    """The frames of the stream, as the client reads them (``ApiClient.stream``)."""
    frames: list[Frame] = []
    async with open_raw_stream(url, "/stream", {}, {}) as stream:
        batches = RawFrameStream(stream)
        async for batch in batches.batches():
            frames += batch
    return frames


async def test_a_chunked_body_is_read_as_frames() -> None:
    body = _chunked([_FRAMES[:7], _FRAMES[7:30], _FRAMES[30:]], [b";x=1"], [b"T: 1"])
    response = _HEAD + b"transfer-encoding: chunked\r\n\r\n" + body
    async with _server([response, response]) as url:
        async with open_raw_stream(url, "/stream", {}, {}) as stream:
            assert stream.framed  # decoded below httpx and h11's body machinery
        frames = await _read(url)
    assert frames == [
        Frame(FrameKind.START, {"cursor": 0}),
        Frame(FrameKind.DATA, {"seq": 0}, b"\xffdata\xe2\x82"),
    ]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    body=st.binary(max_size=80)
    | st.sampled_from([b"zz\r\n", b"2\r\nabX\r\n", b"1\nx", b"0\r\n\r\nmore"])
    | st.builds(
        lambda parts, cut: _chunked(parts, [], [])[:cut],
        st.lists(st.sampled_from([_FRAMES, _FRAMES[:10], b"\x00" * 9, b"junk"]), max_size=3),
        st.integers(0, 400),
    ),
    head=st.sampled_from(
        [
            _HEAD + b"transfer-encoding: chunked\r\n\r\n",
            _HEAD + b"content-length: 5\r\n\r\n",
            _HEAD + b"\r\n",
            b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n",
            b"garbage\r\n\r\n",
        ]
    ),
)
def test_any_response_raises_only_typed_errors(head: bytes, body: bytes) -> None:
    async def attempt() -> None:
        # Nothing escapes to the event loop either (an error in a protocol callback).
        errors: list[dict[str, object]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        async with _server([head + body]) as url:
            with contextlib.suppress(DaemonUnavailable, MalformedFrame, SandboxkitError):
                await _read(url)
        assert not errors

    asyncio.run(attempt())


# -- the receive buffer: frames cut where they were received ------------------------------


def _read_through(buffer: FrameBuffer, reads: list[bytes], release: bool = False) -> list[Frame]:
    """The frames of a chunked body received in ``reads`` (each split by the room the
    buffer offers, as the socket would be). Their payloads are borrowed from the buffer:
    ``release`` copies them and releases them after each read (a consumer keeping up),
    else they are held to the end (one that keeps them: they must stay intact)."""
    body = ChunkedBody()
    frames: list[Frame] = []
    for data in reads:
        while data:
            space = buffer.space()
            assert len(space) > 0  # the buffer always has room for the next read
            size = min(len(space), len(data))
            space[:size] = data[:size]
            data = data[size:]
            start, end = buffer.received(size)
            body.feed_at(buffer.raw, start, end, buffer.piece)
            buffer.cut(frames)
            if release:
                frames = [Frame(f.kind, f.meta, bytes(f.payload)) for f in frames]
                buffer.release()
    assert body.done
    return frames


_PAYLOADS = st.lists(
    st.binary(max_size=40) | st.integers(0, 3000).map(lambda n: bytes(range(256)) * (n // 256)),
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(
    payloads=_PAYLOADS,
    size=st.sampled_from([16, 64, 300, 4096]),
    chunk_cuts=st.lists(st.integers(0, 20000), max_size=10),
    read_cuts=st.lists(st.integers(0, 20000), max_size=12),
    release=st.booleans(),
)
def test_frames_are_cut_in_place_however_bytes_and_chunks_fall(
    payloads: list[bytes], size: int, chunk_cuts: list[int], read_cuts: list[int], release: bool
) -> None:
    # Chunks cut anywhere (inside headers, metadata and payloads: the framing must be
    # closed up), reads cut anywhere, frames larger than the buffer (it grows, then
    # shrinks back), frames that fit (moved to the front when the room runs out), and
    # payloads borrowed and never released: a new buffer rather than overwrite them.
    sent = [Frame(FrameKind.DATA, {"seq": i}, p) for i, p in enumerate(payloads)]
    stream = b"".join(encode_frame(f.kind, f.meta, f.payload) for f in sent)
    encoded = _chunked(_splits(stream, chunk_cuts), [], [])
    buffer = FrameBuffer(size)
    assert _read_through(buffer, _splits(encoded, read_cuts), release) == sent
    assert buffer.pending == 0
    buffer.release()
    assert len(buffer.raw) == size


def test_frames_aligned_with_chunks_are_never_moved() -> None:
    # The daemon sends whole frames per chunk: each read's frames are cut where they lie,
    # and a frame a read leaves unfinished is completed right after itself (while there
    # is room: here, always).
    frames = [encode_frame(FrameKind.DATA, {"seq": i}, bytes([i]) * 700) for i in range(6)]
    encoded = _chunked([b"".join(frames[:3]), b"".join(frames[3:])], [], [])
    buffer = FrameBuffer(64 * 1024)
    moves: list[int] = []
    original = buffer._move_front
    buffer._move_front = lambda: moves.append(1) or original()  # type: ignore[method-assign]
    got = _read_through(buffer, _splits(encoded, [1000, 2500, 3100]), release=True)
    assert [f.payload for f in got] == [bytes([i]) * 700 for i in range(6)]
    assert not moves


def test_whole_frames_before_chunk_framing_are_cut_where_they_lie() -> None:
    # One read takes several of the daemon's chunks, a whole frame in each: every frame
    # is cut where it was received, none moved over the framing after it (which cost up
    # to half of each read's bytes in copies); only a frame the framing falls inside is.
    frames = [encode_frame(FrameKind.DATA, {"seq": i}, bytes([i]) * 5000) for i in range(5)]
    read = _chunked([*frames[:4], frames[4][:3000], frames[4][3000:]], [], [])
    buffer = FrameBuffer(64 * 1024)
    got = _read_through(buffer, [read], release=False)
    assert [f.payload for f in got] == [bytes([i]) * 5000 for i in range(5)]
    # The buffer still holds the read as it came, up to the split frame's second part
    # (moved down over the framing inside it, the smaller side).
    split = read.index(frames[4][3000:]) - len(b"\r\n%x\r\n" % (len(frames[4]) - 3000))
    assert bytes(buffer.raw[:split]) == read[:split]


def test_a_broken_frame_header_in_the_buffer_is_malformed() -> None:
    buffer = FrameBuffer(64)
    with pytest.raises(MalformedFrame):
        _read_through(buffer, [_chunked([b"\x63" + b"\x00" * 12], [], [])])


async def test_borrowed_payloads_hold_until_the_next_batch_even_for_a_slow_reader() -> None:
    # A reader that yields to the loop while handling each batch lets more reads land in
    # the buffer meanwhile: the frames they complete are borrowed too, and must still be
    # intact when their batch comes, whatever was released in between.
    payloads = [bytes([i % 251]) * (3000 + 7 * i) for i in range(400)]
    got: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_HEAD + b"transfer-encoding: chunked\r\n\r\n")
        for i, payload in enumerate(payloads):  # a frame per chunk and write, as the daemon
            frame = encode_frame(FrameKind.DATA, {"seq": i}, payload)
            writer.write(b"%x\r\n%s\r\n" % (len(frame), frame))
            await writer.drain()
            await asyncio.sleep(0)  # sleep-ok: lets the reader read between writes
        writer.write(b"0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server, open_raw_stream(url, "/stream", {}, {}) as raw:
        async for batch in raw.batches(borrow=True):
            for _ in range(3):
                await asyncio.sleep(0)  # sleep-ok: a slow reader, letting reads in
            got += [bytes(frame.payload) for frame in batch]  # still its own bytes
    assert got == payloads


async def test_a_waiting_stream_reads_all_the_buffer_has_room_for_a_busy_one_a_bound() -> None:
    # Waiting, the stream takes every byte at once: a read may take all the kernel holds
    # (fewer reads per GB); busy (a slow callback), it reads at most _BUFFER ahead, so a
    # stalled reader still shows as behind at the daemon.
    reader = raw_stream._Reader()
    reader._body = ChunkedBody()
    reader._buffer.space()
    reader._buffer.received(60_000)  # a first read that filled it: the usual buffer next
    assert len(reader.get_buffer(-1)) == raw_stream._BUFFER
    reader._waiter = asyncio.get_running_loop().create_future()  # as _wait() sets it
    assert len(reader.get_buffer(-1)) == len(reader._buffer.space()) == READ_SIZE


def test_a_short_stream_never_takes_the_usual_buffer() -> None:
    # A run of a short command is a few hundred bytes: a new 1 MiB buffer for each (1 MiB
    # zeroed, then paged in) was a tenth of the client's CPU per run(["true"]). The first
    # buffer is small; a read that leaves it short of room grows it to the usual size.
    buffer = FrameBuffer()
    frames = [encode_frame(FrameKind.START, {"pid": 7}), encode_frame(FrameKind.END, {"code": 0})]
    encoded = _chunked(frames, [], [])
    got = _read_through(buffer, [encoded[:30], encoded[30:]], release=True)
    assert [f.kind for f in got] == [FrameKind.START, FrameKind.END]
    assert len(buffer.raw) < READ_SIZE // 8
    _read_through(buffer, [_chunked([encode_frame(FrameKind.DATA, {}, b"x" * 100_000)], [], [])])
    assert len(buffer.raw) == READ_SIZE


class _Socket:
    """Records the receive buffer sizes a stream sets."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def setsockopt(self, level: int, option: int, value: int) -> None:
        assert (level, option) == (socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.sizes.append(value)


async def test_the_receive_buffer_grows_for_a_stream_that_keeps_up_and_shrinks_when_busy() -> None:
    reader = raw_stream._Reader()
    reader._body = ChunkedBody()
    sock = _Socket()
    reader.size_receive_buffer(sock)
    assert sock.sizes == [raw_stream._RECEIVE_BUFFER]
    loop = asyncio.get_running_loop()
    frames = [encode_frame(FrameKind.DATA, {"seq": i}, bytes(65536)) for i in range(16)]
    data = _chunked(frames, [], [])
    sent = 0

    def receive(size: int, waiting: bool) -> None:
        nonlocal sent
        reader._waiter = loop.create_future() if waiting else None  # as _wait() sets it
        reader.get_buffer(-1)[:size] = data[sent : sent + size]
        sent += size
        reader.buffer_updated(size)
        assert reader._error is None
        reader._frames.clear()
        reader._buffer.release()

    receive(1000, waiting=True)  # the kernel held little: nothing to gain
    assert sock.sizes == [raw_stream._RECEIVE_BUFFER]
    receive(raw_stream._RECEIVE_BUFFER, waiting=True)  # as much as the buffer takes
    assert sock.sizes[-1] == raw_stream._MAX_RECEIVE_BUFFER
    receive(1000, waiting=False)  # bytes came while frames were handled: back at once
    assert sock.sizes[-1] == raw_stream._RECEIVE_BUFFER
    receive(100, waiting=False)
    assert len(sock.sizes) == 3, "set only when it changes"


async def test_a_fast_stream_reads_through_the_larger_receive_buffer() -> None:
    payload = bytes(range(256)) * 1024
    frames = [encode_frame(FrameKind.DATA, {"seq": i}, payload) for i in range(32)]
    response = _HEAD + b"transfer-encoding: chunked\r\n\r\n" + _chunked(frames, [], [])
    got: list[bytes] = []
    async with _server([response]) as url, open_raw_stream(url, "/stream", {}, {}) as raw:
        sock = raw._reader.transport.get_extra_info("socket")  # type: ignore[union-attr]
        async for batch in raw.batches(borrow=True):
            got += [bytes(frame.payload) for frame in batch]
        assert raw._reader._receive_buffer == raw_stream._MAX_RECEIVE_BUFFER
        # The kernel doubles what it is given (and may cap it lower than asked).
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) > 2 * raw_stream._RECEIVE_BUFFER
    assert got == [payload] * 32
