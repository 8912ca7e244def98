"""Kicks (F1, F2): a consumer whose send makes no progress for ``stall_timeout`` is kicked
by its own sender, off the shared path, so that ghosts never stall anyone else — not one
ghost, not ten at once; a slow consumer that keeps draining is never kicked; and the SDK
answers a kick by reattaching from its cursor with no loss and no duplicate."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import sys
import time
from typing import Any

import pytest
from support import ChunkedDecoder, fast_config
from support import poll as _poll

from sandboxkit import AsyncSandbox
from sandboxkit.client.api import ApiClient
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.wire import Frame, FrameDecoder, FrameKind

STALL = 1.0
# The healthy consumers' longest pause between two chunks while ghosts are attached and
# kicked. The writer ticks every 5 ms; a fan-out that waits for a ghost (one shared loop,
# or a grace timer inside it) shows a pause of about STALL.
MAX_HEALTHY_GAP = 0.5

BLOCK = 64 * 1024
BURST_BLOCKS = 256  # 16 MB written at once: far more than any ghost's socket buffers hold
TICKS = 500  # then a line every 5 ms: at least 2.5 s of steady output

# Writes a burst (so that a ghost attaching at cursor 0 has far more pending than its
# buffers take), then, once stdin says go, one numbered line every 5 ms.
CHATTY = """
import sys, time
out = sys.stdout.buffer
burst, ticks = int(sys.argv[1]), int(sys.argv[2])
block = b"b" * (BLOCK - 1) + b"\\n"
for _ in range(burst):
    out.write(block)
out.flush()
sys.stdin.readline()
for i in range(ticks):
    out.write(b"tick %06d\\n" % i)
    out.flush()
    time.sleep(0.005)  # sleep-ok: the child writes at a steady rate
