"""Gaps (F3): retention is bounded, and a consumer whose cursor fell behind it gets an
explicit ``gap`` frame saying exactly how many bytes it lost, then continues with the
oldest retained chunk — never a silent skip. The SDK surfaces gaps through ``on_gap``
(a callback, or ``"raise"``)."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import ChunkedDecoder, fast_config
from support import poll as _poll

from sandboxkit import AsyncSandbox, OutputGap
from sandboxkit.client.api import ApiClient
from sandboxkit.client.stream import GapInfo, gap_marker
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.errors import OutputGapWarning, OutputIncomplete
from sandboxkit.wire import Frame, FrameDecoder, FrameKind

RETENTION = 64 * 1024
LINE = 5000
LINES = 200  # 1 MB: about 15 × the retention
TOTAL = LINE * LINES

# Numbered fixed-size lines (so any piece of output shows where it belongs), written one
# at a time with a short pause, so that chunks stay small (about one line each), once stdin
# says go.
WRITER = """
import sys, time
out = sys.stdout.buffer
size, n = int(sys.argv[1]), int(sys.argv[2])
sys.stdin.readline()
for i in range(n):
    out.write(b"%08d " % i + bytes([65 + i % 26]) * (size - 10) + b"\\n")
    out.flush()
    time.sleep(0.001)  # sleep-ok: poll interval
"""


def expected_output() -> bytes:
    return b"".join(
        str(i).zfill(8).encode() + b" " + bytes([65 + i % 26]) * (LINE - 10) + b"\n"
        for i in range(LINES)
    )


@pytest.fixture
def daemon_config() -> DaemonConfig:
    # Small retention; a stall timeout long enough that a consumer that pauses reading
    # falls behind retention without being kicked.
    return fast_config(retention_bytes=RETENTION, stall_timeout=30.0)


async def _read_all(api: ApiClient, path: str, **query: Any) -> list[Frame]:
    """Every frame of one stream, through its end frame."""
    frames: list[Frame] = []
    async with api.stream(path, **query) as stream:
        async for frame in stream:
            frames.append(frame)
            if frame.kind in (FrameKind.END, FrameKind.ERROR):
                return frames
    raise AssertionError("stream ended without an end frame")


class _Run:
    """The writer, with a recorder consumer attached from seq 0 before it writes. Every
    data frame the recorder gets is checked against the known output, so its (seq, offset,
    size) are ground truth for chunk boundaries; gaps it may get itself are checked too."""

    def __init__(self, sbx: AsyncSandbox, api: ApiClient) -> None:
        self.sbx, self.api = sbx, api
        self.pid = -1
        self.known: dict[int, tuple[int, int]] = {}  # seq -> (offset, size)

    @property
    def path(self) -> str:
        return f"/sandboxes/{self.sbx.sandbox_id}/processes/{self.pid}/stream"

    async def start(self) -> None:
        info = await self.sbx.commands.start([sys.executable, "-c", WRITER, str(LINE), str(LINES)])
        self.pid = info.pid
        recorder = asyncio.create_task(_read_all(self.api, self.path, cursor=0, name="recorder"))

        async def attached() -> bool:
            rows = await self.api.call("GET", f"/sandboxes/{self.sbx.sandbox_id}/consumers")
            return any(r["name"] == "recorder" and r["closed_at"] is None for r in rows)

        await _poll(attached, 10, "the recorder to attach")
        await self.sbx.commands.send_stdin(self.pid, "go\n")
        frames = await asyncio.wait_for(recorder, 20)
        assert frames[-1].kind is FrameKind.END and frames[-1].meta["exit_code"] == 0
        expected = expected_output()
        position = 0  # bytes accounted for: received or declared lost
        next_seq = 0
        for frame in frames[1:-1]:
            if frame.kind is FrameKind.GAP:
                assert frame.meta["cursor"] == next_seq
                next_seq = frame.meta["first_available"]
                position += frame.meta["bytes_lost"]
            else:
                assert frame.kind is FrameKind.DATA, frame
                seq, offset, size = frame.meta["seq"], frame.meta["offset"], len(frame.payload)
                assert seq == next_seq and offset == position
                assert frame.payload == expected[offset : offset + size]
                self.known[seq] = (offset, size)
                next_seq, position = seq + 1, offset + size
        assert position == TOTAL
        self.known[next_seq] = (TOTAL, 0)  # the head

    def offset(self, seq: int) -> int:
        """Bytes the process wrote before chunk ``seq``."""
        return self.known[seq][0]

    async def info(self) -> dict[str, Any]:
        return dict(await self.api.call("GET", self.path.removesuffix("/stream")))

    async def gap_events(self, name: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in await self.sbx.raw_events()
            if e["kind"] == "consumer.gap"
            and e["pid"] == self.pid
            and (name is None or e["data"]["name"] == name)
        ]


@pytest.fixture
async def run(conn: dict[str, str]) -> AsyncIterator[_Run]:
    """A sandbox whose writer has run to its end, with the recorder's ground truth."""
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        try:
            started = _Run(sbx, api)
            await started.start()
            yield started
        finally:
            await api.aclose()


