"""OutputLog: sequence numbers, byte offsets, bounded reads, retention, gaps, finish, wait."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import poll

from sandboxkit.daemon import heap, segment_store, write_behind
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.output_log import Chunk, Gap, OutputLog
from sandboxkit.daemon.process import ManagedProcess, ProcessSpec
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.segment_store import SegmentStore
from sandboxkit.wire import Frame, FrameDecoder, FrameKind, encode_frame_head

_BIG = 10**9  # a retention nothing in these tests reaches

_appends = st.lists(
    st.tuples(st.sampled_from(["stdout", "stderr", "pty"]), st.binary(max_size=60)),
    max_size=40,
)


def _fill(log: OutputLog, appends: list[tuple[str, bytes]]) -> list[bytes]:
    """Append everything; return the data of each chunk the log accepted, by seq."""
    accepted: list[bytes] = []
    for stream, data in appends:
        chunk = log.append(stream, data)
        if data:
            assert chunk is not None
            assert chunk.seq == len(accepted)
            accepted.append(data)
        else:
            assert chunk is None
    return accepted


def _finished_now(coro: Coroutine[Any, Any, bool]) -> bool:
    """Run ``coro`` one step: it must return without ever suspending."""
    try:
        coro.send(None)
    except StopIteration as done:
        return bool(done.value)
    coro.close()
    raise AssertionError("the coroutine suspended instead of returning at once")


async def _blocked(task: asyncio.Task[bool]) -> None:
    """Let ``task`` run up to its first suspension; it must still be waiting."""
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done(), "wait() returned although nothing happened"


# -- sequence numbers and offsets -------------------------------------------------------


def test_seq_is_monotonic_and_per_log() -> None:
    a, b = OutputLog(_BIG), OutputLog(_BIG)
    seen_a: list[int] = []
    seen_b: list[int] = []
    for i in range(10):
        chunk_a = a.append("stdout", b"a" * (i + 1))
        assert chunk_a is not None
        seen_a.append(chunk_a.seq)
        if i % 3 == 0:
            chunk_b = b.append("stderr", b"b")
            assert chunk_b is not None
            seen_b.append(chunk_b.seq)
    assert seen_a == list(range(10))
    assert seen_b == list(range(4))
    assert (a.head, b.head) == (10, 4)
    # Empty output is not a chunk and uses no sequence number.
    assert a.append("stdout", b"") is None
    assert a.head == 10
    assert a.append("stdout", b"x").seq == 10  # type: ignore[union-attr]


def test_offsets_are_cumulative_over_all_streams() -> None:
    log = OutputLog(_BIG)
    datas = [(b"hello", "stdout"), (b"!", "stderr"), (b"\x00\xff" * 7, "stdout"), (b"p", "pty")]
    before = time.time()
    chunks = [log.append(stream, data) for data, stream in datas]
    after = time.time()
    expected_offset = 0
    for chunk, (data, stream) in zip(chunks, datas, strict=True):
        assert isinstance(chunk, Chunk)
        assert (chunk.stream, chunk.data, chunk.offset) == (stream, data, expected_offset)
        assert before <= chunk.ts <= after
        assert log.offset_of(chunk.seq) == expected_offset
        # The chunk's ready-made ``data`` frame says the same thing on the wire.
        (frame,) = FrameDecoder().feed(chunk.frame)
        assert frame == Frame(
            FrameKind.DATA,
            {"seq": chunk.seq, "stream": stream, "offset": expected_offset, "ts": chunk.ts},
            data,
        )
        expected_offset += len(data)
    assert [c.ts for c in chunks] == sorted(c.ts for c in chunks)  # type: ignore[union-attr]
    assert log.total_bytes == expected_offset == log.retained_bytes
    assert log.offset_of(log.head) == log.offset_of(log.head + 5) == expected_offset


# -- bounded reads -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    data=st.data(),
)
def test_read_returns_at_least_one_chunk_and_respects_max_bytes(
    sizes: list[int], data: st.DataObject
) -> None:
    log = OutputLog(_BIG)
    for i, size in enumerate(sizes):
        log.append("stdout", bytes([i % 256]) * size)
    cursor = data.draw(st.integers(0, len(sizes)), label="cursor")
    max_bytes = data.draw(st.integers(1, 120), label="max_bytes")
    gap, chunks = log.read(cursor, max_bytes)
    assert gap is None
    if cursor == len(sizes):
        assert chunks == []
        return
    assert chunks, "a read with data available returns at least one chunk"
    assert [c.seq for c in chunks] == list(range(cursor, cursor + len(chunks)))
    got = sum(len(c.data) for c in chunks)
    if len(chunks) > 1:
        assert got <= max_bytes
    # ... and stops only when the next chunk would not fit (or there is none).
    following = cursor + len(chunks)
    if following < len(sizes):
        assert got + sizes[following] > max_bytes


def test_read_of_oversized_first_chunk_returns_just_it() -> None:
    log = OutputLog(_BIG)
    log.append("stdout", b"x" * 100)
    log.append("stdout", b"y")
    gap, chunks = log.read(0, 10)
    assert gap is None
    assert [c.data for c in chunks] == [b"x" * 100]
    _, rest = log.read(1, 10)
    assert [c.data for c in rest] == [b"y"]


# -- retention and gaps --------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(retention=st.integers(1, 150), appends=_appends)
def test_retention_evicts_oldest_first_within_the_bound(
    retention: int, appends: list[tuple[str, bytes]]
) -> None:
    log = OutputLog(retention)
    sizes: list[int] = []
    datas: list[bytes] = []
    for stream, data in appends:
        log.append(stream, data)
        if not data:
            continue
        sizes.append(len(data))
        datas.append(data)
        first, head = log.first_seq, log.head
        assert head == len(sizes)
        held = sum(sizes[first:head])
        assert log.retained_bytes == held
        assert log.evicted_bytes == sum(sizes[:first])
        assert log.total_bytes == sum(sizes)
        # Within the bound, unless the newest chunk alone is larger than it.
        assert held <= retention or first == head - 1
        # Nothing more than needed was evicted: keeping one more chunk would break the bound.
        if first > 0:
            assert held + sizes[first - 1] > retention
        # What is held is exactly the newest chunks, in order.
        _, chunks = log.read(first, _BIG)
        assert [c.data for c in chunks] == datas[first:]


def test_single_oversized_chunk_is_kept_until_the_next_one() -> None:
    log = OutputLog(10)
    log.append("stdout", b"z" * 50)
    assert (log.first_seq, log.retained_bytes) == (0, 50)
    assert [c.data for c in log.read(0, _BIG)[1]] == [b"z" * 50]
    log.append("stdout", b"a")
    assert (log.first_seq, log.retained_bytes, log.evicted_bytes) == (1, 1, 50)


def test_gap_reports_exactly_the_evicted_bytes() -> None:
    log = OutputLog(20)
    sizes = [3, 8, 5, 9, 4, 7, 2]
    for i, size in enumerate(sizes):
        log.append("stdout" if i % 2 else "stderr", bytes([65 + i]) * size)
    first = log.first_seq
    assert 0 < first < len(sizes)
    for cursor in range(first):
        gap, chunks = log.read(cursor, _BIG)
        assert gap == Gap(cursor, first, sum(sizes[cursor:first]))
        assert chunks[0].seq == first
        assert chunks[0].offset == sum(sizes[:first])
    gap, chunks = log.read(first, _BIG)
    assert gap is None and chunks[0].seq == first


@settings(max_examples=200, deadline=None)
@given(
    retention=st.integers(1, 200),
    appends=_appends,
    max_bytes=st.integers(1, 150),
)
def test_every_cursor_accounts_for_every_byte(
    retention: int, appends: list[tuple[str, bytes]], max_bytes: int
) -> None:
    log = OutputLog(retention)
    datas = _fill(log, appends)
    offsets = [sum(len(d) for d in datas[:i]) for i in range(len(datas) + 1)]
    total = offsets[-1]
    assert log.total_bytes == total
    for start in range(log.head + 1):
        lost = 0
        received = b""
        gap, chunks = log.read(start, max_bytes)
        if start < log.first_seq:
            assert gap is not None
            assert (gap.cursor, gap.first_available) == (start, log.first_seq)
            assert gap.bytes_lost == offsets[log.first_seq] - offsets[start]
            lost = gap.bytes_lost
        else:
            assert gap is None
        expected_seq = max(start, log.first_seq)
        while chunks:
            for chunk in chunks:
                assert chunk.seq == expected_seq
                assert chunk.offset == offsets[chunk.seq]
                expected_seq += 1
                received += chunk.data
            gap, chunks = log.read(expected_seq, max_bytes)
            assert gap is None
        assert expected_seq == log.head
        assert lost + len(received) == total - offsets[start]
        assert received == b"".join(datas[max(start, log.first_seq) :])


def test_retention_must_be_positive() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError):
            OutputLog(bad)


# -- finish ----------------------------------------------------------------------------------


def test_finish_is_idempotent_and_final() -> None:
    log = OutputLog(_BIG)
    log.append("stdout", b"before")
    assert not log.ended and log.exit_code is None and log.ended_at is None
    before = time.time()
    log.finish(3)
    assert log.ended and log.exit_code == 3
    assert log.ended_at is not None and log.ended_at >= before
    ended_at = log.ended_at
    log.finish(5)
    log.finish(0)
    assert (log.exit_code, log.ended_at) == (3, ended_at)
    assert log.append("stdout", b"after") is None
    assert log.append("stderr", b"after") is None
    assert (log.head, log.total_bytes) == (1, len(b"before"))
    assert [c.data for c in log.read(0, _BIG)[1]] == [b"before"]


def test_finish_with_zero_is_recorded() -> None:
    log = OutputLog(_BIG)
    log.finish(0)
    log.finish(1)
    assert log.ended and log.exit_code == 0


# -- wait --------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
async def test_wait_returns_at_once_for_existing_seq_and_after_finish() -> None:
    log = OutputLog(_BIG)
    log.append("stdout", b"a")
    log.append("stdout", b"b")
    assert _finished_now(log.wait(0, None)) is True
    assert _finished_now(log.wait(1, None)) is True
    log.finish(0)
    # After the end nothing more will come: any cursor returns at once.
    for cursor in (0, 2, 3, 1000):
        assert _finished_now(log.wait(cursor, None)) is True


@pytest.mark.timeout(10)
async def test_wait_times_out_with_false() -> None:
    log = OutputLog(_BIG)
    log.append("stdout", b"a")
    start = time.monotonic()
    assert await log.wait(1, 0.05) is False
    assert time.monotonic() - start >= 0.04
    assert not log.ended


@pytest.mark.timeout(10)
async def test_wait_is_woken_by_append() -> None:
    log = OutputLog(_BIG)
    first = asyncio.create_task(log.wait(0, 5))
    second = asyncio.create_task(log.wait(0, 5))
    await _blocked(first)
    await _blocked(second)
    log.append("stdout", b"x")
    assert await asyncio.wait_for(asyncio.gather(first, second), 1) == [True, True]

    # An expired waiter does not stop the next one from being woken.
    assert await log.wait(1, 0.01) is False
    third = asyncio.create_task(log.wait(1, 5))
    await _blocked(third)
    log.append("stderr", b"y")
    assert await asyncio.wait_for(third, 1) is True

    # An empty append is no output: it wakes nobody.
    fourth = asyncio.create_task(log.wait(2, 5))
    await _blocked(fourth)
    log.append("stdout", b"")
    await _blocked(fourth)
    log.append("stdout", b"z")
    assert await asyncio.wait_for(fourth, 1) is True


@pytest.mark.timeout(10)
async def test_a_readers_on_wake_runs_in_the_appends_turn_and_its_fault_stays_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A waiting reader's ``on_wake`` runs inside the append that wakes it (a consumer at
    the head sends from there); one that raises costs the producer nothing: the append
    returns, every reader is still woken, and the fault is logged."""
    log = OutputLog(_BIG)
    seen: list[bytes] = []

    def look() -> bool:
        seen.extend(chunk.data for chunk in log.read(0, 100)[1])
        return False  # its task is woken as well

    def fail() -> bool:
        raise RuntimeError("a reader's bug")

    looking = asyncio.create_task(log.wait(0, 5, look))
    failing = asyncio.create_task(log.wait(0, 5, fail))
    await _blocked(looking)
    await _blocked(failing)
    assert log.append("stdout", b"x") is not None
    assert seen == [b"x"]  # before either task ran again
    assert await asyncio.wait_for(asyncio.gather(looking, failing), 1) == [True, True]
    assert "a reader's bug" in caplog.text


