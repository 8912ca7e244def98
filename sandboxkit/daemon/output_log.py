"""The per-process output log: sequence-numbered chunks with bounded retention."""

from __future__ import annotations

import asyncio
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass

from sandboxkit._compat import within
from sandboxkit.wire import FrameKind, encode_frame_head

__all__ = ["CHUNK_OVERHEAD", "Chunk", "Gap", "OutputLog"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of output: ``seq`` is monotonic per process, ``offset`` counts every byte
    the process wrote before this chunk (all streams).

    The chunk keeps its ``data`` frame encoded once as ``head`` (header and metadata)
    plus the output bytes as read, not joined: copying every 64 KiB read into a new frame
    was up to half the daemon's CPU with a large retention (fresh heap pages, faulted in).
    A consumer joins heads and payloads into the one buffer it sends anyway.
    """

    seq: int
    stream: str
    offset: int
    ts: float
    size: int
    head: bytes
    data: bytes
    """The output bytes."""

    @property
    def frame(self) -> bytes:
        """The encoded ``data`` frame (a copy: senders join ``head`` and ``data``)."""
        return self.head + self.data

    @property
    def frame_size(self) -> int:
        """The encoded frame's length in bytes."""
        return len(self.head) + self.size


def _chunk_overhead() -> int:
    sample = Chunk(2**40, "stdout", 2**40, time.time(), 1, b"", b"")
    return (
        sys.getsizeof(sample)
        + sys.getsizeof(sample.seq)
        + sys.getsizeof(sample.offset)
        + sys.getsizeof(sample.ts)
        + sys.getsizeof(sample.head)  # the bytes objects' headers; their content is counted
        + sys.getsizeof(sample.data)
        + 8  # the deque's slot
        + 8  # the allocator's rounding, on average
    )


CHUNK_OVERHEAD = _chunk_overhead()
"""What a retained chunk costs beyond its encoded frame (its objects' headers), measured."""


@dataclass(frozen=True, slots=True)
class Gap:
    """Chunks ``cursor .. first_available - 1`` were evicted before this reader got them."""

    cursor: int
    first_available: int
    bytes_lost: int


class OutputLog:
    """Append-only log of a process's output, read by any number of cursors.

    ``append`` never waits: the producer does not know whether anyone reads. Retention is
    bounded in bytes; the oldest chunks go first. ``finish`` records the exit status in the
    same step that makes the log final, so a reader sees either a running log or a complete
    one with its exit code, never something in between.
    """

    def __init__(
        self, retention_bytes: int, *, charge_overhead: bool = False, coalesce: int = 0
    ) -> None:
        """``charge_overhead``: charge each chunk what it really costs in memory (its
        frame plus :data:`CHUNK_OVERHEAD`), not just its payload, so that retention bounds
        memory for any write pattern: with 1-byte writes, payload-only accounting would
        hold hundreds of times the setting. The daemon's processes charge it; the pure
        payload accounting stays available for reasoning about the log alone.

        ``coalesce``: a write joins the newest chunk (same stream) while no reader has
        read that chunk yet and the two together are at most this many bytes. Tiny writes
        nobody is reading then cost one chunk, not one each, so the retention holds
        output rather than bookkeeping. Invisible to readers: a chunk is only ever
        extended before anyone has seen it."""
        if retention_bytes <= 0:
            raise ValueError("retention_bytes must be positive")
        self.retention_bytes = retention_bytes
        self._overhead = CHUNK_OVERHEAD if charge_overhead else None
        self._coalesce = coalesce
        self._read_horizon = 0  # no chunk at or past this seq was returned by read()
        self._chunks: deque[Chunk] = deque()
        self._retained = 0
        self._cost = 0
        self._first_seq = 0
        self._head = 0
        self._total = 0
        self._evicted_bytes = 0
        # Offsets of evicted chunks, so a gap can say how many bytes it lost: 8 bytes each,
        # the newest ``_evicted_keep`` of them (at least), trimmed in amortised O(1), so
        # the index costs at most an eighth of the retention at the default (older
        # cursors: see offset_of).
        self._evicted_offsets = array("q")
        self._evicted_keep = max(16_384, retention_bytes // 128)
        self._waiter: asyncio.Future[None] | None = None
        self.ended = False
        self.exit_code: int | None = None
        self.ended_at: float | None = None

    @property
    def head(self) -> int:
        """The sequence number the next chunk will get.

        Whoever learns it may stand past the newest chunk without having read it, so
        telling it seals that chunk: it is never extended (see ``coalesce``) afterwards."""
        self._read_horizon = self._head
        return self._head

    @property
    def first_seq(self) -> int:
        """The oldest sequence number still retained (equals ``head`` when empty)."""
        return self._first_seq

    @property
    def total_bytes(self) -> int:
        """Bytes ever appended."""
        return self._total

    @property
    def retained_bytes(self) -> int:
        """Bytes currently held."""
        return self._retained

    @property
    def retained_cost(self) -> int:
        """What retention is charged for the chunks held (the payload bytes, or with
        ``charge_overhead`` their frames and objects)."""
        return self._cost

    @property
    def evicted_bytes(self) -> int:
        """Bytes dropped by retention."""
        return self._evicted_bytes

    def append(self, stream: str, data: bytes) -> Chunk | None:
        """Record output; returns the chunk (``None`` for empty data or a finished log)."""
        if not data or self.ended:
            return None
        last = self._chunks[-1] if self._chunks else None
        extend = (
            last is not None
            and last.seq >= self._read_horizon
            and last.stream == stream
            and last.size + len(data) <= self._coalesce
        )
        if extend:
            assert last is not None
            chunk = self._extend(last, data)
        else:
            ts = time.time()
            meta = {"seq": self._head, "stream": stream, "offset": self._total, "ts": ts}
            head = encode_frame_head(FrameKind.DATA, meta, len(data))
            data = data if type(data) is bytes else bytes(data)
            chunk = Chunk(self._head, stream, self._total, ts, len(data), head, data)
            self._chunks.append(chunk)
            self._head += 1
            self._cost += self._charge(chunk)
        self._total += len(data)
        self._retained += len(data)
        while self._cost > self.retention_bytes and len(self._chunks) > 1:
            old = self._chunks.popleft()
            self._retained -= old.size
            self._cost -= self._charge(old)
            self._evicted_bytes += old.size
            self._evicted_offsets.append(old.offset)
            self._first_seq = old.seq + 1
        if len(self._evicted_offsets) > 2 * self._evicted_keep:
            del self._evicted_offsets[: len(self._evicted_offsets) - self._evicted_keep]
        if not extend:
            # (An extended chunk's readers were woken when it was first appended.)
            self._wake()
        return chunk

    def _extend(self, last: Chunk, data: bytes) -> Chunk:
        joined = last.data + data
        meta = {"seq": last.seq, "stream": last.stream, "offset": last.offset, "ts": last.ts}
        head = encode_frame_head(FrameKind.DATA, meta, len(joined))
        chunk = Chunk(last.seq, last.stream, last.offset, last.ts, len(joined), head, joined)
        self._chunks[-1] = chunk
        self._cost += self._charge(chunk) - self._charge(last)
        return chunk

    def ts_of(self, seq: int) -> float | None:
        """When retained chunk ``seq`` was written (``None`` if it is not held); unlike
        :meth:`read`, looking does not count as reading."""
        if self._first_seq <= seq < self._head:
            return self._chunks[seq - self._first_seq].ts
        return None

    def _charge(self, chunk: Chunk) -> int:
        if self._overhead is None:
            return chunk.size
        return chunk.frame_size + self._overhead

    def finish(self, exit_code: int) -> None:
        """Mark the log complete with the process's exit code (idempotent)."""
        if self.ended:
            return
        self.exit_code = exit_code
        self.ended_at = time.time()
        self.ended = True
        self._wake()

    def offset_of(self, seq: int) -> int:
        """Byte offset at which chunk ``seq`` starts (``total_bytes`` at or past the head).

        For evicted chunks the offset comes from a bounded index; older than that, 0.
        """
        if seq >= self._head:
            return self._total
        if seq >= self._first_seq:
            return self._chunks[seq - self._first_seq].offset
        index = seq - (self._first_seq - len(self._evicted_offsets))
        return self._evicted_offsets[index] if index >= 0 else 0

    def read(self, cursor: int, max_bytes: int) -> tuple[Gap | None, list[Chunk]]:
        """Chunks from ``cursor`` on, at most about ``max_bytes`` (at least one if any).

        If ``cursor`` is behind retention, a :class:`Gap` says what was lost and reading
        starts at the oldest retained chunk.
        """
        gap = None
        if cursor < self._first_seq:
            lost = self.offset_of(self._first_seq) - self.offset_of(cursor)
            gap = Gap(cursor, self._first_seq, lost)
            cursor = self._first_seq
        chunks: list[Chunk] = []
        size = 0
        index = cursor - self._first_seq
        while index < len(self._chunks):
            chunk = self._chunks[index]
            if chunks and size + chunk.size > max_bytes:
                break
            chunks.append(chunk)
            size += chunk.size
            index += 1
        if chunks:
            self._read_horizon = max(self._read_horizon, chunks[-1].seq + 1)
        return gap, chunks

    async def wait(self, cursor: int, timeout: float | None) -> bool:
        """Wait until chunk ``cursor`` exists or the log ends; ``False`` on timeout."""
        if self._head > cursor or self.ended:
            return True
        self._read_horizon = self._head  # a reader waits past the newest chunk: seal it
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
        try:
            await within(asyncio.shield(self._waiter), timeout)
        except TimeoutError:
            return False
        return True

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
