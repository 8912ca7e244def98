"""Fan-out (F1): a consumer that stops reading must not slow any other consumer, nor the
producer. Against the real daemon over TCP, and against the core with blocking sinks."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from typing import Any

import pytest
from support import fast_config
from support import poll as _poll

from sandboxkit import AsyncSandbox
from sandboxkit.client.api import ApiClient
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.wire import Frame, FrameDecoder, FrameKind

LINES = 80_000  # 100 bytes each: 8 MB
LINE_SIZE = 100

# Writes LINES numbered, verifiable lines as fast as it can, once stdin says go.
WRITER = f"""
import sys
sys.stdin.readline()
out = sys.stdout.buffer
n = int(sys.argv[1])
for start in range(0, n, 1000):
    out.write(b"".join(
        b"%08d %s\\n" % (i, bytes([65 + i % 26]) * {LINE_SIZE - 10})
        for i in range(start, min(start + 1000, n))
    ))
out.flush()
"""


def expected_output(n: int) -> bytes:
    """What WRITER prints for ``n`` lines, computed independently of the child."""
    return b"".join(
        str(i).zfill(8).encode() + b" " + chr(65 + i % 26).encode() * (LINE_SIZE - 10) + b"\n"
        for i in range(n)
    )


@pytest.fixture
def daemon_config() -> DaemonConfig:
    # Keep all 8 MB (no eviction) and never kick the ghost during the test: this module is
    # about non-interference, not about kicks.
    return fast_config(retention_bytes=64 * 1024 * 1024, stall_timeout=120.0)


def _ghost(url: str, token: str, path: str) -> socket.socket:
    """A TCP client that attaches to a stream, reads the response headers, then never reads
    again (a tiny receive buffer, so the daemon's sends to it soon stop making progress)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        sock.settimeout(10)
        sock.connect((host, int(port)))
        request = (
            f"GET {path} HTTP/1.1\r\n"
            f"Host: {host}:{port}\r\n"
            f"Authorization: Bearer {token}\r\n"
            "Accept: */*\r\n"
            "\r\n"
        )
        sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(1)  # byte by byte: take nothing past the headers
            if not data:
                raise AssertionError(f"ghost stream closed early: {head!r}")
            head += data
        assert head.startswith(b"HTTP/1.1 200"), head
    except BaseException:
        sock.close()
        raise
    return sock


@pytest.mark.timeout(60)
async def test_ghost_tcp_consumer_does_not_delay_healthy_consumers(
    conn: dict[str, str],
) -> None:
    expected = expected_output(LINES)
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        ghost: socket.socket | None = None
        raw_task: asyncio.Task[tuple[list[Frame], Frame]] | None = None
        try:
            info = await sbx.commands.start([sys.executable, "-c", WRITER, str(LINES)])
            pid = info.pid
            stream_path = f"/sandboxes/{sbx.sandbox_id}/processes/{pid}/stream"
            consumers_path = f"/sandboxes/{sbx.sandbox_id}/consumers"

            # The ghost attaches first, at cursor 0, and never reads past the headers.
            ghost = _ghost(conn["url"], conn["token"], stream_path + "?cursor=0&name=ghost")

            # Healthy consumer 1: the SDK, collecting decoded text.
            sdk_text: list[str] = []
            handle = await sbx.commands.connect(
                pid, cursor=0, on_stdout=sdk_text.append, lines=False
            )

            # Healthy consumer 2: raw frames, byte-exact.
            async def read_raw() -> tuple[list[Frame], Frame]:
                data: list[Frame] = []
                async with api.stream(stream_path, cursor=0, name="raw") as frames:
                    async for frame in frames:
                        if frame.kind is FrameKind.DATA:
                            data.append(frame)
                        elif frame.kind in (FrameKind.END, FrameKind.ERROR):
                            return data, frame
                raise AssertionError("raw stream ended without an end frame")

            raw_task = asyncio.create_task(read_raw())

            async def three_attached() -> bool:
                rows = await api.call("GET", consumers_path)
                return sum(1 for c in rows if c["pid"] == pid and c["closed_at"] is None) == 3

            await _poll(three_attached, 10, "three consumers attached")

            # Go: the child writes 8 MB as fast as it can.
            started = time.monotonic()
            await sbx.commands.send_stdin(pid, "go\n")
            try:
                result = await asyncio.wait_for(handle.wait(), 30)
                raw_data, raw_end = await asyncio.wait_for(raw_task, 30)
            except asyncio.TimeoutError:
                pytest.fail("healthy consumers stalled behind a ghost that stopped reading")
            elapsed = time.monotonic() - started

            # Both healthy consumers got every byte, in order, and the process exited.
            assert result.exit_code == 0
            assert "".join(sdk_text).encode() == expected
            assert result.stdout.encode() == expected
            assert raw_end.kind is FrameKind.END and raw_end.meta["exit_code"] == 0
            assert b"".join(f.payload for f in raw_data) == expected
            assert [f.meta["seq"] for f in raw_data] == list(range(len(raw_data)))
            offsets = [f.meta["offset"] for f in raw_data]
            sizes = [len(f.payload) for f in raw_data]
            assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
            head = len(raw_data)

            # The ghost really was stuck all along, and still is: attached, behind the
            # head, its send blocked; it was not kicked.
            async def ghost_blocked() -> dict[str, Any] | None:
                rows = await api.call("GET", consumers_path)
                (row,) = [c for c in rows if c["name"] == "ghost"]
                return row if row["state"] == "blocked" else None

            ghost_row = await _poll(ghost_blocked, 5, "the ghost consumer to show as blocked")
            assert ghost_row["closed_at"] is None
            assert ghost_row["head"] == head
            assert ghost_row["cursor"] < head
            assert ghost_row["lag_bytes"] > 0
            assert ghost_row["blocked_since"] is not None

            rows = await api.call("GET", consumers_path)
            healthy = [c for c in rows if c["pid"] == pid and c["name"] != "ghost"]
            assert len(healthy) == 2
            for row in healthy:
                assert row["cursor"] == head, row
                assert row["lag_bytes"] == 0, row
                assert row["state"] == "closed" and row["close_reason"] == "end", row

            events = await sbx.raw_events()
            assert not [e for e in events if e["kind"] == "consumer.kicked"]
            # 8 MB through two consumers is fast once nothing waits for the ghost.
            assert elapsed < 20, f"healthy consumers took {elapsed:.1f}s"
        finally:
            if raw_task is not None:
                raw_task.cancel()
                await asyncio.gather(raw_task, return_exceptions=True)
            if ghost is not None:
                ghost.close()
            await api.aclose()


# -- core level: no HTTP -------------------------------------------------------------


class _CollectingSink:
    """A healthy transport: decodes every frame it is handed."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.started = asyncio.Event()
        self.ended = asyncio.Event()
        self.closed = False

    async def send(self, data: bytes) -> None:
        for frame in self.decoder.feed(data):
            self.frames.append(frame)
            if frame.kind is FrameKind.START:
                self.started.set()
            elif frame.kind in (FrameKind.END, FrameKind.ERROR):
                self.ended.set()

    async def close(self) -> None:
        self.closed = True

    def data(self) -> bytes:
        return b"".join(f.payload for f in self.frames if f.kind is FrameKind.DATA)


class _StuckSink:
    """A transport that accepts ``accept`` sends, then blocks forever (a peer that
    stopped reading)."""

    def __init__(self, accept: int, head: Any) -> None:
        self.accept = accept
        self.accepted: list[bytes] = []
        self.stuck = asyncio.Event()
        self.head_when_stuck: int | None = None
        self._head = head
        self._never = asyncio.Event()

    async def send(self, data: bytes) -> None:
        if len(self.accepted) >= self.accept:
            if not self.stuck.is_set():
                self.head_when_stuck = self._head()
                self.stuck.set()
            await self._never.wait()
        self.accepted.append(data)

    async def close(self) -> None:
        pass


@pytest.mark.timeout(30)
async def test_blocked_sink_stops_neither_other_consumer_nor_producer(host: Host) -> None:
    lines = 40_000  # 4 MB: far more than a pipe buffer
    sandbox = await host.create_sandbox()
    process = await sandbox.start_process(
        ProcessSpec(argv=(sys.executable, "-c", WRITER, str(lines)))
    )
    log = process.log
    stuck_sink = _StuckSink(accept=1, head=lambda: log.head)  # takes `start`, then no more
    good_sink = _CollectingSink()
    stuck = host.open_consumer(process, 0, name="stuck")
    good = host.open_consumer(process, 0, name="good")
    stuck_task = asyncio.create_task(host.serve(stuck, stuck_sink))
    good_task = asyncio.create_task(host.serve(good, good_sink))
    try:
        await asyncio.wait_for(good_sink.started.wait(), 5)
        assert len(stuck_sink.accepted) == 1  # the stuck one got its `start` frame
        await process.write_stdin("s", 0, b"go\n")

        await asyncio.wait_for(stuck_sink.stuck.wait(), 5)
        try:
            await asyncio.wait_for(good_sink.ended.wait(), 10)
        except asyncio.TimeoutError:
            pytest.fail(f"the healthy consumer stalled behind a blocked one (head={log.head})")
        await asyncio.wait_for(good_task, 5)

        # The producer never waited: the process wrote everything and exited, and the log
        # head moved on after the stuck consumer's send blocked.
        assert log.ended and log.exit_code == 0
        assert log.total_bytes == lines * LINE_SIZE
        assert stuck_sink.head_when_stuck is not None
        assert log.head > stuck_sink.head_when_stuck

        # The other consumer got everything, in order, byte-exact, with its end frame.
        assert good_sink.data() == expected_output(lines)
        data = [f for f in good_sink.frames if f.kind is FrameKind.DATA]
        assert [f.meta["seq"] for f in data] == list(range(log.head))
        assert good_sink.frames[-1].kind is FrameKind.END
        assert good_sink.frames[-1].meta["exit_code"] == 0
        assert good.metrics()["cursor"] == log.head and good.state == "closed"

        # Meanwhile the stuck consumer is still stuck where it was: not kicked, not moved.
        async def shows_blocked() -> bool:
            return stuck.state != "streaming"

        # Well inside stall_timeout (5 s): it must show as blocked, not kicked.
        await _poll(shows_blocked, 2, "the stuck consumer to show as blocked")
        metrics = stuck.metrics()
        assert metrics["state"] == "blocked"
        assert metrics["closed_at"] is None
        assert metrics["cursor"] == 0
        assert metrics["lag_bytes"] == log.total_bytes
        assert not stuck_task.done()
    finally:
        for task in (stuck_task, good_task):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(stuck_task, good_task, return_exceptions=True)
        await sandbox.kill()