@pytest.mark.timeout(10)
async def test_a_reader_whose_on_wake_did_its_work_waits_on_and_its_timeout_restarts() -> None:
    """A reader whose ``on_wake`` sent the new output itself (it returns ``True``) is not
    woken: its task sleeps on through line after line. Its timeout (a consumer's
    keepalive) counts from the last output it took so, and a wake its ``on_wake`` leaves
    to the task (a nudge: nothing new) wakes it. Driven by the loop's clock, set by hand."""
    loop = asyncio.get_running_loop()
    now = [loop.time()]
    log = OutputLog(_BIG)
    taken: list[int] = []

    def take() -> bool:
        chunks = log.read(len(taken), 100)[1]
        taken.extend(chunk.seq for chunk in chunks)
        return bool(chunks)

    with mock.patch.object(loop, "time", lambda: now[0]):
        waiting = asyncio.create_task(log.wait(0, 10, take))
        await _blocked(waiting)
        for line in range(3):
            now[0] += 9  # each line within the timeout of the one before, 27 s in all
            await _blocked(waiting)
            assert log.append("stdout", b"line %d\n" % line) is not None
            await _blocked(waiting)
        assert taken == [0, 1, 2]
        now[0] += 9.5  # 9.5 s since the last line: not yet
        await _blocked(waiting)
        now[0] += 1
        assert await asyncio.wait_for(waiting, 1) is False  # the timeout, from the last line

        waiting = asyncio.create_task(log.wait(3, 10, take))
        await _blocked(waiting)
        log.nudge()  # nothing new for on_wake to take: its task is woken
        assert await asyncio.wait_for(waiting, 1) is True