""".replace("BLOCK", str(BLOCK))


def ticks_output(n: int) -> str:
    return "".join(f"tick {i:06d}\n" for i in range(n))


@pytest.fixture
def daemon_config() -> DaemonConfig:
    return fast_config(stall_timeout=STALL, retention_bytes=64 * 1024 * 1024)


# -- helpers -------------------------------------------------------------------------


async def _true(value: bool) -> bool:
    return value


def _attach_raw(url: str, token: str, path: str, rcvbuf: int = 4096) -> socket.socket:
    """A plain TCP client with a tiny receive buffer (set before connect, so the window
    stays small) that sends a stream request and reads exactly the response headers."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(10)
        sock.connect((host, int(port)))
        sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Authorization: Bearer {token}\r\nAccept: */*\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(1)  # byte by byte: take nothing past the headers
            if not data:
                raise AssertionError(f"stream closed before its headers: {head!r}")
            head += data
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding: chunked" in head.lower(), head
    except BaseException:
        sock.close()
        raise
    return sock


def _drain_to_end(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Read a chunked response until its body ends (the terminating chunk) or the daemon
    closes the connection; returns the body and whether it ended within ``timeout``."""
    sock.settimeout(0.2)
    chunked = ChunkedDecoder()
    body = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return bytes(body), True
        if not piece:
            return bytes(body), True
        body += chunked.feed(piece)
        if chunked.done:
            return bytes(body), True
    return bytes(body), False


def _max_gap(times: list[float]) -> float:
    return max(b - a for a, b in itertools.pairwise(times))


async def _kicked_events(sbx: AsyncSandbox, pid: int) -> list[dict[str, Any]]:
    return [e for e in await sbx.raw_events() if e["kind"] == "consumer.kicked" and e["pid"] == pid]


class _Healthy:
    """Two healthy consumers of the ticks, from the current head: the SDK (a callback per
    chunk) and raw frames; each records the monotonic arrival time of every chunk."""

    def __init__(self, sbx: AsyncSandbox, api: ApiClient, pid: int) -> None:
        self.sbx, self.api, self.pid = sbx, api, pid
        self.sdk_times: list[float] = []
        self.sdk_text: list[str] = []
        self.raw_times: list[float] = []
        self.raw_data: list[Frame] = []
        self.raw_end: Frame | None = None
        self.handle: Any = None
        self.raw_task: asyncio.Task[None] | None = None

    def _on_stdout(self, text: str) -> None:
        self.sdk_times.append(time.monotonic())
        self.sdk_text.append(text)

    async def start(self, head: int) -> None:
        self.handle = await self.sbx.commands.connect(
            self.pid, cursor=head, on_stdout=self._on_stdout, lines=False
        )
        path = f"/sandboxes/{self.sbx.sandbox_id}/processes/{self.pid}/stream"

        async def read_raw() -> None:
            async with self.api.stream(path, cursor=head, name="raw") as frames:
                async for frame in frames:
                    if frame.kind is FrameKind.DATA:
                        self.raw_times.append(time.monotonic())
                        self.raw_data.append(frame)
                    elif frame.kind in (FrameKind.END, FrameKind.ERROR):
                        self.raw_end = frame
                        return

        self.raw_task = asyncio.create_task(read_raw())

        async def attached() -> bool:
            rows = await self.api.call("GET", f"/sandboxes/{self.sbx.sandbox_id}/consumers")
            return sum(1 for c in rows if c["pid"] == self.pid and c["closed_at"] is None) >= 2

        await _poll(attached, 10, "the healthy consumers to attach")

    async def finish(self) -> None:
        await asyncio.wait_for(self.handle.wait(), 15)
        assert self.raw_task is not None
        await asyncio.wait_for(self.raw_task, 15)

    async def close(self) -> None:
        if self.handle is not None:
            await self.handle.disconnect()
        if self.raw_task is not None:
            self.raw_task.cancel()
            await asyncio.gather(self.raw_task, return_exceptions=True)

    def check(self, window: tuple[float, float]) -> dict[str, float]:
        """Both got every tick, exactly, and never paused for long while the ghosts were
        attached; their ticks covered ``window`` (monotonic), so the pause was measured."""
        expected = ticks_output(TICKS)
        assert "".join(self.sdk_text) == expected
        assert self.handle.exit_code == 0
        assert self.raw_end is not None and self.raw_end.kind is FrameKind.END
        assert b"".join(f.payload for f in self.raw_data) == expected.encode()
        gaps = {}
        for name, times in (("sdk", self.sdk_times), ("raw", self.raw_times)):
            assert times[0] < window[0] and times[-1] > window[1], (
                name,
                times[0],
                times[-1],
                window,
            )
            gaps[name] = _max_gap(times)
            assert gaps[name] < MAX_HEALTHY_GAP, (
                f"healthy {name} consumer paused {gaps[name]:.3f}s while ghosts were kicked"
            )
        return gaps


async def _start_chatty(sbx: AsyncSandbox) -> tuple[int, int]:
    """Start the writer and wait for its burst to be in the log; returns (pid, head)."""
    info = await sbx.commands.start([sys.executable, "-c", CHATTY, str(BURST_BLOCKS), str(TICKS)])

    async def burst_logged() -> Any:
        p = await sbx.commands.get(info.pid)
        return p if p.total_bytes >= BURST_BLOCKS * BLOCK else None

    logged = await _poll(burst_logged, 10, "the burst to reach the log")
    return info.pid, logged.head


# -- a. one ghost ----------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_ghost_is_kicked_after_stall_timeout_and_healthy_consumers_never_pause(
    conn: dict[str, str],
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        healthy = _Healthy(sbx, api, 0)
        ghost: socket.socket | None = None
        try:
            pid, head = await _start_chatty(sbx)
            healthy.pid = pid
            await healthy.start(head)
            await sbx.commands.send_stdin(pid, "go\n")
            await _poll(
                lambda: _true(len(healthy.sdk_times) >= 10 and len(healthy.raw_times) >= 10),
                10,
                "the first ticks",
            )

            # The ghost attaches at cursor 0 (16 MB behind) and never reads.
            ghost_attached = time.monotonic()
            path = f"/sandboxes/{sbx.sandbox_id}/processes/{pid}/stream?cursor=0&name=ghost"
            ghost = _attach_raw(conn["url"], conn["token"], path)

            # Follow its row: the latest blocked_since seen before the kick is when the send
            # that got it kicked started.
            blocked_since: list[float] = []

            async def kicked() -> list[dict[str, Any]]:
                rows = await api.call("GET", "/consumers")
                (row,) = [c for c in rows if c["name"] == "ghost"]
                if row["blocked_since"] is not None:
                    blocked_since.append(row["blocked_since"])
                return await _kicked_events(sbx, pid)

            (event,) = await _poll(kicked, STALL + 5, "the ghost to be kicked")
            kick_seen = time.monotonic()
            assert blocked_since, "the ghost never showed as blocked before its kick"
            assert event["data"]["name"] == "ghost"
            delay = event["ts"] - blocked_since[-1]
            # Kicked after its grace, and not much later.
            assert STALL * 0.9 <= delay <= STALL + 1.0, delay
            data = event["data"]
            assert STALL * 0.9 <= data["blocked_for"] <= STALL + 1.0, data
            assert isinstance(data["cursor"], int) and data["cursor"] < head, data
            assert data["lag_bytes"] > 0, data
            assert event["reason"] == "stalled"

            async def ghost_row_kicked() -> dict[str, Any] | None:
                rows = await api.call("GET", "/consumers")
                (row,) = [c for c in rows if c["name"] == "ghost"]
                return row if row["state"] == "kicked" else None

            row = await _poll(ghost_row_kicked, 1.0, "the ghost's row to show it kicked")
            assert row["closed_at"] is not None and row["close_reason"] == "kicked", row

            # The kick ended its stream: what the ghost still finds buffered ends (the body
            # ends or the connection closes) and is a clean prefix of the stream.
            body, ended = await asyncio.to_thread(_drain_to_end, ghost, 5)
            assert ended, "the kicked ghost's stream was left open"
            frames = FrameDecoder().feed(body)
            assert frames and frames[0].kind is FrameKind.START
            seqs = [f.meta["seq"] for f in frames if f.kind is FrameKind.DATA]
            assert seqs == list(range(len(seqs)))

            await healthy.finish()
            gaps = healthy.check((ghost_attached, kick_seen + 0.2))
            print(f"kick {delay:.3f}s after blocked_since; healthy max gaps {gaps}")
            # Only the ghost was kicked.
            assert len(await _kicked_events(sbx, pid)) == 1
        finally:
            await healthy.close()
            if ghost is not None:
                ghost.close()
            await api.aclose()


# Once stdin says go, a 1 KB line every millisecond or so: small writes, each one that
# finds its readers waiting sent by the append that read it (P3, docs/performance.md).
LINES = """
import sys, time
out = sys.stdout.buffer
line = b"l" * 1023 + b"\\n"
sys.stdin.readline()
for _ in range(int(sys.argv[1])):
    out.write(line)
    out.flush()
    time.sleep(0.001)  # sleep-ok: the child writes a line at a time
"""


@pytest.mark.slow
@pytest.mark.timeout(30)
async def test_a_ghost_waiting_at_the_head_of_line_output_is_kicked(conn: dict[str, str]) -> None:
    """A ghost that attaches before any output and never reads, while a process prints
    line after line: the lines go from the append's own turn while its sockets take them;
    once they are full, the next line waits in its send and the ghost is kicked after the
    stall timeout, as any ghost (the lines sent at once never hold it up)."""
    async with await AsyncSandbox.create(**conn) as sbx:
        info = await sbx.commands.start([sys.executable, "-c", LINES, "20000"])
        path = f"/sandboxes/{sbx.sandbox_id}/processes/{info.pid}/stream?name=ghost"
        ghost = _attach_raw(conn["url"], conn["token"], path)
        try:
            await sbx.commands.send_stdin(info.pid, "go\n")
            (event,) = await _poll(
                lambda: _kicked_events(sbx, info.pid), STALL + 10, "the ghost to be kicked"
            )
            data = event["data"]
            assert data["name"] == "ghost" and event["reason"] == "stalled", event
            assert STALL * 0.9 <= data["blocked_for"] <= STALL + 1.0, data
            assert data["lag_bytes"] > 0, data
            body, ended = await asyncio.to_thread(_drain_to_end, ghost, 5)
            assert ended, "the kicked ghost's stream was left open"
            frames = FrameDecoder().feed(body)
            seqs = [f.meta["seq"] for f in frames if f.kind is FrameKind.DATA]
            assert seqs == list(range(len(seqs))) and len(seqs) > 10, len(seqs)
        finally:
            ghost.close()
            await sbx.commands.kill(info.pid)


# -- b. ten ghosts ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(30)
async def test_ten_ghosts_are_kicked_in_parallel(conn: dict[str, str]) -> None:
    ghosts: list[socket.socket] = []
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        healthy = _Healthy(sbx, api, 0)
        try:
            pid, head = await _start_chatty(sbx)
            healthy.pid = pid
            await healthy.start(head)
            await sbx.commands.send_stdin(pid, "go\n")
            await _poll(
                lambda: _true(len(healthy.sdk_times) >= 10 and len(healthy.raw_times) >= 10),
                10,
                "the first ticks",
            )

            first_attach = time.monotonic()
            attached_at: dict[str, float] = {}
            for i in range(10):
                path = f"/sandboxes/{sbx.sandbox_id}/processes/{pid}/stream?cursor=0&name=ghost{i}"
                attached_at[f"ghost{i}"] = time.time()
                ghosts.append(_attach_raw(conn["url"], conn["token"], path))

            async def all_kicked() -> list[dict[str, Any]]:
                events = await _kicked_events(sbx, pid)
                return events if len(events) >= 10 else []

            # Sequential kicks would take about 10 × STALL; parallel ones, about STALL.
            events = await _poll(all_kicked, STALL + 4, "all ten ghosts to be kicked")
            kick_seen = time.monotonic()
            assert sorted(e["data"]["name"] for e in events) == sorted(attached_at)
            stamps = [e["ts"] for e in events]
            spread = max(stamps) - min(stamps)
            assert spread < STALL, f"kicks spread over {spread:.2f}s: they waited for each other"
            for event in events:
                data = event["data"]
                waited = event["ts"] - attached_at[data["name"]]
                assert STALL * 0.9 <= waited <= STALL + 1.0, (waited, event)
                assert STALL * 0.9 <= data["blocked_for"] <= STALL + 1.0, event

            async def rows_kicked() -> list[dict[str, Any]]:
                rows = await api.call("GET", "/consumers")
                rows = [r for r in rows if r["name"] in attached_at]
                return rows if all(r["state"] == "kicked" for r in rows) else []

            rows = await _poll(rows_kicked, 1.0, "the ghosts' rows to show them kicked")
            assert len(rows) == 10, rows

            await healthy.finish()
            gaps = healthy.check((first_attach, kick_seen + 0.2))
            print(f"10 kicks spread over {spread:.3f}s; healthy max gaps {gaps}")
            assert len(await _kicked_events(sbx, pid)) == 10
        finally:
            await healthy.close()
            for ghost in ghosts:
                ghost.close()
            await api.aclose()


# -- c. slow but draining --------------------------------------------------------------

SLOW_LINE = 16 * 1024
SLOW_LINES = 1000  # a 16 KB line every 5 ms: ~3 MB/s, far faster than the slow reader

STEADY = """
import sys, time
out = sys.stdout.buffer
size, n = int(sys.argv[1]), int(sys.argv[2])
for i in range(n):
    out.write(b"%08d " % i + bytes([65 + i % 26]) * (size - 10) + b"\\n")
    out.flush()
    time.sleep(0.005)  # sleep-ok: the child writes at a steady rate
"""


def steady_output(size: int, n: int) -> bytes:
    return b"".join(
        str(i).zfill(8).encode() + b" " + bytes([65 + i % 26]) * (size - 10) + b"\n"
        for i in range(n)
    )


@pytest.mark.slow
@pytest.mark.timeout(30)
async def test_slow_consumer_that_keeps_draining_is_never_kicked(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        reader: socket.socket | None = None
        info = await sbx.commands.start(
            [sys.executable, "-c", STEADY, str(SLOW_LINE), str(SLOW_LINES)]
        )
        try:
            path = f"/sandboxes/{sbx.sandbox_id}/processes/{info.pid}/stream?cursor=0&name=slow"
            reader = _attach_raw(conn["url"], conn["token"], path)
            reader.setblocking(False)
            loop = asyncio.get_running_loop()
            body = bytearray()
            chunked = ChunkedDecoder()

            async def read_slowly(seconds: float) -> None:
                # 4 KB every 15 ms (~270 KB/s): behind the writer all along, never stopping.
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    piece = await loop.sock_recv(reader, 4096)
                    assert piece, "the daemon closed the slow consumer's stream"
                    body.extend(chunked.feed(piece))
                    await asyncio.sleep(0.015)  # sleep-ok: the slow reader's pace

            samples: list[tuple[float, dict[str, Any]]] = []

            async def watch() -> None:
                while True:
                    rows = await api.call("GET", "/consumers")
                    (row,) = [c for c in rows if c["name"] == "slow"]
                    samples.append((time.monotonic(), row))
                    await asyncio.sleep(0.05)  # sleep-ok: sampling period

            watcher = asyncio.create_task(watch())
            try:
                await read_slowly(3 * STALL)
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)

            # Not kicked, and never shown as kicked or closed.
            assert not await _kicked_events(sbx, info.pid)
            states = {row["state"] for _, row in samples}
            assert states <= {"streaming", "blocked"}, states
            # It was behind: its sends blocked (more than once is the point, at least once
            # is what a 50 ms sampler is sure to see).
            assert "blocked" in states, states
            last = samples[-1][1]
            assert last["lag_bytes"] > 0 and last["cursor"] < last["head"], last
            # Its cursor kept advancing: within every stall_timeout-long window.
            for t, row in samples:
                later = [r for u, r in samples if u >= t + STALL]
                if later:
                    assert later[0]["cursor"] > row["cursor"], (t, row, later[0])

            # What it read is a valid prefix of the stream: start, then data frames in
            # order whose payloads are exactly the beginning of the output.
            frames = FrameDecoder().feed(bytes(body))
            assert frames[0].kind is FrameKind.START
            data = [f for f in frames[1:] if f.kind is FrameKind.DATA]
            assert len(data) == len(frames) - 1, {f.kind for f in frames}
            assert [f.meta["seq"] for f in data] == list(range(len(data)))
            got = b"".join(f.payload for f in data)
            assert len(got) > 10 * SLOW_LINE
            assert got == steady_output(SLOW_LINE, SLOW_LINES)[: len(got)]
            print(f"slow consumer read {len(body)} bytes; states {states}")
        finally:
            if reader is not None:
                reader.close()
            with contextlib.suppress(Exception):
                await sbx.commands.kill(info.pid)
            await api.aclose()


# -- d. the SDK reattaches after a kick ------------------------------------------------

BIG_LINES = 80_000  # 100 bytes each: 8 MB, all retained
BIG_LINE = 100

FAST = """
import sys
out = sys.stdout.buffer
n = int(sys.argv[1])
for start in range(0, n, 1000):
    out.write(b"".join(
        b"%08d %s\\n" % (i, bytes([65 + i % 26]) * 90)
        for i in range(start, min(start + 1000, n))
    ))
out.flush()
"""


def fast_output(n: int) -> str:
    return "".join(f"{i:08d} " + chr(65 + i % 26) * 90 + "\n" for i in range(n))


@pytest.mark.timeout(30)
async def test_sdk_reattaches_from_its_cursor_after_a_kick(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        unblock = asyncio.Event()
        chunks: list[str] = []

        async def on_stdout(text: str) -> None:
            chunks.append(text)
            # The first chunk blocks the stream's reader for longer than stall_timeout:
            # the daemon sees a consumer that stopped reading.
            await unblock.wait()

        info = await sbx.commands.start([sys.executable, "-c", FAST, str(BIG_LINES)])
        handle = await sbx.commands.connect(info.pid, cursor=0, on_stdout=on_stdout, lines=False)
        try:

            async def kicked() -> list[dict[str, Any]]:
                return await _kicked_events(sbx, info.pid)

            (event,) = await _poll(kicked, STALL + 10, "the blocked SDK consumer to be kicked")
            assert event["data"]["blocked_for"] >= STALL * 0.9
            assert len(chunks) == 1  # still blocked in the first callback
            unblock.set()
            result = await asyncio.wait_for(handle.wait(), 20)
        finally:
            unblock.set()
            await handle.disconnect()

        expected = fast_output(BIG_LINES)
        assert result.exit_code == 0
        text = "".join(chunks)
        assert len(text) == len(expected)
        assert text == expected
        assert result.stdout == expected
        stats = handle.stream.stats
        # The kick was answered by a reattach (the kicked frame itself is best effort: the
        # stream may simply end), from the cursor, with nothing lost.
        assert stats.attaches >= 2, stats
        assert stats.kicks + stats.disconnects >= 1, stats
        assert stats.gaps == 0 and stats.bytes_lost == 0, stats
        api = ApiClient(conn["url"], conn["token"])
        try:
            rows = await api.call("GET", f"/sandboxes/{sbx.sandbox_id}/consumers")
        finally:
            await api.aclose()
        consumers = [c for c in rows if c["pid"] == info.pid]
        assert sum(1 for c in consumers if c["state"] == "kicked") == 1, consumers
        print(f"SDK stats after kick: {stats}")
