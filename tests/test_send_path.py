"""The daemon's send path at full rate (issue 11): several frames per send, byte-exact, the
send buffer a consumer gets, and the choice of event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ChunkedDecoder, LoopHold, fast_config, poll

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.http.fast_path import split
from sandboxkit.daemon.process import ManagedProcess, ProcessSpec
from sandboxkit.daemon.server import DaemonServer, event_loop_factory
from sandboxkit.daemon.tcp_peer import MAX_SEND_BUFFER, SEND_BUFFER, size_send_buffer
from sandboxkit.wire import Frame, FrameDecoder, FrameKind

BLOCKS = 32  # 64 KiB writes: 2 MiB in all
WRITER = (
    "import sys\n"
    f"for i in range({BLOCKS}):\n"
    "    sys.stdout.buffer.write(bytes([65 + i % 26]) * 65536)\n"
)


class CountingSink:
    """Takes everything at once, counting its sends."""

    def __init__(self) -> None:
        self.sends = 0
        self.data = bytearray()

    async def send(self, data: bytes) -> None:
        self.sends += 1
        self.data += data

    async def close(self) -> None:
        pass


async def test_frames_are_coalesced_into_fewer_sends_byte_exact(host: Host) -> None:
    host.config.read_chunk = 16 * 1024  # many small frames
    sbx = await host.create_sandbox()
    process = await sbx.start_process(ProcessSpec(argv=(sys.executable, "-c", WRITER)))
    await process.wait()
    consumer = host.open_consumer(process, 0)
    sink = CountingSink()
    await host.start_stream(consumer, sink)

    frames = FrameDecoder().feed(bytes(sink.data))
    data = [f for f in frames if f.kind == FrameKind.DATA]
    assert frames[-1].kind == FrameKind.END
    expected = b"".join(bytes([65 + i % 26]) * 65536 for i in range(BLOCKS))
    assert b"".join(f.payload for f in data) == expected
    assert [f.meta["seq"] for f in data] == list(range(len(data)))
    # One send per 64 KiB frame costs a Python round trip each; they go out in groups.
    assert sink.sends < len(data) / 1.5, (sink.sends, len(data))
    assert consumer.frames_sent == len(frames)


def test_event_loop_choice() -> None:
    assert event_loop_factory("asyncio") is None
    with pytest.raises(ValueError, match="event_loop"):
        event_loop_factory("trio")
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        assert event_loop_factory("auto") is None  # not installed: asyncio's own
    else:
        factory = event_loop_factory("auto")
        assert factory is not None and "uvloop" in type(factory()).__module__


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_the_stream_over_http_1_0_and_1_1_is_byte_exact(daemon: DaemonServer, version: str) -> None:
    """HTTP/1.1 body chunks go straight to the connection, framed by the daemon; HTTP/1.0
    (no chunked encoding) takes the plain ASGI path. Both carry the same frames."""
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        argv = [sys.executable, "-c", WRITER]
        pid = http.post(f"/sandboxes/{sid}/processes", json={"argv": argv}).json()["pid"]
        process = f"{sid}/processes/{pid}"
        with _stream_socket(daemon.url, daemon.token, process, version, close=True) as sock:
            raw = bytearray()
            while block := sock.recv(1 << 16):  # the process ends: the server closes
                raw += block
        http.delete(f"/sandboxes/{sid}")
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    chunked = b"transfer-encoding: chunked" in head.lower()
    # h11 answers HTTP/1.0 unchunked; uvicorn's httptools protocol chunks it anyway.
    assert chunked or version == "1.0", head
    if chunked:
        decoder = ChunkedDecoder()
        body = decoder.feed(body)
        assert decoder.done, "the chunked body was not terminated"
    frames = FrameDecoder().feed(body)
    assert frames[0].kind is FrameKind.START
    assert frames[-1].kind is FrameKind.END
    data = b"".join(f.payload for f in frames if f.kind is FrameKind.DATA)
    assert data == b"".join(bytes([65 + i % 26]) * 65536 for i in range(BLOCKS))


def test_a_streams_head_and_start_frame_reach_the_reader_in_one_packet(
    daemon: DaemonServer,
) -> None:
    """The response's head waits in the kernel for the ``start`` frame: a reader (a
    ``run()``) wakes once for both, not once for each, while its command runs."""
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        pid = http.post(f"/sandboxes/{sid}/processes", json={"argv": ["true"]}).json()["pid"]
        deadline = time.monotonic() + 10
        while http.get(f"/sandboxes/{sid}/processes/{pid}").json()["state"] != "exited":
            assert time.monotonic() < deadline, "true did not end"
            time.sleep(0.01)  # sleep-ok: polling with a deadline
        with _stream_socket(daemon.url, daemon.token, f"{sid}/processes/{pid}") as sock:
            raw = bytearray()
            while not raw.endswith(b"\r\n0\r\n\r\n"):  # to the body's end
                block = sock.recv(1 << 16)
                assert block, "the connection closed before the body's end"
                raw += block
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 160)
        http.delete(f"/sandboxes/{sid}")
    _, _, body = bytes(raw).partition(b"\r\n\r\n")
    decoder = ChunkedDecoder()
    frames = FrameDecoder().feed(decoder.feed(body))
    assert decoder.done and [f.kind for f in frames] == [FrameKind.START, FrameKind.END]
    # tcpi_data_segs_in (Linux 4.6+): the packets that brought bytes to this socket.
    assert struct.unpack_from("I", info, 152)[0] <= 3, "head + start, end, the body's end"


def test_peers_that_vanish_mid_stream_cost_no_writes_into_dead_sockets(
    daemon: DaemonServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A reader that resets its connection while 2 MiB replay to it: the daemon stops
    writing to that connection (no ``socket.send() raised exception`` from asyncio, which
    it logs once more than four writes went to a dead socket)."""
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        argv = [sys.executable, "-c", WRITER + "import time; time.sleep(60)  # sleep-ok\n"]
        pid = http.post(f"/sandboxes/{sid}/processes", json={"argv": argv}).json()["pid"]
        path = f"/sandboxes/{sid}/processes/{pid}"
        deadline = time.monotonic() + 10
        while http.get(path).json()["total_bytes"] < BLOCKS * 65536:
            assert time.monotonic() < deadline, "the writer did not write"
            time.sleep(0.02)  # sleep-ok: polling with a deadline
        for _ in range(20):
            sock = _stream_socket(daemon.url, daemon.token, f"{sid}/processes/{pid}")
            sock.recv(1 << 16)
            # Close with a reset (linger 0), in the middle of the replay.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        rows = http.get(f"/sandboxes/{sid}/consumers").json()
        deadline = time.monotonic() + 10
        while any(r["closed_at"] is None for r in rows):
            assert time.monotonic() < deadline, rows
            time.sleep(0.02)  # sleep-ok: polling with a deadline
            rows = http.get(f"/sandboxes/{sid}/consumers").json()
        http.delete(f"/sandboxes/{sid}")
    assert "socket.send() raised exception" not in caplog.text