def _check_gap_then_data(frames: list[Frame], run: _Run, cursor: int) -> Frame:
    """``start``, one ``gap`` from ``cursor`` to the oldest retained chunk with exactly the
    bytes in between, then every retained chunk and ``end``: received + lost == written."""
    kinds = [f.kind for f in frames]
    assert kinds[0] is FrameKind.START and kinds[1] is FrameKind.GAP, kinds[:3]
    assert kinds[-1] is FrameKind.END and frames[-1].meta["exit_code"] == 0
    assert set(kinds[2:-1]) == {FrameKind.DATA}, kinds
    gap = frames[1].meta
    first = gap["first_available"]
    assert gap["cursor"] == cursor
    assert cursor < first < max(run.known)
    assert gap["bytes_lost"] == run.offset(first) - run.offset(cursor) > 0
    data = frames[2:-1]
    assert [f.meta["seq"] for f in data] == list(range(first, max(run.known)))
    received = b"".join(f.payload for f in data)
    # The data after the gap runs to the end of the output, so its length alone says
    # where it starts.
    assert received == expected_output()[TOTAL - len(received) :]
    assert data[0].meta["offset"] == TOTAL - len(received)
    assert run.offset(cursor) + gap["bytes_lost"] + len(received) == TOTAL
    assert len(received) <= RETENTION  # bounded: the rest really was evicted
    return frames[1]


