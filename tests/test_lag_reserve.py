"""The reserve a log's cache borrows from (sandboxkit/daemon/lag_reserve.py): the slowest
reader at the cache's edge goes on reading from memory, not from the segment files, as
long as the daemon-wide reserve lends; the memory goes back once it moves on or leaves,
and every log shares the one reserve."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support import fast_config, stream_payload, wait_until

from sandboxkit.daemon import sandbox as sandbox_module
from sandboxkit.daemon.chunks import CHUNK_OVERHEAD
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.lag_reserve import LagLoan, LagReserve
from sandboxkit.daemon.output_log import Chunk, OutputLog
from sandboxkit.daemon.segment_store import SegmentStore
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.wire import FrameDecoder, FrameKind

BLOCK = 16 << 10
CACHE = 64 << 10


@pytest.fixture
def daemon_config() -> DaemonConfig:
    return fast_config(output_cache_bytes=256 << 10)


@dataclass
class _Reader:
    cursor: int
    closed_at: float | None = None


def _log(
    tmp_path: Path,
    name: str,
    reserve: LagReserve,
    readers: dict[str, _Reader],
    spans: Callable[[], bool] | None = None,
) -> OutputLog:
    log = OutputLog(8 << 20, charge_overhead=True, directory=tmp_path / name, cache_bytes=CACHE)
    log.lag = LagLoan(reserve, readers, spans)
    return log


def _append(log: OutputLog, blocks: int) -> list[Chunk]:
    appended = []
    for _ in range(blocks):
        chunk = log.append("stdout", bytes([log.head % 251]) * BLOCK)
        assert chunk is not None
        appended.append(chunk)
    return appended


def _unlent(tmp_path: Path, blocks: int) -> int:
    """What a log holds in memory, with no reader, after ``blocks`` appends."""
    log = _log(tmp_path, "unlent", LagReserve(0), {})
    _append(log, blocks)
    try:
        return log.memory_bytes
    finally:
        log.close()


def _from_memory(log: OutputLog, cursor: int, appended: list[Chunk]) -> bool:
    """Whether a reader at ``cursor`` gets the very chunks appended (the cache), not
    copies read back from the files; either way, the same bytes."""
    _gap, chunks = log.read(cursor, BLOCK)
    assert [c.data for c in chunks] == [appended[cursor].data]
    return chunks[0] is appended[cursor]


def test_the_slowest_reader_at_the_cache_edge_reads_from_memory_while_the_reserve_lends(
    tmp_path: Path,
) -> None:
    reserve, reader = LagReserve(256 << 10), _Reader(0)
    log = _log(tmp_path, "a", reserve, {"r": reader})
    appended = _append(log, 16)  # 256 KiB: four times the cache
    assert _from_memory(log, 0, appended)
    assert log.memory_bytes > CACHE and 0 < reserve.lent <= reserve.limit
    # Once it moved on, the oldest chunks go, down to its own.
    lent, reader.cursor = reserve.lent, 3
    log.readers_moved()
    assert reserve.lent == lent - sum(c.frame_size + CHUNK_OVERHEAD for c in appended[:3])
    assert _from_memory(log, 3, appended)
    # Once the reserve is spent, the reader falls behind the cache onto the files, and
    # the cache is back to its size.
    appended += _append(log, 32)
    assert reserve.lent == 0 and log.memory_bytes <= _unlent(tmp_path, 48) + BLOCK
    assert not _from_memory(log, 3, appended) and not _from_memory(log, 2, appended)
    log.close()


def test_without_a_reader_at_the_edge_the_cache_keeps_its_size(tmp_path: Path) -> None:
    reserve = LagReserve(1 << 20)
    log = _log(tmp_path, "a", reserve, {"gone": _Reader(0, closed_at=1.0)})
    appended = _append(log, 16)
    assert not _from_memory(log, 0, appended) and reserve.lent == 0


def test_nothing_is_kept_for_readers_sent_spans_of_the_files(tmp_path: Path) -> None:
    # (An isolated sandbox's log: its readers behind the newest output get sendfile spans,
    # not the cache: sandboxkit/daemon/file_span.py.)
    reserve = LagReserve(1 << 20)
    log = _log(tmp_path, "a", reserve, {"r": _Reader(0)}, spans=lambda: True)
    _append(log, 16)
    assert reserve.lent == 0


def test_what_was_borrowed_goes_back_when_the_reader_moves_on_leaves_or_the_log_closes(
    tmp_path: Path,
) -> None:
    reserve, readers = LagReserve(1 << 20), {"r": _Reader(0)}
    log = _log(tmp_path, "a", reserve, readers)
    _append(log, 16)
    assert reserve.lent > 0
    readers["r"].cursor = 16  # it read everything: its next read (nothing new) gives it back
    assert log.read(16, BLOCK) == (None, [])
    assert reserve.lent == 0 and log.memory_bytes <= _unlent(tmp_path, 16) + BLOCK

    _append(log, 16)
    assert reserve.lent > 0
    readers["r"].closed_at = 1.0  # it left (its consumer closed), with no output since
    log.readers_moved()
    assert reserve.lent == 0

    readers["s"] = _Reader(32)
    _append(log, 16)
    assert reserve.lent > 0
    log.close()
    assert reserve.lent == 0


def test_every_log_borrows_from_the_one_reserve(tmp_path: Path) -> None:
    reserve = LagReserve(320 << 10)
    first_reader, second_reader = _Reader(0), _Reader(0)
    first = _log(tmp_path, "a", reserve, {"r": first_reader})
    second = _log(tmp_path, "b", reserve, {"r": second_reader})
    first_chunks = _append(first, 22)  # 22 × 16 KiB: most of the reserve beyond its cache
    second_chunks = _append(second, 8)
    assert _from_memory(first, 0, first_chunks)
    assert not _from_memory(second, 0, second_chunks)  # nothing left to lend
    assert reserve.lent <= reserve.limit
    first_reader.cursor, second_reader.cursor = 22, 8  # each read its log to the end
    first.readers_moved()
    second_chunks += _append(second, 8)
    assert _from_memory(second, 8, second_chunks)  # lent now that the first gave back
    first.close()
    second.close()
    assert reserve.lent == 0


@pytest.mark.timeout(60)
def test_a_consumer_that_paused_gets_the_rest_from_memory_not_the_files(
    daemon: DaemonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox_module, "LAG_RESERVE", reserve := LagReserve(64 << 20))
    loads: list[int] = []
    real = SegmentStore._load

    def counting(self: SegmentStore, *args: object, **kwargs: object) -> object:
        loads.append(1)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SegmentStore, "_load", counting)
    blocks = 384  # 24 MiB, more than the socket buffers hold for a reader that pauses
    write = (
        "import sys\nsys.stdin.readline()\n"
        f"for i in range({blocks}): sys.stdout.buffer.write(bytes([i % 251]) * 65536)\n"
    )
    expected = b"".join(bytes([i % 251]) * 65536 for i in range(blocks))
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=30) as http:
        sid = http.post("/sandboxes", json={"isolation": "none"}).json()["sandbox_id"]
        body = {"argv": [sys.executable, "-c", write]}
        pid = http.post(f"/sandboxes/{sid}/processes", json=body).json()["pid"]
        log = daemon.host.sandboxes[sid].processes[pid].log
        decoder = FrameDecoder()
        with http.stream("GET", f"/sandboxes/{sid}/processes/{pid}/stream?cursor=0") as r:
            raw = r.iter_raw()
            for frame in decoder.feed(next(raw)):  # attached: its first frame
                assert frame.kind != FrameKind.DATA
            go = {"session": "go", "seq": 0, "data": "Cg=="}
            assert http.post(f"/sandboxes/{sid}/processes/{pid}/stdin", json=go).is_success
            wait_until(lambda: log.ended, 20, "the writer's end, the reader paused")
            assert reserve.lent > 0  # the cache kept what the paused reader has not read
            payload = stream_payload(raw, decoder)
        http.delete(f"/sandboxes/{sid}")
    assert payload == expected
    assert loads == [], "read back from the files"
    wait_until(lambda: reserve.lent == 0, 10, "the cache to give back what it borrowed")
