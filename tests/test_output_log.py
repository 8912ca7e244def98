"""OutputLog: sequence numbers, byte offsets, bounded reads, retention, gaps, finish, wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxkit.daemon.output_log import Chunk, Gap, OutputLog
from sandboxkit.wire import Frame, FrameDecoder, FrameKind

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
    writes = [
        b"x" if pattern == "1-byte" else b"y" * rng.choice([1, 3, 40, 700, 5000])
        for _ in range(40_000 if pattern == "1-byte" else 20_000)
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
    assert log.evicted_bytes > 0
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
    for _ in range(60_000):
        plain.append("stdout", b"x")
        joined.append("stdout", b"x")
    assert joined.retained_cost <= retention and plain.retained_cost <= retention
    # Charged at true cost, 1-byte chunks keep ~0.3% of the setting as output; joined
    # while unread, nearly all of it.
    assert plain.retained_bytes < retention // 100
    assert joined.retained_bytes == 60_000
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