async def test_a_trickle_is_written_to_disk_in_one_batch_after_its_readers(
    tmp_path: Path,
) -> None:
    """The segment store's work for a chunk (its CRC, its buffering, now and then a file
    write) is not on the way from a process's write to its readers' sockets (P3,
    docs/performance.md): a trickle of lines is written in one batch, ``DELAY`` after
    the first of them, after every reader's turn; bulk output in the next turn; the end
    writes the rest at once. Driven by the loop's clock, set by hand."""
    loop = asyncio.get_running_loop()
    now = [loop.time()]
    log = OutputLog(1 << 22, directory=tmp_path / "log", cache_bytes=1 << 22)
    order: list[str] = []
    write = SegmentStore.write

    def recorded(store: SegmentStore, chunk: Any, cost: int) -> None:
        order.append(f"write {chunk.seq}")
        write(store, chunk, cost)

    async def reader(cursor: int) -> None:
        assert await log.wait(cursor, 5)
        order.append(f"read {cursor}")

    async def turns() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    with (
        mock.patch.object(SegmentStore, "write", recorded),
        mock.patch.object(loop, "time", lambda: now[0]),
    ):
        log.append("stdout", b"a")  # the newest stays unwritten: it may still be extended
        for seq, line in enumerate((b"b", b"c", b"d"), 1):
            task = asyncio.create_task(reader(seq))
            await turns()
            log.append("stderr" if seq % 2 else "stdout", line)
            await task
            await turns()
            now[0] += write_behind.DELAY / 4  # lines a few ms apart
        assert order == ["read 1", "read 2", "read 3"]  # nothing written yet
        now[0] += write_behind.DELAY
        await turns()
        assert order[3:] == ["write 0", "write 1", "write 2"]  # one batch
        del order[:]
        for _ in range(write_behind.BATCH_BYTES // 4096 + 1):  # bulk: at once
            log.append("stderr" if len(order) % 2 else "stdout", b"x" * 4096)
            log.append("stdout", b"y")
        await turns()
        assert order and order[-1] == f"write {log.head - 2}"
        log.append("stderr", b"z")
        log.finish(0)  # the end writes the rest at once
        assert order[-2:] == [f"write {log.head - 2}", f"write {log.head - 1}"]
    assert log.read(0, 100)[1][0].data == b"a" and log.read(3, 100)[1][0].data == b"d"
    log.close()


@pytest.mark.timeout(10)
async def test_wait_is_woken_by_finish() -> None:
    log = OutputLog(_BIG)
    waiter = asyncio.create_task(log.wait(0, 5))
    await _blocked(waiter)
    log.finish(7)
    assert await asyncio.wait_for(waiter, 1) is True
    assert log.exit_code == 7


# -- retention bounds memory, not just payload ---------------------------------------------


@pytest.mark.parametrize("pattern", ["1-byte", "mixed"])
def test_retention_bounds_memory_for_any_write_pattern(pattern: str) -> None:
    import random
    import tracemalloc

    retention = 1024 * 1024
    rng = random.Random(7)
    # About four times what the retention holds (~3,100 1-byte chunks, ~700 mixed ones):
    # the log is measured in its steady state, every chunk it started with evicted.
    writes = [
        b"x" if pattern == "1-byte" else b"y" * rng.choice([1, 3, 40, 700, 5000])
        for _ in range(12_000 if pattern == "1-byte" else 3_000)
    ]
    tracemalloc.start()
    try:
        log = OutputLog(retention, charge_overhead=True)
        before = tracemalloc.get_traced_memory()[0]
        for data in writes:
            log.append("stdout", data)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert log.first_seq >= 2 * (log.head - log.first_seq)  # (the steady state)
    assert log.retained_cost <= retention
    # What the log holds in memory stays within 1.5x the setting (the issue measured
    # ~320 bytes per 1-byte chunk against 1 charged byte: 300x).
    assert held <= 1.5 * retention, f"{held} bytes held for a {retention}-byte retention"
    # ... and it still serves the newest output, byte-exact.
    _, chunks = log.read(log.first_seq, 1 << 30)
    assert b"".join(c.data for c in chunks) == b"".join(writes)[-log.retained_bytes :]


# -- coalescing: tiny writes nobody has read yet share a chunk -----------------------------


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(
                st.just("append"),
                st.sampled_from(["stdout", "stderr"]),
                st.binary(min_size=1, max_size=30),
            ),
            st.tuples(st.just("read"), st.integers(1, 80)),
        ),
        max_size=60,
    ),
    retention=st.sampled_from([_BIG, 300, 2000]),
)
def test_coalescing_is_invisible_to_readers(steps: list[Any], retention: int) -> None:
    log = OutputLog(retention, charge_overhead=retention != _BIG, coalesce=64)
    written: list[tuple[str, bytes]] = []
    cursor, received, lost = 0, b"", 0
    seen_frames: dict[int, bytes] = {}

    def read(max_bytes: int) -> None:
        nonlocal cursor, received, lost
        gap, chunks = log.read(cursor, max_bytes)
        if gap is not None:
            lost += gap.bytes_lost
            cursor = gap.first_available
        for chunk in chunks:
            assert chunk.seq == cursor
            assert chunk.offset == len(received) + lost
            so_far = b"".join(d for _, d in written)
            assert chunk.data == so_far[chunk.offset : chunk.offset + chunk.size]
            (frame,) = FrameDecoder().feed(chunk.frame)
            assert frame.payload == chunk.data and frame.meta["seq"] == chunk.seq
            seen_frames[chunk.seq] = chunk.frame
            received += chunk.data
            cursor += 1

    for step in steps:
        if step[0] == "append":
            log.append(step[1], step[2])
            written.append((step[1], step[2]))
        else:
            read(step[1])
        # A chunk a reader has seen never changes afterwards.
        for seq, frame in seen_frames.items():
            if seq >= log.first_seq:
                assert log.read(seq, 1)[1][0].frame == frame
    read(_BIG)
    everything = b"".join(d for _, d in written)
    assert log.total_bytes == len(everything)
    assert lost + len(received) == len(everything)
    if lost == 0:
        assert received == everything  # byte-exact, in order
    # Chunks never mix streams.
    _, chunks = log.read(log.first_seq, _BIG)
    assert all(c.stream in ("stdout", "stderr") for c in chunks)