@dataclass
class _Waiting:
    """A daemon on a thread, a sandbox's ``cat`` (silent until told) and a raw connection
    to its stream that has read the response's head and the start frame (``raw``): its
    consumer waits at the head of the log."""

    server: DaemonServer
    http: httpx.Client
    sid: str
    process: ManagedProcess
    sock: socket.socket
    raw: bytes


@contextlib.contextmanager
def _waiting_reader(config: DaemonConfig) -> Iterator[_Waiting]:
    server = DaemonServer(config).start()
    try:
        headers = {"Authorization": f"Bearer {server.token}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=10) as http:
            sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
            pid = http.post(f"/sandboxes/{sid}/processes", json={"argv": ["cat"]}).json()["pid"]
            with _stream_socket(server.url, server.token, f"{sid}/processes/{pid}") as sock:
                raw = bytearray()
                while b"\r\n\r\n" not in raw or not _frames(raw):
                    block = sock.recv(1 << 16)
                    assert block, "the connection closed before the start frame"
                    raw += block
                process = server.host.get(sid).process(pid)
                yield _Waiting(server, http, sid, process, sock, bytes(raw))
            http.delete(f"/sandboxes/{sid}")
    finally:
        server.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_line_reaches_a_waiting_readers_socket_in_the_turn_that_read_it(loop: str) -> None:
    """A reader waiting at the head of the log gets new output written to its socket by
    the append itself, in the daemon's turn that read it from the process: not a turn
    later, by the reader's own task (a printed line's latency, P3 in docs/performance.md).
    Checked without a clock: the bytes are in the reader's socket before that turn ends."""
    with _waiting_reader(fast_config(event_loop=loop)) as reader:
        assert reader.server.loop is not None and loop in type(reader.server.loop).__module__

        async def print_a_line() -> bytes:
            # As the pipe's reader does; then, in the same turn, what has arrived.
            reader.process.capture("stdout", b"hello\n")
            try:
                return reader.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return b""

        arrived = asyncio.run_coroutine_threadsafe(print_a_line(), reader.server.loop).result(10)
        frames = _frames(reader.raw + arrived)
        assert frames[-1].kind is FrameKind.DATA, "the line waited for a later turn"
        assert frames[-1].payload == b"hello\n"


def test_lines_sent_at_once_leave_their_readers_task_asleep_and_keepalives_on_time() -> None:
    """Line after line sent from the appends (above) never wakes the reader's own task:
    it has nothing to do, and waking it cost the daemon a turn of Python per line and
    reader. It wakes for what only it does: a keepalive once the output stops, a pause
    told at once."""
    config = fast_config(keepalive_interval=0.5, stall_timeout=30.0)
    with _waiting_reader(config) as reader:
        assert reader.server.loop is not None
        log = reader.process.log

        async def print_lines() -> list[object]:
            waits = []
            for i in range(5):
                await poll(lambda: log._waiters._futures, 5, "the reader", interval=0)
                waits.append(next(iter(log._waiters._futures)))
                reader.process.capture("stdout", b"line %d\n" % i)
                for _ in range(3):  # the turns its task would have taken
                    await asyncio.sleep(0)
            return waits

        waits = asyncio.run_coroutine_threadsafe(print_lines(), reader.server.loop).result(10)
        assert len({id(w) for w in waits}) == 1, "the reader's task woke for a line"
        raw = bytearray(reader.raw)
        deadline = time.monotonic() + 10
        while not any(f.kind is FrameKind.KEEPALIVE for f in _frames(raw)):
            assert time.monotonic() < deadline, "no keepalive once the output stopped"
            reader.sock.settimeout(deadline - time.monotonic())
            raw += reader.sock.recv(1 << 16)
        frames = _frames(raw)
        lines = b"".join(f.payload for f in frames if f.kind is FrameKind.DATA)
        assert lines == b"".join(b"line %d\n" % i for i in range(5))
        assert frames[-1].kind is FrameKind.KEEPALIVE and frames[-1].meta["cursor"] == 5
        reader.http.post(f"/sandboxes/{reader.sid}/pause").raise_for_status()
        while (last := _frames(raw)[-1]).meta.get("sandbox_state") != "paused":
            assert time.monotonic() < deadline, f"the pause was not told: {last}"
            reader.sock.settimeout(deadline - time.monotonic())
            raw += reader.sock.recv(1 << 16)
        reader.http.post(f"/sandboxes/{reader.sid}/resume").raise_for_status()


def test_a_reader_whose_socket_filled_on_a_line_sent_at_once_is_kicked_as_output_stops() -> None:
    """What the kernel did not take of a line the append sent (above) waits in the
    transport, and its reader's task waits for it as for the rest of any send: a reader
    that stopped reading is kicked after the stall timeout, though the process prints
    nothing more (not only once more output, or a keepalive, finds it stuck)."""
    stall = 0.5
    with _waiting_reader(fast_config(stall_timeout=stall, keepalive_interval=30.0)) as ghost:
        assert ghost.server.loop is not None
        process, connections = ghost.process, ghost.server._server.server_state.connections

        async def fill() -> None:
            for _ in range(10_000):
                # Each line finds its reader waiting at the head: sent at once.
                await poll(lambda: process.log._waiters._futures, 5, "the reader", interval=0)
                process.capture("stdout", b"l" * 1023 + b"\n")
                if any(c.transport.get_write_buffer_size() for c in connections):
                    return  # the kernel did not take all of it: the output stops
            raise AssertionError("the reader's socket never filled")

        asyncio.run_coroutine_threadsafe(fill(), ghost.server.loop).result(30)
        deadline = time.monotonic() + stall + 3
        while (rows := ghost.http.get(f"/sandboxes/{ghost.sid}/consumers").json())[0][
            "state"
        ] != "kicked":
            assert time.monotonic() < deadline, rows
            time.sleep(0.05)  # sleep-ok: polling with a deadline


def _stream_socket(
    url: str, token: str | None, process: str, version: str = "1.1", close: bool = False
) -> socket.socket:
    """A connection that asked for ``process``'s stream (``SID/processes/PID``) from its
    first chunk, read raw; with ``close``, one the server closes at the stream's end."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    ask = "Connection: close\r\n" if close else ""
    sock.sendall(
        f"GET /sandboxes/{process}/stream?cursor=0 HTTP/{version}\r\nHost: x\r\n"
        f"Authorization: Bearer {token}\r\n{ask}\r\n".encode()
    )
    return sock


def _frames(raw: bytes | bytearray) -> list[Frame]:
    """The frames of a stream's raw response so far (head and chunked framing taken off)."""
    _, _, body = bytes(raw).partition(b"\r\n\r\n")
    return FrameDecoder().feed(ChunkedDecoder().feed(body))


@pytest.mark.slow
def test_under_uvloop_a_pty_process_reads_stdin_and_quick_exits_start_cleanly() -> None:
    """uvloop's write-pipe transport reads its fd to notice a close: on a dup of a pty
    master that read stole the child's output, and a child that exits at once had its
    stdin pipe closed before the daemon set its limits (a 500)."""
    pytest.importorskip("uvloop")
    from sandboxkit.daemon.config import DaemonConfig

    with (
        DaemonServer(DaemonConfig(event_loop="uvloop"), token=None) as daemon,
        httpx.Client(base_url=daemon.url, timeout=10) as http,
    ):
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        procs = f"/sandboxes/{sid}/processes"
        for _ in range(30):
            started = http.post(procs, json={"argv": ["true"]})
            assert started.status_code == 201, started.text
        shout = "import sys; print('got:' + sys.stdin.readline().strip().upper())"
        argv = [sys.executable, "-c", shout]
        pid = http.post(procs, json={"argv": argv, "pty": True}).json()["pid"]
        ack = http.post(f"{procs}/{pid}/stdin", json={"session": "s", "seq": 0, "data": "aGkK"})
        assert ack.status_code == 200, ack.text
        frames = FrameDecoder().feed(http.get(f"{procs}/{pid}/stream?cursor=0").content)
        http.delete(f"/sandboxes/{sid}")
    assert frames[-1].kind is FrameKind.END and frames[-1].meta["exit_code"] == 0
    output = b"".join(f.payload for f in frames if f.kind is FrameKind.DATA)
    assert b"got:HI" in output, output


class PacedSink(CountingSink):
    """A transport that drains at ``rate`` bytes per second through a small buffer, as
    asyncio's do: a send is taken at once while the buffer holds under ``high`` bytes,
    else it waits until the buffer drains to a quarter of that. Records the send buffer
    the consumer asks it for."""

    def __init__(self, rate: float, high: int = 4096) -> None:
        super().__init__()
        self.rate = rate
        self.high = high
        self.buffered = 0.0
        self.drained_at = time.monotonic()
        self.buffers: list[int] = []

    def _drain(self) -> None:
        now = time.monotonic()
        self.buffered = max(0.0, self.buffered - (now - self.drained_at) * self.rate)
        self.drained_at = now

    async def send(self, data: bytes) -> None:
        self._drain()
        self.buffered += len(data)
        if self.buffered > self.high:
            wait = (self.buffered - self.high / 4) / self.rate
            await asyncio.sleep(wait)  # sleep-ok: the transport's drain rate
            self._drain()
        await super().send(data)

    def size_send_buffer(self, nbytes: int) -> None:
        self.buffers.append(nbytes)


@pytest.mark.parametrize(("rate", "stall", "fast"), [(20e6, 10.0, True), (2e6, 0.2, False)])
async def test_a_consumer_sizes_its_send_buffer_to_what_its_peer_drains(
    host: Host, rate: float, stall: float, fast: bool
) -> None:
    """A peer that drains fast gets a large kernel buffer (fewer, fuller writes); one that
    drains slowly keeps the small one, so its progress stays visible within the stall
    timeout (tests/test_kick.py, the slow consumer)."""
    host.config.stall_timeout = stall
    sbx = await host.create_sandbox()
    half_mib = "import sys; sys.stdout.buffer.write(b'x' * 524288)"
    process = await sbx.start_process(ProcessSpec(argv=(sys.executable, "-c", half_mib)))
    await process.wait()
    sink = PacedSink(rate)
    # The loop is held up at every turn, as on a loaded machine: a send that had room
    # (the small start and end frames) must still not be taken for a slow peer.
    hold = LoopHold(asyncio.get_running_loop())
    try:
        await host.start_stream(host.open_consumer(process, 0), sink)
    finally:
        hold.stop()
    assert sink.buffers, "no send waited: the consumer never sized the buffer"
    drained = rate * stall / 4  # what the peer drains in a quarter of the stall timeout
    if fast:  # far above the largest buffer, however late the held-up loop made the sends
        assert all(n >= 4 * MAX_SEND_BUFFER for n in sink.buffers), sink.buffers
    else:
        assert all(n == pytest.approx(drained, rel=0.5) for n in sink.buffers), sink.buffers
    sizes = {size_send_buffer(socket.socket(), n, 0) for n in sink.buffers}
    assert sizes == ({MAX_SEND_BUFFER} if fast else {SEND_BUFFER}), sink.buffers


def test_send_buffer_sizes_are_powers_of_two_within_bounds() -> None:
    with socket.socket() as sock:
        assert size_send_buffer(sock, 1, 0) == SEND_BUFFER
        assert size_send_buffer(sock, 3 * SEND_BUFFER, 0) == 2 * SEND_BUFFER
        kernel = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert size_send_buffer(sock, 10**12, 2 * SEND_BUFFER) == MAX_SEND_BUFFER
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > kernel  # (or capped)
        # Unchanged: no system call.
        assert size_send_buffer(None, MAX_SEND_BUFFER, MAX_SEND_BUFFER) == MAX_SEND_BUFFER


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.binary(max_size=40), max_size=8), cut=st.integers(0, 400))
def test_what_the_kernel_did_not_take_is_the_exact_rest(parts: list[bytes], cut: int) -> None:
    """The daemon writes a body chunk's parts to the socket itself (asyncio); whatever
    prefix the kernel took, the rest is written next, byte-exact, without a copy."""
    whole = b"".join(parts)
    sent = min(cut, len(whole))
    views: list[bytes | memoryview] = [memoryview(p) if i % 2 else p for i, p in enumerate(parts)]
    taken, rest = split(views, sent)
    assert b"".join(taken) == whole[:sent]
    assert b"".join(rest) == whole[sent:]
