"""The per-process output log: sequence-numbered chunks with bounded retention, kept in
append-only segment files with the newest chunks cached in memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import struct
import sys
import time
from array import array
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sandboxkit._compat import within
from sandboxkit.daemon import heap
from sandboxkit.wire import FrameKind, encode_frame_head

__all__ = [
    "CHUNK_OVERHEAD",
    "DEFAULT_CACHE_BYTES",
    "INDEX_RECORD",
    "Chunk",
    "Gap",
    "OutputLog",
    "remove_tree",
]


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
"""What a chunk held in memory costs beyond its encoded frame (its objects' headers)."""

DEFAULT_CACHE_BYTES = 1 << 20
"""Memory for the newest chunks of a log kept on disk, unless told otherwise."""

# One index record per chunk, in the segment's ``.index`` file at ``(seq - first) * size``:
# where its frame starts in the ``.frames`` file, its byte offset, time, payload size,
# head length and stream. Fixed-size, so chunk ``seq`` is found without a search, and the
# index costs no memory: the page cache holds what is read often.
_RECORD = struct.Struct("<QqdQHB")

INDEX_RECORD = _RECORD.size
"""Bytes of index on disk per chunk (charged to retention with the frame)."""

_FLUSH_BYTES = 256 * 1024
"""Frames are written in batches of about this many bytes (one syscall for many chunks)."""

_READ_RECORDS = 512
"""Most chunks one read returns from disk: each is an object to build (~2 us), and a read
runs on the event loop; 512 tiny chunks take about a millisecond."""

_MAX_SEGMENT = 64 << 20
"""Largest segment file; retention is given back a segment at a time."""


@dataclass(frozen=True, slots=True)
class Gap:
    """Chunks ``cursor .. first_available - 1`` were evicted before this reader got them."""

    cursor: int
    first_available: int
    bytes_lost: int


@dataclass(slots=True)
class _Segment:
    """One pair of append-only files holding chunks ``first_seq ..`` (``count`` of them)."""

    number: int
    first_seq: int
    first_offset: int
    count: int = 0
    size: int = 0
    """Bytes of frames (written or waiting to be)."""
    payload: int = 0
    cost: int = 0

    @property
    def end_seq(self) -> int:
        return self.first_seq + self.count


class OutputLog:
    """Append-only log of a process's output, read by any number of cursors.

    ``append`` never waits: the producer does not know whether anyone reads. Retention is
    bounded in bytes; the oldest chunks go first. ``finish`` records the exit status in the
    same step that makes the log final, so a reader sees either a running log or a complete
    one with its exit code, never something in between.

    Where the output is held:

    * With a ``directory`` (the daemon's processes: under their sandbox's runtime
      directory), chunks go to append-only segment files there, and only the newest
      ``cache_bytes`` of encoded frames stay in memory, for the readers that keep up.
      Readers further behind get theirs with ``os.pread`` (small reads, from the page
      cache), in the same frames, encoded once. Retention then bounds disk, evicting whole
      segments (deleting their files, or writing the next segment over one), so it can be
      gigabytes at a few MB of memory. The index (where each chunk is) is on disk too, in
      fixed-size records, so memory does not grow with the number of chunks. If the disk
      refuses a write (full), the log goes on in memory within ``cache_bytes``: what was
      on disk is then evicted, which readers see as a gap, never as an error.
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
        at most 64 MiB). Without it, the log is kept in memory."""
        if retention_bytes <= 0:
            raise ValueError("retention_bytes must be positive")
        if cache_bytes <= 0:
            raise ValueError("cache_bytes must be positive")
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
        self._waiter: asyncio.Future[None] | None = None
        self.ended = False
        self.exit_code: int | None = None
        self.ended_at: float | None = None
        # In memory: offsets of evicted chunks, so a gap can say how many bytes it lost:
        # 8 bytes each, the newest ``_evicted_keep`` of them (at least), trimmed in
        # amortised O(1), so the index costs at most an eighth of the retention at the
        # default (older cursors: see offset_of).
        self._evicted_offsets = array("q")
        self._evicted_keep = max(16_384, retention_bytes // 128)
        self._limit = retention_bytes
        self.directory = Path(directory) if directory is not None else None
        self.disk_error: OSError | None = None
        """Why the log stopped writing to disk, if it did (then it goes on in memory)."""
        # Chunks from this seq on live in memory only (every chunk, for a memory log).
        self._memory_from = 0 if self.directory is None else sys.maxsize
        # On disk: the segments retained (the last one is written to), chunks ``head - 1``
        # and older are in segments once ``_written`` passed them (the newest stays out
        # until the next chunk or the end: it may still be extended, see ``coalesce``).
        self._segment_bytes = segment_bytes or max(1, min(retention_bytes // 8, _MAX_SEGMENT))
        self._segments: deque[_Segment] = deque()
        self._written = 0
        self._flushed = 0
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._pending_index = bytearray()
        self._fds: tuple[int, int] | None = None  # the last segment's (frames, index)
        self._streams: dict[str, int] = {}
        self._stream_names: list[str] = []
        # Evicted segments whose index file is kept (their frames are deleted), so a gap
        # from any cursor in them is exact; up to ``_kept_limit`` bytes of index files.
        # Older ones are remembered by where they began only (``_forgotten``).
        self._kept: deque[_Segment] = deque()
        self._kept_bytes = 0
        self._kept_limit = max(1 << 20, retention_bytes // 16)
        self._forgotten = array("q")  # first_seq, first_offset pairs
        self._next_number = 0
        # An evicted segment's frames file, kept to be written over by the next segment:
        # overwriting pages the page cache holds costs half as much as writing new ones
        # (measured), and spares an unlink.
        self._spare: str | None = None
        self._prefix = os.path.join(self.directory, "") if self.directory is not None else ""
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._to_memory(exc)

    @property
    def _on_disk(self) -> bool:
        return self._memory_from == sys.maxsize and not self._closed

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
        size = self._cache_cost + self._evicted_offsets.itemsize * len(self._evicted_offsets)
        size += len(self._pending_index) + 8 * len(self._forgotten)
        return size + 120 * (len(self._segments) + len(self._kept))

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
            and (not self._on_disk or last.seq >= self._written)
        )
        if extend:
            assert last is not None
            chunk = self._extend(last, data)
        else:
            self._write_newest()
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
        return chunk

    def _extend(self, last: Chunk, data: bytes) -> Chunk:
        joined = last.data + data
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
            self._evicted_offsets.append(old.offset)
            self._first_seq = self._cache_first = old.seq + 1
        if len(self._evicted_offsets) > 2 * self._evicted_keep:
            del self._evicted_offsets[: len(self._evicted_offsets) - self._evicted_keep]

    def finish(self, exit_code: int) -> None:
        """Mark the log complete with the process's exit code (idempotent)."""
        if self.ended:
            return
        self._write_newest()
        self._flush()
        self._close_files()
        self.exit_code = exit_code
        self.ended_at = time.time()
        self.ended = True
        self._wake()

    def drop_cache(self) -> int:
        """Empty the in-memory cache (the output stays readable from disk); returns the
        bytes it freed. No-op for a log kept in memory."""
        self._read_horizon = self._head  # the newest chunk goes to disk: no longer extended
        self._write_newest()
        self._flush()
        if not self._on_disk:
            return 0
        freed = self._cache_cost
        self._cache.clear()
        self._cache_first = self._head
        self._cache_cost = 0
        heap.released(freed)
        return freed

    def close(self) -> None:
        """Delete the log's files and free its memory (idempotent). The log then holds
        nothing: a reader gets a gap up to the head, and output appended is dropped."""
        if self._closed:
            return
        self._closed = True
        freed = self.memory_bytes
        self._cache.clear()
        self._cache_cost = 0
        self._evicted_offsets = array("q")
        self._evicted_bytes += self._retained
        self._retained = self._cost = 0
        self._first_seq = self._cache_first = self._head
        self._close_files()
        self._pending, self._pending_size, self._pending_index = [], 0, bytearray()
        on_disk = sum(segment.size for segment in self._segments)
        self._segments.clear()
        self._kept.clear()
        self._forgotten = array("q")
        if self.directory is not None:
            _READERS.forget_all(self._prefix)
            _remove(self.directory, on_disk)
        heap.released(freed)
        self._wake()

    # -- on disk: segments -----------------------------------------------------------------

    def _path(self, segment: _Segment, suffix: str) -> str:
        return f"{self._prefix}{segment.number:010d}{suffix}"

    def _write_newest(self) -> None:
        """Put the newest chunk, if not yet written, into the last segment (buffered)."""
        if self._written >= self._head or not self._on_disk:
            return
        chunk = self._cache[-1]
        assert chunk.seq == self._written
        segment = self._segments[-1] if self._segments and self._fds is not None else None
        if segment is None or segment.size >= self._segment_bytes:
            try:
                segment = self._new_segment(chunk)
            except OSError as exc:
                if self._on_disk:  # (else the flush before it failed and switched)
                    self._to_memory(exc)
                return
        stream = self._streams.get(chunk.stream)
        if stream is None:
            stream = self._streams[chunk.stream] = len(self._stream_names)
            self._stream_names.append(chunk.stream)
        self._pending_index += _RECORD.pack(
            segment.size, chunk.offset, chunk.ts, chunk.size, len(chunk.head), stream
        )
        self._pending += (chunk.head, chunk.data)
        self._pending_size += chunk.frame_size
        segment.count += 1
        segment.size += chunk.frame_size
        segment.payload += chunk.size
        segment.cost += self._charge(chunk)
        self._written += 1
        if self._pending_size >= _FLUSH_BYTES:
            self._flush()

    def _new_segment(self, chunk: Chunk) -> _Segment:
        self._flush()
        if not self._on_disk:
            raise self.disk_error or OSError("the log stopped writing to disk")
        self._close_files()
        segment = _Segment(self._next_number, chunk.seq, chunk.offset)
        self._next_number += 1
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        path = self._path(segment, ".frames")
        if self._spare is not None:
            # Written from its start; what is left of its old frames past the new ones is
            # never read (readers go by the index).
            os.rename(self._spare, path)
            self._spare = None
            frames = os.open(path, flags & ~os.O_TRUNC, 0o600)
        else:
            frames = os.open(path, flags, 0o600)
        try:
            index = os.open(self._path(segment, ".index"), flags, 0o600)
        except BaseException:
            os.close(frames)
            raise
        self._fds = (frames, index)
        self._segments.append(segment)
        return segment

    def _flush(self) -> None:
        if not self._pending or self._fds is None:
            return
        frames, index = self._fds
        try:
            _write_all(frames, self._pending)
            _write_all(index, [bytes(self._pending_index)])
        except OSError as exc:
            self._to_memory(exc)
            return
        self._pending, self._pending_size, self._pending_index = [], 0, bytearray()
        self._flushed = self._written

    def _to_memory(self, exc: OSError) -> None:
        """The disk refused a write (full, gone): go on in memory, bounded by the cache
        size. What is on disk is given up (the chunks that the cache holds stay), which
        readers see as a gap, like any eviction; the producer never notices."""
        self.disk_error = exc
        self._memory_from = self._cache_first
        self._close_files()
        self._pending, self._pending_size, self._pending_index = [], 0, bytearray()
        self._flushed = self._written
        if self._first_seq < self._cache_first:
            kept_from = self._cache[0].offset if self._cache else self._total
            self._evicted_bytes += kept_from - self._segments[0].first_offset
            self._first_seq = self._cache_first
        for segment in self._segments:
            _unlink(self._path(segment, ".frames"))
            self._keep_index(segment)
        self._segments.clear()
        if self._spare is not None:
            _unlink(self._spare)
            self._spare = None
        self._limit = min(self.cache_bytes, self.retention_bytes)
        self._retained = sum(chunk.size for chunk in self._cache)
        self._cost = sum(self._charge(chunk) for chunk in self._cache)
        self._evict_from_memory()

    def _close_files(self) -> None:
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = None

    def _evict_segments(self) -> None:
        # Whole segments go, oldest first: deleting a file is the cheapest eviction, and
        # the index of what is left needs no rewriting.
        while self._cost > self.retention_bytes and self._segments:
            segment = self._segments.popleft()
            if not self._segments and self._fds is not None:
                # The segment written to: its frames need not reach the disk, its index
                # does (kept for exact gaps, see _keep_index).
                try:
                    _write_all(self._fds[1], [bytes(self._pending_index)])
                except OSError as exc:
                    self._segments.appendleft(segment)
                    self._to_memory(exc)
                    break
                self._pending, self._pending_size, self._pending_index = [], 0, bytearray()
                self._close_files()
                self._flushed = self._written
            self._retire(self._path(segment, ".frames"))
            self._cost -= segment.cost
            self._retained -= segment.payload
            self._evicted_bytes += segment.payload
            self._first_seq = segment.end_seq
            self._keep_index(segment)
        while self._cache and self._cache[0].seq < self._first_seq:
            old = self._cache.popleft()
            self._cache_cost -= old.frame_size + CHUNK_OVERHEAD
            self._cache_first = old.seq + 1

    def _retire(self, frames: str) -> None:
        _READERS.forget(frames)
        if self._spare is None and self._on_disk:
            spare = self._prefix + "spare"
            with contextlib.suppress(OSError):
                os.rename(frames, spare)
                self._spare = spare
                return
        _unlink(frames)

    def _keep_index(self, segment: _Segment) -> None:
        self._kept.append(segment)
        self._kept_bytes += segment.count * INDEX_RECORD
        # (Bounded in number too: a tiny retention makes segments of one chunk each.)
        kept = self._kept
        while len(kept) > 1 and (self._kept_bytes > self._kept_limit or len(kept) > 4096):
            old = kept.popleft()
            self._kept_bytes -= old.count * INDEX_RECORD
            _unlink(self._path(old, ".index"))
            self._forgotten += array("q", (old.first_seq, old.first_offset))
        if len(self._forgotten) > 2 * 65_536:
            del self._forgotten[: len(self._forgotten) - 65_536]

    def _trim_cache(self) -> None:
        # The newest chunk always stays (it may not be written yet), and a chunk leaves
        # the cache only once its frame is in its file.
        while self._cache_cost > self.cache_bytes and len(self._cache) > 1:
            old = self._cache[0]
            if old.seq >= self._flushed:
                self._flush()
                if not self._on_disk:
                    return  # it failed: the cache is the log now (see _to_memory)
            self._cache.popleft()
            self._cache_cost -= old.frame_size + CHUNK_OVERHEAD
            self._cache_first = old.seq + 1

    def _segment_of(self, seq: int) -> _Segment | None:
        for segments in (self._segments, self._kept):
            for segment in reversed(segments):
                if segment.first_seq <= seq < segment.end_seq:
                    return segment
        return None

    def _record(self, seq: int) -> tuple[int, ...] | None:
        """The index record of chunk ``seq`` (``None`` if no segment has it)."""
        segment = self._segment_of(seq)
        if segment is None:
            return None
        try:
            return self._records(segment, seq, 1)[0]
        except (OSError, IndexError):  # an index the disk refused to complete
            return None

    def _records(self, segment: _Segment, seq: int, count: int) -> list[tuple[int, ...]]:
        """Index records of chunks ``seq ..`` (at most ``count``) of ``segment``."""
        if seq + count > self._flushed:
            self._flush()
        data = _pread(
            self._path(segment, ".index"),
            count * INDEX_RECORD,
            (seq - segment.first_seq) * INDEX_RECORD,
        )
        return list(_RECORD.iter_unpack(data))

    def _read_disk(self, cursor: int, max_bytes: int, chunks: list[Chunk], size: int) -> int:
        """Append chunks ``cursor ..`` from disk (below the cache) to ``chunks``, while
        they fit in ``max_bytes`` (at least one); returns the payload size read."""
        while cursor < self._cache_first and len(chunks) < _READ_RECORDS:
            segment = self._segment_of(cursor)
            if segment is None or cursor < self._first_seq:
                break
            end = min(segment.end_seq, self._cache_first, cursor + _READ_RECORDS - len(chunks))
            records = self._records(segment, cursor, end - cursor)
            taken = 0
            for record in records:
                if (chunks or taken) and size + record[3] > max_bytes:
                    break
                size += record[3]
                taken += 1
            if taken == 0:
                return size
            start = records[0][0]
            last = records[taken - 1]
            stop = last[0] + last[4] + last[3]
            frames = _pread(self._path(segment, ".frames"), stop - start, start)
            for pos, offset, ts, payload, head_size, stream in records[:taken]:
                at = pos - start
                head = frames[at : at + head_size]
                data = frames[at + head_size : at + head_size + payload]
                name = self._stream_names[stream]
                chunks.append(Chunk(cursor, name, offset, ts, payload, head, data))
                cursor += 1
            if taken < len(records):
                break
        return size

    # -- reading --------------------------------------------------------------------------

    def ts_of(self, seq: int) -> float | None:
        """When retained chunk ``seq`` was written (``None`` if it is not held); unlike
        :meth:`read`, looking does not count as reading."""
        if not self._first_seq <= seq < self._head:
            return None
        if seq >= self._cache_first:
            return self._cache[seq - self._cache_first].ts
        record = self._record(seq)
        return None if record is None else float(record[2])

    def offset_of(self, seq: int) -> int:
        """Byte offset at which chunk ``seq`` starts (``total_bytes`` at or past the head).

        For evicted chunks the offset comes from a bounded index (in memory, the newest
        evicted chunks'; on disk, the index files of the newest evicted segments); older
        than that, where its segment began (0 in memory)."""
        if seq >= self._head:
            return self._total
        if seq >= self._cache_first and self._cache:
            return self._cache[seq - self._cache_first].offset
        if seq >= self._memory_from:
            index = seq - (self._first_seq - len(self._evicted_offsets))
            if index >= 0 or self.directory is None:
                return self._evicted_offsets[index] if index >= 0 else 0
        record = self._record(seq)
        if record is not None:
            return int(record[1])
        forgotten = self._forgotten
        for i in range(len(forgotten) - 2, -1, -2):
            if forgotten[i] <= seq:
                return forgotten[i + 1]
        return 0

    def read(self, cursor: int, max_bytes: int) -> tuple[Gap | None, list[Chunk]]:
        """Chunks from ``cursor`` on, at most about ``max_bytes`` (at least one if any).

        If ``cursor`` is behind retention, a :class:`Gap` says what was lost and reading
        starts at the oldest retained chunk.
        """
        asked = cursor
        gap = None
        if cursor < self._first_seq:
            lost = self.offset_of(self._first_seq) - self.offset_of(cursor)
            gap = Gap(cursor, self._first_seq, lost)
            cursor = self._first_seq
        chunks: list[Chunk] = []
        size = 0
        if cursor < self._cache_first:
            try:
                size = self._read_disk(cursor, max_bytes, chunks, size)
            except OSError as exc:
                # Unreadable (a file removed under the daemon, an I/O error): what is on
                # disk is lost, and said so with a gap, never an exception to the reader.
                self._to_memory(exc)
                return self.read(asked, max_bytes)
            if chunks and chunks[-1].seq + 1 < self._cache_first:
                self._read_horizon = max(self._read_horizon, chunks[-1].seq + 1)
                return gap, chunks
            cursor += len(chunks)
        index = cursor - self._cache_first
        cache = self._cache
        while 0 <= index < len(cache):
            chunk = cache[index]
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


_IOV_MAX = 1024


def _write_all(fd: int, parts: list[bytes]) -> None:
    # Gathered, not joined: a 64 KiB payload is copied once, into the page cache.
    start = 0
    while start < len(parts):
        batch = parts[start : start + _IOV_MAX]
        written = os.writev(fd, batch)
        start += len(batch)
        size = sum(len(p) for p in batch)
        if written < size:  # short write (rare on a regular file): the rest by hand
            rest = memoryview(b"".join(batch))[written:]
            while rest:
                rest = rest[os.write(fd, rest) :]


_REMOVE_IN_THREAD = 64 << 20
"""A log with more than this on disk is deleted off the event loop (~60 ms per GiB)."""


_REMOVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandboxkit-remove")
"""Deletes large logs in the background, one directory after the other (so the removal of
a directory and of the one holding it never race). Its thread starts on first use and is
joined at interpreter exit."""


def _remove(directory: Path, size: int) -> None:
    if size <= _REMOVE_IN_THREAD:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        _REMOVER.submit(shutil.rmtree, directory, True)


async def remove_tree(directory: str | os.PathLike[str]) -> None:
    """Delete ``directory`` and what is in it, off the event loop, after the large logs
    closed before (a sandbox's runtime directory, once its logs are closed)."""
    await asyncio.wrap_future(_REMOVER.submit(shutil.rmtree, directory, True))


class _ReadFiles:
    """Files open for reading, shared by every log of the daemon: the most recently read
    :data:`_READ_FILES` of them, so a reader catching up does not open its segment for
    every batch (an open cost as much as the read), and a daemon with many logs does not
    run out of descriptors. Reads are of recent data (the page cache) and at most about a
    send batch: fast enough for the event loop."""

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._fds[path] = fd
        if len(self._fds) > _READ_FILES:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def forget(self, path: str) -> None:
        """``path`` is about to be removed or renamed."""
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def forget_all(self, prefix: str) -> None:
        for path in [p for p in self._fds if p.startswith(prefix)]:
            self.forget(path)


_READ_FILES = 32
_READERS = _ReadFiles()


def _unlink(path: str) -> None:
    _READERS.forget(path)
    with contextlib.suppress(OSError):
        os.unlink(path)


def _pread(path: str, size: int, offset: int) -> bytes:
    fd = _READERS.fd(path)
    data = os.pread(fd, size, offset)
    while len(data) < size:
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            raise OSError(f"{path}: {size} bytes expected at {offset}, file too short")
        data += more
    return data