def test_unread_tiny_writes_keep_output_not_bookkeeping() -> None:
    retention = 1024 * 1024
    plain = OutputLog(retention, charge_overhead=True)
    joined = OutputLog(retention, charge_overhead=True, coalesce=4096)
    # (About four times the ~3,100 1-byte chunks the setting holds at their true cost.)
    for _ in range(12_000):
        plain.append("stdout", b"x")
        joined.append("stdout", b"x")
    assert joined.retained_cost <= retention and plain.retained_cost <= retention
    # Charged at true cost, 1-byte chunks keep ~0.3% of the setting as output; joined
    # while unread, all of it.
    assert plain.evicted_bytes > 0 and plain.retained_bytes < retention // 100
    assert joined.retained_bytes == 12_000
    # A reader that keeps up sees the output promptly, chunk by chunk as it reads.
    reader = OutputLog(retention, charge_overhead=True, coalesce=4096)
    got = b""
    for i in range(100):
        reader.append("stdout", bytes([65 + i % 26]))
        _, chunks = reader.read(reader.head - 1, _BIG)
        got += chunks[-1].data[-1:]
    assert got == bytes(65 + i % 26 for i in range(100))
    assert reader.head == 100  # every write was read at once: nothing to join


async def test_a_reader_placed_at_the_head_never_misses_a_joined_write() -> None:
    log = OutputLog(_BIG, coalesce=4096)
    log.append("stdout", b"old ")  # unread: the next tiny write could join it ...
    cursor = log.head  # ... but a reader now stands past it, at the head
    log.append("stdout", b"new")
    gap, chunks = log.read(cursor, _BIG)
    assert gap is None and [c.data for c in chunks] == [b"new"]
    # The same for a reader that waits at the head.
    log2 = OutputLog(_BIG, coalesce=4096)
    log2.append("stdout", b"a")
    log2.read(0, _BIG)
    log2.append("stdout", b"b")  # unread, joinable
    # A reader waits past "b" without reading it (it learned the head some other way).
    assert await log2.wait(2, 0.01) is False
    log2.append("stdout", b"c")
    assert [c.data for c in log2.read(2, _BIG)[1]] == [b"c"]


