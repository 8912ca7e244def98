"""The per-process output log: sequence-numbered chunks with bounded retention, kept in
append-only segment files with the newest chunks cached in memory."""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from sandboxkit.daemon import heap
from sandboxkit.daemon.chunks import CHUNK_OVERHEAD, Chunk, Gap
from sandboxkit.daemon.file_span import SPAN_MIN, FileSpan
from sandboxkit.daemon.lag_reserve import LagLoan, LagReserve
from sandboxkit.daemon.log_offsets import EvictedOffsets, ReadEnds
from sandboxkit.daemon.log_waiters import OnWake, Waiters
from sandboxkit.daemon.segment_store import (
    INDEX_RECORD,
    MAX_SEGMENT,
    Segment,
    SegmentDamaged,
    SegmentStore,
)
from sandboxkit.daemon.write_behind import WriteBehind
from sandboxkit.vocab import LogStorage
from sandboxkit.wire import FrameKind, encode_frame_head

__all__ = ["DEFAULT_CACHE_BYTES", "Chunk", "Gap", "OnDegraded", "OutputLog"]

OnDegraded = Callable[[str, OSError], None]
"""Told when the log loses output to the disk: ``(reason, error)``; ``reason`` is
``disk_error`` (the disk refused: the log goes on in memory) or ``segment_damaged`` (a
segment no longer held what was written: it and older output are given up)."""


DEFAULT_CACHE_BYTES = 1 << 20
"""Memory for the newest chunks of a log kept on disk, unless told otherwise."""


