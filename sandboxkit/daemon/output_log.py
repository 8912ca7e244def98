"""The per-process output log: sequence-numbered chunks with bounded retention."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from sandboxkit._compat import within
from sandboxkit.wire import FrameKind, encode_frame

__all__ = ["Chunk", "Gap", "OutputLog"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of output: ``seq`` is monotonic per process, ``offset`` counts every byte
    the process wrote before this chunk (all streams).

    The chunk is kept as its encoded ``data`` frame: encoded once, sent as-is to every
    consumer, so fan-out cost does not grow with encoding work per consumer.
    """

    seq: int
    stream: str
    offset: int
    ts: float
    size: int
    frame: bytes

    @property
    def data(self) -> bytes:
        """The output bytes."""
        return self.frame[len(self.frame) - self.size :]


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

    def __init__(self, retention_bytes: int) -> None:
        if retention_bytes <= 0:
            raise ValueError("retention_bytes must be positive")
        self.retention_bytes = retention_bytes
        self._chunks: deque[Chunk] = deque()
        self._retained = 0
        self._first_seq = 0
        self._head = 0
        self._total = 0
        self._evicted_bytes = 0
        # Offsets of evicted chunks, so a gap can say how many bytes it lost.
        self._evicted_offsets: deque[int] = deque(maxlen=1_000_000)
        self._waiter: asyncio.Future[None] | None = None
        self.ended = False
        self.exit_code: int | None = None
        self.ended_at: float | None = None

    @property
    def head(self) -> int:
        """The sequence number the next chunk will get."""
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
    def evicted_bytes(self) -> int:
        """Bytes dropped by retention."""
        return self._evicted_bytes

    def append(self, stream: str, data: bytes) -> Chunk | None:
        """Record output; returns the chunk (``None`` for empty data or a finished log)."""
        if not data or self.ended:
            return None
        ts = time.time()
        meta = {"seq": self._head, "stream": stream, "offset": self._total, "ts": ts}
        frame = encode_frame(FrameKind.DATA, meta, data)
        chunk = Chunk(self._head, stream, self._total, ts, len(data), frame)
        self._chunks.append(chunk)
        self._head += 1
        self._total += len(data)
        self._retained += len(data)
        while self._retained > self.retention_bytes and len(self._chunks) > 1:
            old = self._chunks.popleft()
            self._retained -= old.size
            self._evicted_bytes += old.size
            self._evicted_offsets.append(old.offset)
            self._first_seq = old.seq + 1
        self._wake()
        return chunk

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
        return gap, chunks

    async def wait(self, cursor: int, timeout: float | None) -> bool:
        """Wait until chunk ``cursor`` exists or the log ends; ``False`` on timeout."""
        if self._head > cursor or self.ended:
            return True
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