# -- on disk: segment files, a small cache of the newest chunks ------------------------------


def _sha256_from(log: OutputLog, cursor: int, max_bytes: int) -> tuple[str, int, int]:
    """Read everything from ``cursor`` on: (sha256 of the output, bytes lost, chunks)."""
    digest = hashlib.sha256()
    lost = chunks_read = 0
    while True:
        gap, chunks = log.read(cursor, max_bytes)
        if gap is not None:
            lost += gap.bytes_lost
            cursor = gap.first_available
        if not chunks:
            return digest.hexdigest(), lost, chunks_read
        for chunk in chunks:
            assert chunk.seq == cursor
            digest.update(chunk.data)
            cursor += 1
        chunks_read += len(chunks)


def test_default_retention_replays_32_mib_byte_exact_from_cursor_0(tmp_path: Path) -> None:
    config = DaemonConfig()
    log = OutputLog(
        config.retention_bytes,
        charge_overhead=True,
        coalesce=4096,
        directory=tmp_path / "log",
        cache_bytes=config.output_cache_bytes,
    )
    rng = random.Random(10)
    written = hashlib.sha256()
    block = rng.randbytes(1 << 20)
    most_in_memory = 0
    for i in range(32 * 16):
        data = block[(i * 4099) % (1 << 19) :][: 64 * 1024]  # 64 KiB reads, all different
        written.update(data)
        log.append("stdout" if i % 5 else "stderr", data)
        most_in_memory = max(most_in_memory, log.memory_bytes)
    assert log.total_bytes == 32 << 20 and log.evicted_bytes == 0
    # The log holds its output on disk: what it keeps in memory is its cache of the newest
    # chunks (a few MB at most), not the 32 MiB.
    assert most_in_memory <= config.output_cache_bytes + (256 << 10), most_in_memory
    assert config.output_cache_bytes <= 8 << 20
    # ... and replays every byte from cursor 0, byte-exact, from a reader that lags behind
    # the cache and one reading in small steps.
    assert _sha256_from(log, 0, 256 * 1024)[:2] == (written.hexdigest(), 0)
    assert _sha256_from(log, 0, 1)[:2] == (written.hexdigest(), 0)
    log.close()


def test_default_retention_is_at_least_64_mib() -> None:
    assert DaemonConfig().retention_bytes >= 64 << 20


def test_the_log_directory_comes_with_the_first_output(tmp_path: Path) -> None:
    # Most commands print nothing: their log makes no directory (and removes none).
    quiet = OutputLog(1 << 20, directory=tmp_path / "quiet", cache_bytes=64 * 1024)
    quiet.finish(0)
    assert not (tmp_path / "quiet").exists()
    quiet.close()
    chatty = OutputLog(1 << 20, directory=tmp_path / "chatty", cache_bytes=64 * 1024)
    chatty.append("stdout", b"one\n")
    chatty.append("stdout", b"two\n")
    chatty.finish(0)
    assert list((tmp_path / "chatty").glob("*.frames"))
    _, chunks = chatty.read(0, 1 << 20)
    assert b"".join(c.data for c in chunks) == b"one\ntwo\n"
    chatty.close()
    assert not (tmp_path / "chatty").exists()  # removed with the log