@pytest.mark.timeout(30)
async def test_consumer_behind_retention_gets_an_exact_gap_frame(run: _Run) -> None:
    api = run.api
    info = await run.info()
    first = info["first_seq"]
    assert first > 2 and info["evicted_bytes"] == TOTAL - sum(
        size for seq, (_, size) in run.known.items() if seq >= first
    )

    # From the very beginning, and from the middle of the evicted range (a chunk
    # whose offset the recorder saw).
    middle = min((s for s in run.known if 0 < s < first), key=lambda s: abs(s - first // 2))
    for cursor in (0, middle):
        frames = await _read_all(api, run.path, cursor=cursor, name=f"late{cursor}")
        gap = _check_gap_then_data(frames, run, cursor)
        assert gap.meta["first_available"] == first

    # Each gap is journaled with the same numbers.
    for cursor in (0, middle):
        (event,) = await run.gap_events(f"late{cursor}")
        data = event["data"]
        assert (data["cursor"], data["first_available"]) == (cursor, first)
        assert data["bytes_lost"] == run.offset(first) - run.offset(cursor)

    # A cursor inside retention gets no gap.
    frames = await _read_all(api, run.path, cursor=info["first_seq"], name="fresh")
    assert FrameKind.GAP not in [f.kind for f in frames]
    assert not await run.gap_events("fresh")


@pytest.mark.timeout(30)
async def test_attached_consumer_that_falls_behind_retention_gets_a_gap(
    conn: dict[str, str],
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        sock: socket.socket | None = None
        try:
            info = await sbx.commands.start([sys.executable, "-c", WRITER, str(LINE), str(LINES)])
            pid = info.pid
            # A consumer attached from seq 0 that does not read while the process writes
            # 1 MB: its socket buffers hold far less, so retention passes its cursor.
            host, port = conn["url"].removeprefix("http://").rsplit(":", 1)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(10)
            sock.connect((host, int(port)))
            path = f"/sandboxes/{sbx.sandbox_id}/processes/{pid}/stream?cursor=0&name=paused"
            auth = f"Authorization: Bearer {conn['token']}"
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n\r\n".encode())

            async def attached() -> bool:
                rows = await api.call("GET", f"/sandboxes/{sbx.sandbox_id}/consumers")
                return any(r["name"] == "paused" for r in rows)

            await _poll(attached, 10, "the consumer to attach")
            await sbx.commands.send_stdin(pid, "go\n")

            async def exited() -> bool:
                return (await sbx.commands.get(pid)).state == "exited"

            await _poll(exited, 20, "the writer to exit")
            proc = await api.call("GET", f"/sandboxes/{sbx.sandbox_id}/processes/{pid}")
            assert proc["evicted_bytes"] > 0

            # Now it reads everything.
            def read_to_end() -> bytes:
                raw = bytearray()
                while b"\r\n\r\n" not in raw:
                    raw += sock.recv(65536)
                head, _, rest = bytes(raw).partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head
                chunked = ChunkedDecoder()
                body = bytearray(chunked.feed(rest))
                while not chunked.done:
                    piece = sock.recv(65536)
                    if not piece:
                        break
                    body += chunked.feed(piece)
                return bytes(body)

            frames = FrameDecoder().feed(await asyncio.to_thread(read_to_end))
            kinds = [f.kind for f in frames]
            assert kinds[0] is FrameKind.START and kinds[-1] is FrameKind.END, kinds
            assert kinds.count(FrameKind.GAP) == 1, kinds
            at = kinds.index(FrameKind.GAP)
            before = frames[1:at]
            after = frames[at + 1 : -1]
            assert before and after
            assert {f.kind for f in before + after} == {FrameKind.DATA}
            gap = frames[at].meta
            # Data up to the gap is contiguous from 0; the gap starts where it stopped and
            # ends where the data resumes; the bytes it names are exactly the ones missing.
            assert [f.meta["seq"] for f in before] == list(range(len(before)))
            assert gap["cursor"] == len(before)
            assert after[0].meta["seq"] == gap["first_available"] > gap["cursor"]
            assert [f.meta["seq"] for f in after] == list(
                range(gap["first_available"], gap["first_available"] + len(after))
            )
            got_before = b"".join(f.payload for f in before)
            got_after = b"".join(f.payload for f in after)
            assert after[0].meta["offset"] == len(got_before) + gap["bytes_lost"]
            expected = expected_output()
            assert got_before == expected[: len(got_before)]
            assert got_after == expected[len(got_before) + gap["bytes_lost"] :]
            assert len(got_before) + gap["bytes_lost"] + len(got_after) == TOTAL
            assert gap["bytes_lost"] > 0

            events = [
                e for e in await sbx.raw_events() if e["kind"] == "consumer.gap" and e["pid"] == pid
            ]
            assert len(events) == 1
            assert events[0]["reason"] == gap.pop("reason") == "evicted"
            assert {k: events[0]["data"][k] for k in gap} == gap
        finally:
            if sock is not None:
                sock.close()
            await api.aclose()


@pytest.mark.timeout(30)
async def test_sdk_reports_gaps_to_on_gap(run: _Run) -> None:
    sbx = run.sbx
    first = (await run.info())["first_seq"]
    lost = run.offset(first)

    gaps: list[GapInfo] = []
    text: list[str] = []
    handle = await sbx.commands.connect(
        run.pid, cursor=0, on_stdout=text.append, on_gap=gaps.append, lines=False
    )
    result = await asyncio.wait_for(handle.wait(), 20)
    assert gaps == [GapInfo(cursor=0, first_available=first, bytes_lost=lost)]
    assert result.exit_code == 0
    received = "".join(text).encode()
    assert received == expected_output()[lost:]
    assert lost + len(received) == TOTAL
    assert result.stdout.encode() == received
    assert handle.stream.stats.gaps == 1
    assert handle.stream.stats.bytes_lost == lost
    assert handle.stream.gaps == gaps

    # on_gap="raise": the handle's wait raises OutputGap with the same numbers.
    handle = await sbx.commands.connect(run.pid, cursor=0, on_gap="raise")
    with pytest.raises(OutputGap) as caught:
        await asyncio.wait_for(handle.wait(), 20)
    error = caught.value
    assert (error.pid, error.cursor, error.first_available, error.bytes_lost) == (
        run.pid,
        0,
        first,
        lost,
    )
    assert handle.stdout == ""  # nothing delivered past an unhandled gap
    # Both SDK streams' gaps were journaled.
    events = [e["data"] for e in await run.gap_events() if e["data"]["cursor"] == 0]
    assert [(e["first_available"], e["bytes_lost"]) for e in events] == [(first, lost)] * 2


@pytest.mark.timeout(30)
async def test_sdk_gap_is_visible_by_default(run: _Run) -> None:
    sbx = run.sbx
    first = (await run.info())["first_seq"]
    lost = run.offset(first)

    # No on_gap: a typed warning, and a marker where the bytes are missing.
    with pytest.warns(OutputGapWarning, match=f"{lost} bytes"):
        handle = await sbx.commands.connect(run.pid, cursor=0)
        await asyncio.wait_for(handle.wait(), 20)
    gap = GapInfo(cursor=0, first_available=first, bytes_lost=lost)
    assert handle.stdout == gap_marker(gap) + expected_output()[lost:].decode()
    assert handle.stdout_bytes == expected_output()[lost:]  # bytes stay exact

    # keep_output bounds what a handle keeps: the newest bytes.
    handle = await sbx.commands.connect(run.pid, first, keep_output=10_000)
    await asyncio.wait_for(handle.wait(), 20)
    assert handle.stdout_bytes == expected_output()[-10_000:]
    assert handle.result().bytes_lost == TOTAL - lost - 10_000


@pytest.mark.timeout(30)
async def test_foreground_run_never_returns_incomplete_output(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        # A foreground run whose reader stalls (its callback blocks) while the process
        # writes 15 × the retention: the daemon evicts what it has not read.
        release = asyncio.Event()

        async def slow(line: str) -> None:
            await release.wait()

        async def exited() -> bool:
            return (await sbx.commands.get(proc.pid)).state == "exited"

        # 8 MB: more than a stalled reader's buffers can hold (the client's socket takes
        # up to 2 MiB once it has kept up, raw_stream.py, and the daemon's send buffer
        # some more): with the 1 MB of the other tests, a reader whose buffer had grown
        # took it all in its kernel before the daemon saw it behind, and nothing was lost.
        lines = 8 * LINES
        total = LINE * lines
        cmd = [sys.executable, "-c", WRITER, str(LINE), str(lines)]
        # The gap reaches the reader after its stalled line, or (on a loaded machine,
        # where it read nothing before the eviction) before its first: warned either way.
        with pytest.warns(OutputGapWarning):
            running = asyncio.create_task(sbx.commands.run(cmd, on_stdout=slow))
            (proc,) = await _poll(sbx.commands.list, 10, "the process to start")
            await sbx.commands.send_stdin(proc.pid, "go\n")
            await _poll(exited, 20, "the writer to exit")
            release.set()
            with pytest.raises(OutputIncomplete) as caught:
                await asyncio.wait_for(running, 20)
        error = caught.value
        assert error.result is not None and error.exit_code == 0
        # Received + lost = written; the result marks where the bytes are missing.
        assert error.bytes_lost and 0 < error.bytes_lost < total
        assert f"{error.bytes_lost} bytes" in str(error)
        markers = re.findall(
            r"\n\[sandboxkit: (\d+) bytes of output lost here\]\n", error.result.stdout
        )
        assert markers and sum(map(int, markers)) == error.bytes_lost
        received = re.sub(r"\n\[sandboxkit: .*\]\n", "", error.result.stdout).encode()
        assert len(received) + error.bytes_lost == total

        # Keeping less than the output is incomplete too, and says so.
        with pytest.raises(OutputIncomplete) as caught:
            await sbx.commands.run(["printf", "x%.0s", *["1"] * 100], keep_output=10)
        assert caught.value.bytes_lost == 90
        assert caught.value.result is not None and caught.value.result.stdout == "x" * 10