class OutputLog:
    """Append-only log of a process's output, read by any number of cursors.

    ``append`` never waits: the producer does not know whether anyone reads. Retention is
    bounded in bytes; the oldest chunks go first. ``finish`` records the exit status in the
    same step that makes the log final, so a reader sees either a running log or a complete
    one with its exit code, never something in between.

    Where the output is held:

    * With a ``directory`` (the daemon's processes: under their sandbox's runtime
      directory), chunks go to append-only segment files there, in frames encoded once,
      their index in fixed-size records (:mod:`~sandboxkit.daemon.segment_store`), and
      only the newest ``cache_bytes`` of frames stay in memory, for the readers that
      keep up (more, lent, while the slowest is at the cache's edge: ``.lag_reserve``);
      readers further behind read the files (from the page cache). Retention then bounds
      disk, evicting whole segments, so it can be gigabytes at a few MB of memory. If
      the disk refuses a write (full), the log goes on in memory within ``cache_bytes``:
      what was on disk is then evicted, which readers see as a gap, never as an error;
      ``on_degraded`` is told, and :attr:`storage` says ``memory`` from then on. A
      segment that no longer holds what was written (shrunk, overwritten) is given up
      with everything older, an exact gap too.
    * Without one, every retained chunk stays in memory and retention bounds memory
      (tests and tools that build a log by itself).

    :meth:`close` deletes the files and frees the memory; the daemon calls it when the
    process's result expires or its sandbox is forgotten (:meth:`drop_cache` when the
    sandbox is deleted: its output stays readable from disk until then).
    """

    def __init__(
        self,
        retention_bytes: int,
        *,
        charge_overhead: bool = False,
        coalesce: int = 0,
        directory: str | os.PathLike[str] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        segment_bytes: int | None = None,
        on_degraded: OnDegraded | None = None,
    ) -> None:
        """``charge_overhead``: charge each chunk what it really costs, not just its
        payload, so that retention bounds the resource for any write pattern: in memory,
        its frame plus :data:`CHUNK_OVERHEAD`; on disk, its frame plus its index record.
        With 1-byte writes, payload-only accounting would hold hundreds of times the
        setting. The daemon's processes charge it; the pure payload accounting stays
        available for reasoning about the log alone.

        ``coalesce``: a write joins the newest chunk (same stream) while no reader has
        read that chunk yet and the two together are at most this many bytes. Tiny writes
        nobody is reading then cost one chunk, not one each, so the retention holds
        output rather than bookkeeping. Invisible to readers: a chunk is only ever
        extended before anyone has seen it.

        ``directory``: keep the log on disk there (created if missing; the log owns it
        and :meth:`close` removes it), caching ``cache_bytes`` of the newest frames in
        memory; segment files of ``segment_bytes`` (default: an eighth of the retention,
        at most 8 MiB). Without it, the log is kept in memory.

        ``on_degraded``: called when output is lost to the disk (see :data:`OnDegraded`);
        not for a directory that cannot be made at all (see :attr:`disk_error`)."""
        if retention_bytes <= 0 or cache_bytes <= 0:
            raise ValueError("retention_bytes and cache_bytes must be positive")
        self.retention_bytes = retention_bytes
        self.cache_bytes = cache_bytes
        self._overhead = charge_overhead
        self._coalesce = coalesce
        self._read_horizon = 0  # no chunk at or past this seq was returned by read()
        # The newest chunks, ``_cache_first .. head - 1`` (in memory: every retained one).
        self._cache: deque[Chunk] = deque()
        self._cache_first = 0
        self._cache_cost = 0
        self._retained = 0
        self._cost = 0
        self._first_seq = 0
        self._head = 0
        self._total = 0
        self._evicted_bytes = 0
        self._closed = False
        self._waiters = Waiters()
        self._behind = WriteBehind(self._written_behind)
        self.ended = False
        self.exit_code: int | None = None
        self.ended_at: float | None = None
        self._evicted_offsets = EvictedOffsets(max(16_384, retention_bytes // 128))
        self._limit = retention_bytes
        self.directory = Path(directory) if directory is not None else None
        self.disk_error: OSError | None = None
        """Why the log stopped writing to disk, if it did (then it goes on in memory)."""
        self._on_degraded = on_degraded
        self._read_ends = ReadEnds()
        self.zero_copy: Callable[[], bool] | None = None
        """Set by the owner: tells, when asked, whether no sandboxed process can reach
        the files now; then readers get :meth:`read_span` (see :mod:`.file_span`)."""
        self.lag = LagLoan(LagReserve(0), {})  # the owner's readers: see .lag_reserve
        # Chunks from this seq on live in memory only (every chunk, for a memory log).
        self._memory_from = 0
        # On disk: chunks ``head - 1`` and older are in the store once its ``written``
        # passed them (the newest stays out until the next chunk or the end: it may still
        # be extended, see ``coalesce``; and see _write_behind).
        self._store: SegmentStore | None = None
        if self.directory is not None:
            try:
                self._store = SegmentStore(
                    self.directory,
                    segment_bytes=segment_bytes or max(1, min(retention_bytes // 8, MAX_SEGMENT)),
                    kept_limit=max(1 << 20, retention_bytes // 16),
                )
            except OSError as exc:
                self.disk_error = exc
                self._limit = min(cache_bytes, retention_bytes)
            else:
                self._memory_from = sys.maxsize

    @property
    def _on_disk(self) -> bool:
        return self._memory_from == sys.maxsize and not self._closed

    @property
    def storage(self) -> LogStorage:
        """Where the log keeps its output: ``disk`` (segment files, the newest cached in
        memory) or ``memory`` (no directory, or the disk refused)."""
        return "disk" if self._store is not None and self._memory_from == sys.maxsize else "memory"

    @property
    def effective_retention(self) -> int:
        """The retention in force: ``retention_bytes``, or the cache size once the
        log fell back to memory."""
        return self._limit

    # -- accounting ---------------------------------------------------------------------

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
        ``charge_overhead`` their frames and bookkeeping)."""
        return self._cost

    @property
    def evicted_bytes(self) -> int:
        """Bytes dropped by retention."""
        return self._evicted_bytes

    @property
    def memory_bytes(self) -> int:
        """What the log holds in memory: its cached frames with their objects, and its
        bookkeeping (on disk, the rest lives in files and the page cache)."""
        size = self._cache_cost + self._evicted_offsets.nbytes
        return size + (self._store.memory_bytes if self._store is not None else 0)

    # -- writing --------------------------------------------------------------------------

    def append(self, stream: str, data: bytes) -> Chunk | None:
        """Record output; returns the chunk (``None`` for empty data or a finished log)."""
        if not data or self.ended or self._closed:
            return None
        cache = self._cache
        last = cache[-1] if cache and cache[-1].seq == self._head - 1 else None
        extend = (
            last is not None
            and last.seq >= self._read_horizon
            and last.stream == stream
            and last.size + len(data) <= self._coalesce
            and (self._store is None or not self._on_disk or last.seq >= self._store.written)
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
            if not cache:
                self._cache_first = self._head
            cache.append(chunk)
            self._head += 1
            self._cost += self._charge(chunk)
            self._cache_cost += chunk.frame_size + CHUNK_OVERHEAD
        self._total += len(data)
        self._retained += len(data)
        if self._on_disk:
            self._evict_segments()
            self._trim_cache()
        else:
            self._evict_from_memory()
        if not extend:
            # (An extended chunk's readers were woken when it was first appended.)
            self._wake()
            self._behind_due(chunk)  # (after the wake: see .write_behind)
        return chunk

    def _extend(self, last: Chunk, data: bytes) -> Chunk:
        joined = b"".join((last.data, data))
        meta = {"seq": last.seq, "stream": last.stream, "offset": last.offset, "ts": last.ts}
        head = encode_frame_head(FrameKind.DATA, meta, len(joined))
        chunk = Chunk(last.seq, last.stream, last.offset, last.ts, len(joined), head, joined)
        self._cache[-1] = chunk
        self._cost += self._charge(chunk) - self._charge(last)
        self._cache_cost += chunk.frame_size - last.frame_size
        return chunk

    def _charge(self, chunk: Chunk) -> int:
        if not self._overhead:
            return chunk.size
        if self._on_disk:
            return chunk.frame_size + INDEX_RECORD
        return chunk.frame_size + CHUNK_OVERHEAD

    def _evict_from_memory(self) -> None:
        while self._cost > self._limit and len(self._cache) > 1:
            old = self._cache.popleft()
            self._retained -= old.size
            self._cost -= self._charge(old)
            self._cache_cost -= old.frame_size + CHUNK_OVERHEAD
            self._evicted_bytes += old.size
            self._evicted_offsets.add(old.offset)
            self._first_seq = self._cache_first = old.seq + 1
        self._evicted_offsets.trim()

    def finish(self, exit_code: int) -> None:
        """Mark the log complete with the process's exit code (idempotent)."""
        if self.ended:
            return
        self._behind.cancel()
        self._write_up_to(self._head)
        if self._flush() and self._store is not None:
            self._store.close_files()
        self.exit_code = exit_code
        self.ended_at = time.time()
        self.ended = True
        self._wake()

    def drop_cache(self) -> int:
        """Empty the in-memory cache (the output stays readable from disk); returns the
        bytes it freed. No-op for a log kept in memory."""
        self._read_horizon = self._head  # the newest chunk goes to disk: no longer extended
        self._write_up_to(self._head)
        self._flush()
        if not self._on_disk:
            return 0
        freed = self._cache_cost
        if self._store is not None:
            self._store.drop_copies()
        self._cache.clear()
        self._cache_first = self._head
        self._cache_cost = 0
        self.lag.settle(0)
        heap.released(freed)
        return freed

    def close(self) -> None:
        """Delete the log's files and free its memory (idempotent). The log then holds
        nothing: a reader gets a gap up to the head, and output appended is dropped."""
        if self._closed:
            return
        self._closed = True
        self._behind.cancel()
        freed = self.memory_bytes
        self._cache.clear()
        self._cache_cost = 0
        self.lag.settle(0)
        self._evicted_offsets.clear()
        self._evicted_bytes += self._retained
        self._retained = self._cost = 0
        self._first_seq = self._cache_first = self._head
        if self._store is not None:
            self._store.close()
        heap.released(freed)
        self._wake()

    # -- on disk: the segment store ----------------------------------------------------

    def _behind_due(self, newest: Chunk) -> None:
        store = self._store if self._on_disk else None
        if store is None:
            return
        waiting, over = self._head - 1 - store.written, self._cost > self.retention_bytes
        if waiting or over:  # (only written output can be evicted)
            first = self._cache[store.written - self._cache_first] if waiting else newest
            self._behind.due(waiting, newest.offset - first.offset, over)

    def _written_behind(self) -> None:
        # The chunks before the newest into the store, once due (see .write_behind).
        self._write_up_to(self._head - 1)
        if self._on_disk:
            self._evict_segments()
            self._trim_cache()

    def _write_up_to(self, end: int) -> None:
        """Put the cached chunks before ``end`` not yet in the store into it, in order."""
        store = self._store if self._on_disk else None
        if store is None:
            return
        cache, first = self._cache, self._cache_first
        try:
            while store.written < end:
                chunk = cache[store.written - first]
                store.write(chunk, self._charge(chunk))
        except OSError as exc:
            self._to_memory(exc)

    def _flush(self) -> bool:
        """Write what the store buffered; ``False`` if the log is not (or no longer) on
        disk."""
        store = self._store if self._on_disk else None
        if store is None:
            return False
        try:
            store.flush()
        except OSError as exc:
            self._to_memory(exc)
            return False
        return True

    def _to_memory(self, exc: OSError) -> None:
        """The disk refused a write (full, gone): go on in memory, bounded by the cache
        size. What is on disk is given up (the chunks that the cache holds stay), which
        readers see as a gap, like any eviction; the producer never notices."""
        store = self._store
        assert store is not None
        self.disk_error = exc
        self._memory_from = self._cache_first
        if self._first_seq < self._cache_first:
            kept_from = self._cache[0].offset if self._cache else self._total
            self._evicted_bytes += kept_from - store.segments[0].first_offset
            self._first_seq = self._cache_first
        store.abandon()
        self._limit = min(self.cache_bytes, self.retention_bytes)
        self.lag.settle(0)
        self._retained = sum(chunk.size for chunk in self._cache)
        self._cost = sum(self._charge(chunk) for chunk in self._cache)
        self._evict_from_memory()
        if self._on_degraded is not None:
            self._on_degraded("disk_error", exc)

    def _evict_segments(self) -> None:
        # Whole segments go, oldest first (see SegmentStore.evict_oldest).
        store = self._store
        assert store is not None
        while self._cost > self.retention_bytes and store.segments:
            if not self._evict_oldest(store):
                break
        self._drop_cached_before_first()

    def _evict_oldest(self, store: SegmentStore) -> bool:
        try:
            segment = store.evict_oldest()
        except OSError as exc:
            self._to_memory(exc)
            return False
        self._cost -= segment.cost
        self._retained -= segment.payload
        self._evicted_bytes += segment.payload
        self._first_seq = segment.end_seq
        return True

    def _give_up(self, damaged: Segment, exc: SegmentDamaged) -> None:
        """A segment no longer holds what was written: evict it and every older one,
        like retention would (readers get an exact gap), and go on."""
        store = self._store
        assert store is not None
        while store.segments and store.segments[0].first_seq <= damaged.first_seq:
            if not self._evict_oldest(store):
                return
        self._drop_cached_before_first()
        if self._on_degraded is not None:
            self._on_degraded("segment_damaged", exc)

    def _drop_cached_before_first(self) -> None:
        while self._cache and self._cache[0].seq < self._first_seq:
            old = self._cache.popleft()
            self._cache_cost -= old.frame_size + CHUNK_OVERHEAD
            self._cache_first = old.seq + 1

    def _trim_cache(self) -> None:
        # The newest chunk always stays (it may not be written yet), a chunk leaves the
        # cache only once its frame is in its file, and the slowest reader's stays while
        # the reserve lends (.lag_reserve).
        store, lag, lent, slowest = self._store, self.lag, 0, None
        assert store is not None
        while self._cache_cost > self.cache_bytes and len(self._cache) > 1:
            old = self._cache[0]
            slowest = lag.slowest(old.seq) if slowest is None else slowest
            if slowest == old.seq and lag.covers(over := self._cache_cost - self.cache_bytes):
                lent = over
                break
            if old.seq >= store.written:  # (not the newest: at least two are cached)
                self._write_up_to(self._head - 1)
            if old.seq >= store.flushed and not self._flush():
                return  # it failed: the cache is the log now (see _to_memory)
            self._cache.popleft()
            self._cache_cost -= old.frame_size + CHUNK_OVERHEAD
            self._cache_first = old.seq + 1
        lag.settle(lent)

    def readers_moved(self) -> None:
        """A reader moved on or left: what the cache kept for it may go (.lag_reserve)."""
        if self.lag.held and self._on_disk:
            self._trim_cache()

    def _store_at(self, seq: int) -> SegmentStore | None:
        """The store (if any), once chunk ``seq``'s index record is in its file."""
        store = self._store
        if store is not None and seq >= store.flushed:
            self._flush()
        return store

    # -- reading --------------------------------------------------------------------------

    def ts_of(self, seq: int) -> float | None:
        """When retained chunk ``seq`` was written (``None`` if it is not held); unlike
        :meth:`read`, looking does not count as reading."""
        if not self._first_seq <= seq < self._head:
            return None
        if seq >= self._cache_first:
            return self._cache[seq - self._cache_first].ts
        store = self._store_at(seq)
        record = store.record(seq) if store is not None else None
        return None if record is None else float(record[2])

    def offset_of(self, seq: int) -> int:
        """Byte offset at which chunk ``seq`` starts (``total_bytes`` at or past the head).

        For evicted chunks it comes from a bounded index (the newest evicted chunks', in
        memory; on disk, the newest evicted segments' index files), else where its
        segment began (0 in memory)."""
        if seq >= self._head:
            return self._total
        if seq >= self._cache_first and self._cache:
            return self._cache[seq - self._cache_first].offset
        if seq >= self._memory_from:
            offset = self._evicted_offsets.get(seq, self._first_seq)
            if offset is not None or self._store is None:
                return offset or 0
        end = self._read_ends.get(seq)
        if end is not None:  # (exact, whatever became of the index on disk)
            return end
        store = self._store_at(seq)
        offset = store.offset_of(seq) if store is not None else None
        return offset or 0

    def read(self, cursor: int, max_bytes: int) -> tuple[Gap | None, list[Chunk]]:
        """Chunks from ``cursor`` on, at most about ``max_bytes`` (at least one if any).

        If ``cursor`` is behind retention, a :class:`Gap` says what was lost and reading
        starts at the oldest retained chunk."""
        self.readers_moved()
        asked, gap = cursor, self._gap(cursor)
        cursor = max(cursor, self._first_seq)
        chunks: list[Chunk] = []
        size = 0
        if cursor < self._cache_first and self._store is not None:
            try:
                size = self._store.read(cursor, self._cache_first, max_bytes, chunks, size, Chunk)
            except SegmentDamaged as exc:
                # Not what was written (shrunk, overwritten): it and older ones are a gap.
                self._give_up(exc.segment, exc)
                return self.read(asked, max_bytes)
            except OSError as exc:
                # Unreadable (a file removed under the daemon, an I/O error): what is on
                # disk is lost, and said so with a gap, never an exception to the reader.
                self._to_memory(exc)
                return self.read(asked, max_bytes)
            if chunks and chunks[-1].seq + 1 < self._cache_first:
                self._read_horizon = max(self._read_horizon, chunks[-1].seq + 1)
                self._read_ends.add(chunks[-1].seq + 1, chunks[-1].offset + chunks[-1].size)
                return gap, chunks
            cursor += len(chunks)
        index, cache = cursor - self._cache_first, self._cache
        while 0 <= index < len(cache):
            chunk = cache[index]
            if chunks and size + chunk.size > max_bytes:
                break
            chunks.append(chunk)
            size += chunk.size
            index += 1
        if chunks:
            self._read_horizon = max(self._read_horizon, chunks[-1].seq + 1)
            if self._store is not None:
                self._read_ends.add(chunks[-1].seq + 1, chunks[-1].offset + chunks[-1].size)
        return gap, chunks

    def read_span(self, cursor: int, max_bytes: int) -> tuple[Gap | None, FileSpan] | None:
        """Like :meth:`read`, for a reader of a :attr:`zero_copy` log on disk: frames
        from ``cursor`` on as a span of a segment file, sent as they are; ``None`` where
        :meth:`read` is the way (memory, or little in the cache: :data:`SPAN_MIN`)."""
        store = self._store
        if self.zero_copy is None or store is None or not self._on_disk or not self.zero_copy():
            return None
        asked, gap = cursor, self._gap(cursor)
        cursor = max(cursor, self._first_seq)
        if cursor >= store.flushed or (cursor >= self._cache_first and self._few(cursor, store)):
            return None
        try:
            span = store.span(cursor, store.flushed, max_bytes, self._cache_first)
        except SegmentDamaged as exc:  # as in read: that segment and older ones are a gap
            self._give_up(exc.segment, exc)
            return self.read_span(asked, max_bytes)
        except OSError as exc:
            self._to_memory(exc)  # read() then tells the gap
            return None
        if span is None:
            return None
        self._read_horizon = max(self._read_horizon, span.end_seq)
        self._read_ends.add(span.end_seq, span.end_offset)
        return gap, span

    def _gap(self, cursor: int) -> Gap | None:
        if cursor >= (first := self._first_seq):
            return None
        return Gap(cursor, first, self.offset_of(first) - self.offset_of(cursor))

    def _few(self, cursor: int, store: SegmentStore) -> bool:
        # Cached, and less than SPAN_MIN written from the cursor on: the copy is cheaper.
        cache, first = self._cache, self._cache_first
        end = cache[store.flushed - first].offset if store.flushed < self._head else self._total
        return end - cache[cursor - first].offset < SPAN_MIN

    async def wait(self, cursor: int, timeout: float | None, on_wake: OnWake | None = None) -> bool:
        """Wait until chunk ``cursor`` exists or the log ends; ``False`` on timeout.
        ``on_wake``: run by the append (or end) that wakes it (:data:`.log_waiters.OnWake`)."""
        if self._head > cursor or self.ended:
            return True
        self._read_horizon = self._head  # a reader waits past the newest chunk: seal it
        return await self._waiters.wait(timeout, on_wake)

    def nudge(self) -> None:
        """Wake every waiting reader with no new chunk: something else changed that its
        reader should hear of now (the sandbox paused or resumed)."""
        self._wake()

    def _wake(self) -> None:
        self._waiters.wake()