def test_a_log_directory_that_cannot_be_made_is_memory_only(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file where the log's directory would go")
    log = OutputLog(1 << 20, directory=tmp_path / "taken", cache_bytes=64 * 1024)
    for line in (b"a\n", b"b\n", b"c\n"):
        log.append("stdout", line)
    assert isinstance(log.disk_error, OSError)  # the first segment could not be made
    _, chunks = log.read(0, 1 << 20)
    assert b"".join(c.data for c in chunks) == b"a\nb\nc\n"  # nothing lost
    log.close()
    assert (tmp_path / "taken").is_file()  # and nothing of anyone else's removed


def test_eviction_deletes_whole_old_segment_files(tmp_path: Path) -> None:
    retention = 1 << 20
    directory = tmp_path / "log"
    log = OutputLog(retention, directory=directory, cache_bytes=64 * 1024)
    data = bytes(range(256)) * 16  # 4 KiB
    for _ in range(8 * 256):  # 8 MiB through a 1 MiB retention
        log.append("stdout", data)
    assert log.evicted_bytes > 6 << 20
    assert log.retained_bytes <= retention
    assert log.retained_bytes + log.evicted_bytes == log.total_bytes
    frames = sum(f.stat().st_size for f in directory.iterdir() if f.suffix == ".frames")
    on_disk = sum(f.stat().st_size for f in directory.iterdir())
    # The frames on disk are the retained chunks' (eviction deleted or reused the older
    # segments' files), and most of the retention is kept (whole segments go, not all).
    assert frames <= retention + retention // 4
    assert on_disk <= retention + retention // 2  # with a spare segment and the indexes
    assert len(list(directory.glob("*.frames"))) <= 10  # 1/8 of the retention each
    assert log.retained_bytes >= retention // 2
    # What is held is the newest output, byte-exact.
    _, chunks = log.read(log.first_seq, 1 << 30)
    assert b"".join(c.data for c in chunks) == data * (log.retained_bytes // len(data))
    log.close()


def _disk_full(fd: int, parts: list[bytes]) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@settings(max_examples=150, deadline=None)
@given(
    retention=st.integers(1, 400),
    cache=st.integers(1, 200),
    appends=_appends,
    max_bytes=st.integers(1, 150),
    disk_full_after=st.none() | st.integers(0, 40),
    turns=st.none() | st.integers(1, 4),
)
def test_on_disk_every_cursor_accounts_for_every_byte(
    retention: int,
    cache: int,
    appends: list[tuple[str, bytes]],
    max_bytes: int,
    disk_full_after: int | None,
    turns: int | None,
) -> None:
    """``turns``: appended in a running event loop, which turns once every ``turns``
    appends (the store is written after the readers' turn: read before that too)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = OutputLog(retention, directory=Path(tmp) / "log", cache_bytes=cache)
        if turns is not None:
            datas = asyncio.run(_fill_in_turns(log, appends, turns, retention, max_bytes))
        elif disk_full_after is None:
            datas = _fill(log, appends)
        else:  # the disk refuses writes from then on: still every byte accounted for
            datas = _fill(log, appends[:disk_full_after])
            with mock.patch.object(segment_store, "_write_all", _disk_full):
                datas += _fill_more(log, appends[disk_full_after:], len(datas))
        assert log.retained_bytes <= retention or log.first_seq == log.head - 1
        _every_cursor(log, appends, datas, max_bytes)
        log.close()
        assert not (Path(tmp) / "log").exists()


async def _fill_in_turns(
    log: OutputLog, appends: list[tuple[str, bytes]], turns: int, retention: int, max_bytes: int
) -> list[bytes]:
    datas: list[bytes] = []
    for i, (stream, data) in enumerate(appends, 1):
        datas += _fill_more(log, [(stream, data)], len(datas))
        if i % turns == 0:
            await asyncio.sleep(0)
            assert log.retained_bytes <= retention or log.first_seq == log.head - 1
    _every_cursor(log, appends, datas, max_bytes)  # (with chunks not yet written)
    await asyncio.sleep(0)
    return datas


def _every_cursor(
    log: OutputLog, appends: list[tuple[str, bytes]], datas: list[bytes], max_bytes: int
) -> None:
    offsets = [sum(len(d) for d in datas[:i]) for i in range(len(datas) + 1)]
    assert log.total_bytes == offsets[-1]
    assert log.retained_bytes + log.evicted_bytes == log.total_bytes
    for start in range(log.head + 1):
        assert log.offset_of(start) == offsets[start]
        gap, chunks = log.read(start, max_bytes)
        lost = 0
        if start < log.first_seq:
            assert gap == Gap(start, log.first_seq, offsets[log.first_seq] - offsets[start])
            lost = gap.bytes_lost
        else:
            assert gap is None
        received = b""
        seq = max(start, log.first_seq)
        while chunks:
            for chunk in chunks:
                assert (chunk.seq, chunk.offset) == (seq, offsets[seq])
                assert chunk.stream == appends_streams(appends)[seq]
                (frame,) = FrameDecoder().feed(chunk.frame)
                assert frame.payload == chunk.data and frame.meta["ts"] == chunk.ts
                assert log.ts_of(seq) == chunk.ts
                received += chunk.data
                seq += 1
            gap, chunks = log.read(seq, max_bytes)
            assert gap is None
        assert seq == log.head
        assert received == b"".join(datas[max(start, log.first_seq) :])
        assert lost + len(received) == offsets[-1] - offsets[start]


def _fill_more(log: OutputLog, appends: list[tuple[str, bytes]], seq: int) -> list[bytes]:
    accepted: list[bytes] = []
    for stream, data in appends:
        chunk = log.append(stream, data)
        assert (chunk is None) == (not data)
        if chunk is not None:
            assert chunk.seq == seq + len(accepted)
            accepted.append(data)
    return accepted


def appends_streams(appends: list[tuple[str, bytes]]) -> list[str]:
    """The stream of each accepted chunk, by seq."""
    return [stream for stream, data in appends if data]


def test_close_removes_the_files_and_gives_back_the_memory(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    log = OutputLog(1 << 20, directory=directory, cache_bytes=256 * 1024)
    for _ in range(100):
        log.append("stdout", b"z" * 10_000)
    log.finish(0)
    assert directory.is_dir() and log.memory_bytes > 0
    log.drop_cache()  # (what a killed sandbox does: its output stays readable, from disk)
    assert log.memory_bytes < 4096
    assert (
        _sha256_from(log, log.first_seq, 1 << 16)[0]
        == hashlib.sha256(b"z" * log.retained_bytes).hexdigest()
    )
    log.close()
    assert not directory.exists()
    assert log.memory_bytes == 0
    # Closed, it is an ended log with nothing retained: a late reader gets a gap, never
    # an error or stale bytes.
    gap, chunks = log.read(0, 1 << 20)
    assert chunks == [] and gap is not None and gap.first_available == log.head
    log.close()  # idempotent


def test_memory_log_keeps_working_without_a_directory() -> None:
    log = OutputLog(1 << 20, cache_bytes=1)  # no directory: everything in memory
    for i in range(10):
        log.append("stdout", bytes([i]) * 100)
    assert [c.data for c in log.read(0, 1 << 20)[1]] == [bytes([i]) * 100 for i in range(10)]
    assert log.memory_bytes >= 1000
    log.close()
    assert log.memory_bytes == 0


# -- in the daemon: a process's log lives in its sandbox's runtime directory ----------------

_WRITE_2_MIB = "import sys; sys.stdout.buffer.write(bytes(range(256)) * 8192)"


async def _run_to_exit(sandbox: ManagedSandbox) -> ManagedProcess:
    process = await sandbox.start_process(ProcessSpec(argv=(sys.executable, "-c", _WRITE_2_MIB)))
    assert await process.wait(20) == 0
    return process


def _replayed(log: OutputLog) -> bytes:
    gap, chunks = log.read(0, 1 << 30)
    assert gap is None
    out = b"".join(c.data for c in chunks)
    while chunks:
        gap, chunks = log.read(chunks[-1].seq + 1, 1 << 30)
        out += b"".join(c.data for c in chunks)
    return out


@pytest.mark.timeout(30)
async def test_a_process_log_is_on_disk_and_goes_when_its_result_expires() -> None:
    config = DaemonConfig(result_ttl=0.5, housekeeping_interval=0.02, kill_grace=1.0)
    async with Host(config) as host:
        sandbox = await host.create_sandbox()
        process = await _run_to_exit(sandbox)
        directory = process.log.directory
        assert directory is not None and directory.parent == sandbox.runtime_dir
        assert sandbox.workdir not in directory.parents  # not where the user's files are
        assert sum(f.stat().st_size for f in directory.glob("*.frames")) > 2 << 20
        assert _replayed(process.log) == bytes(range(256)) * 8192
        assert process.log.memory_bytes <= config.output_cache_bytes + (64 << 10)

        await poll(lambda: process.pid in sandbox.evicted, 10, "the result to expire")
        assert not directory.exists()
        assert process.log.memory_bytes == 0


@pytest.mark.timeout(30)
async def test_deleting_a_sandbox_frees_log_memory_and_forgetting_it_removes_the_files() -> None:
    config = DaemonConfig(result_ttl=1.0, housekeeping_interval=0.02, kill_grace=1.0)
    async with Host(config) as host:
        sandbox = await host.create_sandbox()
        process = await _run_to_exit(sandbox)
        assert process.log.memory_bytes > 512 << 10  # the cache of the newest output
        await sandbox.kill()  # DELETE /sandboxes/{id}
        # The memory goes at once; the result stays readable (from disk) for its TTL.
        assert process.log.memory_bytes < 4096
        assert _replayed(process.log) == bytes(range(256)) * 8192
        assert sandbox.runtime_dir.is_dir()
        await poll(lambda: sandbox.sandbox_id not in host.sandboxes, 10, "the sandbox to go")
        await poll(lambda: not sandbox.runtime_dir.exists(), 10, "its files to go")
        assert process.log.memory_bytes == 0


@pytest.mark.timeout(30)
async def test_daemon_shutdown_removes_the_logs_of_a_root_it_does_not_own(tmp_path: Path) -> None:
    async with Host(DaemonConfig(root_dir=tmp_path, kill_grace=1.0)) as host:
        sandbox = await host.create_sandbox()
        await _run_to_exit(sandbox)
        assert sandbox.runtime_dir.is_dir()
    assert not sandbox.runtime_dir.exists()


def test_a_disk_that_refuses_writes_costs_old_output_never_the_producer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "log"
    log = OutputLog(1 << 20, directory=directory, cache_bytes=64 * 1024)
    written = b""
    for i in range(200):  # 800 KiB: most of it only on disk
        data = bytes([i % 251]) * 4096
        log.append("stdout", data)
        written += data

    def full(fd: int, parts: list[bytes]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_store, "_write_all", full)
    for i in range(200, 400):  # the disk is full now: nothing raises to the producer
        data = bytes([i % 251]) * 4096
        assert log.append("stdout", data) is not None
        written += data
    log.finish(0)
    assert log.disk_error is not None and log.disk_error.errno == errno.ENOSPC
    # It goes on in memory, within the cache size, and gives the disk its space back.
    assert log.memory_bytes <= 64 * 1024 + 8192
    assert not list(directory.glob("*.frames"))
    # Every byte is accounted for: a reader from 0 gets an exact gap, then the newest
    # output, byte-exact.
    gap, chunks = log.read(0, 1 << 30)
    assert gap is not None and gap.cursor == 0 and chunks
    received = b"".join(c.data for c in chunks)
    assert gap.bytes_lost + len(received) == len(written) == log.total_bytes
    assert received == written[gap.bytes_lost :]
    assert log.evicted_bytes == gap.bytes_lost
    log.close()
    assert not directory.exists()


# -- memory goes back to the system after large releases (glibc's malloc_trim) -------------


async def test_heap_trims_after_large_releases_at_most_once_per_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trims: list[float] = []
    monkeypatch.setattr(heap, "_trim", lambda pad: trims.append(time.monotonic()) or 1)
    monkeypatch.setattr(heap, "_last", -heap.MIN_INTERVAL)
    monkeypatch.setattr(heap, "_owed", 0)
    monkeypatch.setattr(heap, "_later", None)
    # No full collection before the first trim, as an earlier test's released_soon() may
    # have asked for: it runs between the interval's start and the trim, and a long one
    # (0.23 s once, on a loaded machine) shortened the interval the trims were seen apart.
    monkeypatch.setattr(heap, "_collect", False)
    # Long enough that the burst below surely comes within it on a loaded machine (at
    # 0.2 s a stall between the first trim and the burst made a second one, once).
    monkeypatch.setattr(heap, "MIN_INTERVAL", 1.0)
    assert not heap.released(heap.THRESHOLD // 2)  # small: left to the allocator
    assert heap.released(heap.THRESHOLD // 2)  # together they are worth a trim
    assert len(trims) == 1
    # A burst right after: no trim now, one when the interval has passed.
    for _ in range(5):
        assert not heap.released(heap.THRESHOLD)
    assert len(trims) == 1
    await poll(lambda: len(trims) == 2, 10, "the deferred trim")
    assert trims[1] - trims[0] >= 1.0 * 0.9


def test_closing_a_large_log_trims_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[int] = []
    monkeypatch.setattr(heap, "released", lambda size: released.append(size) or False)
    log = OutputLog(64 << 20, charge_overhead=True)  # in memory: what the log frees is big
    for _ in range(64):
        log.append("stdout", b"x" * 65536)
    log.close()
    assert released and released[-1] >= 4 << 20


def test_segment_files_removed_under_the_log_are_a_gap_not_an_error(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    log = OutputLog(1 << 20, directory=directory, cache_bytes=16 * 1024)
    for i in range(64):
        log.append("stdout", bytes([i]) * 4096)
    for frames in directory.glob("*.frames"):  # e.g. a sandbox process's ``rm -rf ..``
        frames.unlink()
    gap, chunks = log.read(0, 1 << 20)
    assert gap is not None and gap.cursor == 0 and gap.first_available == chunks[0].seq
    assert b"".join(c.data for c in chunks) == b"".join(
        bytes([i]) * 4096 for i in range(chunks[0].seq, 64)
    )
    assert log.disk_error is not None
    log.append("stdout", b"more")  # and the log goes on
    assert log.read(64, 1 << 20)[1][0].data == b"more"
    log.close()


def test_chunks_read_from_disk_stay_intact_while_their_segment_is_evicted(
    tmp_path: Path,
) -> None:
    """A consumer holds chunks it read from a segment (views of the copy the read made)
    and has not sent them yet, while the producer writes on: the segment is evicted and
    its file, kept for reuse, is written over by the next segment. The bytes the consumer
    holds must not change."""
    log = OutputLog(64 * 1024, directory=tmp_path / "log", cache_bytes=4096, segment_bytes=8192)
    for i in range(8):
        log.append("stdout", bytes([i]) * 4096)
    gap, held = log.read(0, 8192)
    assert gap is None and [c.seq for c in held] == [0, 1]
    assert all(isinstance(c.data, memoryview) for c in held)  # read back without a copy
    assert [c.seq for c in log.read(2, 8192)[1]] == [2, 3]  # another segment, mapped too
    for i in range(8, 64):  # 256 KiB more: segment 0 and many after it are evicted
        log.append("stdout", bytes([i]) * 4096)
    assert log.first_seq > 8
    assert [bytes(c.data) for c in held] == [b"\0" * 4096, b"\1" * 4096]
    assert [bytes(c.head) for c in held] == [
        encode_frame_head(
            FrameKind.DATA, {"seq": c.seq, "stream": "stdout", "offset": c.offset, "ts": c.ts}, 4096
        )
        for c in held
    ]
    # Once nothing holds them, files are reused again (the spare), and the log reads on.
    del held, gap
    for i in range(64, 80):
        log.append("stdout", bytes([i]) * 4096)
    _, chunks = log.read(log.first_seq, 1 << 20)
    assert [bytes(c.data) for c in chunks] == [bytes([c.seq]) * 4096 for c in chunks]
    log.close()


def test_chunks_read_from_disk_are_private_copies(tmp_path: Path) -> None:
    """Nothing is read through a mapping of a file someone else could shrink (SIGBUS) or
    write (bytes changing after their check): a segment written over after a read leaves
    the chunks a reader holds as they were read."""
    directory = tmp_path / "log"
    log = OutputLog(1 << 20, directory=directory, cache_bytes=4096, segment_bytes=8192)
    for i in range(16):
        log.append("stdout", bytes([i]) * 4096)
    gap, chunks = log.read(0, 1 << 20)
    assert gap is None and log.disk_error is None
    assert len(chunks) >= 14  # all but what the cache holds came from the files
    for frames in directory.glob("*.frames"):
        frames.write_bytes(bytes(frames.stat().st_size))
        os.truncate(frames, 0)
    assert [bytes(c.data) for c in chunks] == [bytes([i]) * 4096 for i in range(len(chunks))]
    log.close()
