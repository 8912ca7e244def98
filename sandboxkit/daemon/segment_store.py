"""Where an output log keeps its chunks on disk: append-only segment files, each with a
fixed-size index, read back with ``os.pread`` and given back a whole segment at a time.

The log (:mod:`sandboxkit.daemon.output_log`) decides what is retained and what is cached
in memory; this module only stores frames and finds them again. Every method that touches
the disk raises :class:`OSError` when the disk refuses; the log then goes on in memory
(:meth:`SegmentStore.abandon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import shutil
import struct
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

__all__ = ["INDEX_RECORD", "Segment", "SegmentStore", "remove_tree"]

# One index record per chunk, in the segment's ``.index`` file at ``(seq - first) * size``:
# where its frame starts in the ``.frames`` file, its byte offset, time, payload size,
# head length and stream. Fixed-size, so chunk ``seq`` is found without a search, and the
# index costs no memory: the page cache holds what is read often.
_RECORD = struct.Struct("<QqdQHB")

INDEX_RECORD = _RECORD.size
"""Bytes of index on disk per chunk (charged to retention with the frame)."""

_FLUSH_BYTES = 256 * 1024
"""Frames are written in batches of about this many bytes (one syscall for many chunks)."""

READ_RECORDS = 512
"""Most chunks one read returns from disk: each is an object to build (~2 us), and a read
runs on the event loop; 512 tiny chunks take about a millisecond."""

MAX_SEGMENT = 8 << 20
"""Largest segment file; retention is given back a segment at a time. No larger than the
daemon's default output cache: readers behind the cache then read sealed segments, which
are mapped, rather than the one being written, which is read with a copy (64 MiB segments
made most reads of a large retention copies: P7 of benchmarks/compare.py)."""


class StoredChunk(Protocol):
    """What the store needs of a chunk to write it (the log's ``Chunk``)."""

    @property
    def seq(self) -> int: ...
    @property
    def stream(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def ts(self) -> float: ...
    @property
    def size(self) -> int: ...
    @property
    def head(self) -> bytes | memoryview: ...
    @property
    def data(self) -> bytes | memoryview: ...


C = TypeVar("C")

MakeChunk = Callable[[int, str, int, float, int, memoryview, memoryview], C]
"""Builds a chunk read back: ``(seq, stream, offset, ts, size, head, data)``; ``head`` and
``data`` are views into the one buffer a read returns (slicing them out as ``bytes``
copied every byte a second time: up to a quarter of the daemon's CPU when many readers
are behind the cache, benchmarks/compare.py P7)."""


@dataclass(slots=True)
class Segment:
    """One pair of append-only files holding chunks ``first_seq ..`` (``count`` of them)."""

    number: int
    first_seq: int
    first_offset: int
    count: int = 0
    size: int = 0
    """Bytes of frames (written or waiting to be)."""
    payload: int = 0
    cost: int = 0
    """What retention was charged for its chunks (the log's accounting)."""

    @property
    def end_seq(self) -> int:
        return self.first_seq + self.count


class SegmentStore:
    """The segments of one log, in ``directory`` (created here; :meth:`close` removes it).

    Chunks are written in order (:meth:`write`), buffered and flushed in batches; the
    last segment is the one written to, and a new one starts at ``segment_bytes``. Evicted
    segments (:meth:`evict_oldest`) lose their frames at once but keep their index, up to
    ``kept_limit`` bytes of it, so a gap from a cursor in them says exactly how many bytes
    were lost; older ones are remembered by where they began only.
    """

    def __init__(self, directory: Path, *, segment_bytes: int, kept_limit: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._prefix = os.path.join(directory, "")
        self._segment_bytes = segment_bytes
        self.segments: deque[Segment] = deque()
        """The segments retained, oldest first (the last one is written to)."""
        self.written = 0
        """Chunks below this seq are in segments (their frames maybe still buffered)."""
        self.flushed = 0
        """Chunks below this seq are in their files."""
        self._pending: list[bytes | memoryview] = []
        self._pending_size = 0
        self._pending_index = bytearray()
        self._fds: tuple[int, int] | None = None  # the last segment's (frames, index)
        self._streams: dict[str, int] = {}
        self._stream_names: list[str] = []
        self._kept: deque[Segment] = deque()
        self._kept_bytes = 0
        self._kept_limit = kept_limit
        self._forgotten = array("q")  # first_seq, first_offset pairs
        self._next_number = 0
        # An evicted segment's frames file, kept to be written over by the next segment:
        # overwriting pages the page cache holds costs half as much as writing new ones
        # (measured), and spares an unlink.
        self._spare: str | None = None
        self._abandoned = False

    @property
    def memory_bytes(self) -> int:
        """What the store holds in memory (buffers and bookkeeping)."""
        size = len(self._pending_index) + 8 * len(self._forgotten)
        return size + 120 * (len(self.segments) + len(self._kept))

    # -- writing --------------------------------------------------------------------------

    def write(self, chunk: StoredChunk, cost: int) -> None:
        """Add chunk ``written`` to the last segment (buffered), starting a new segment
        when the last one is full."""
        assert chunk.seq == self.written
        segment = self.segments[-1] if self.segments and self._fds is not None else None
        if segment is None or segment.size >= self._segment_bytes:
            segment = self._new_segment(chunk)
        stream = self._streams.get(chunk.stream)
        if stream is None:
            stream = self._streams[chunk.stream] = len(self._stream_names)
            self._stream_names.append(chunk.stream)
        frame_size = len(chunk.head) + chunk.size
        self._pending_index += _RECORD.pack(
            segment.size, chunk.offset, chunk.ts, chunk.size, len(chunk.head), stream
        )
        self._pending += (chunk.head, chunk.data)
        self._pending_size += frame_size
        segment.count += 1
        segment.size += frame_size
        segment.payload += chunk.size
        segment.cost += cost
        self.written += 1
        if self._pending_size >= _FLUSH_BYTES:
            self.flush()

    def _new_segment(self, chunk: StoredChunk) -> Segment:
        self.flush()
        self.close_files()
        segment = Segment(self._next_number, chunk.seq, chunk.offset)
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
        self.segments.append(segment)
        return segment

    def flush(self) -> None:
        """Write what is buffered to the last segment's files."""
        if not self._pending or self._fds is None:
            return
        frames, index = self._fds
        _write_all(frames, self._pending)
        _write_all(index, [bytes(self._pending_index)])
        self._drop_pending()

    def _drop_pending(self) -> None:
        self._pending, self._pending_size, self._pending_index = [], 0, bytearray()
        self.flushed = self.written

    def close_files(self) -> None:
        """Close the last segment's files (nothing more is written to it)."""
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = None

    # -- giving back ----------------------------------------------------------------------

    def evict_oldest(self) -> Segment:
        """Delete the oldest segment's frames (its index is kept a while); returns it."""
        # Deleting a file is the cheapest eviction, and the index of what is left needs
        # no rewriting.
        segment = self.segments.popleft()
        if not self.segments and self._fds is not None:
            # The segment written to: its frames need not reach the disk, its index does
            # (kept for exact gaps).
            try:
                _write_all(self._fds[1], [bytes(self._pending_index)])
            except OSError:
                self.segments.appendleft(segment)
                raise
            self._drop_pending()
            self.close_files()
        self._retire(self._path(segment, ".frames"))
        self._keep_index(segment)
        return segment

    def _retire(self, frames: str) -> None:
        # A file whose mapping still has views out is not written over: it is unlinked,
        # and its pages stay readable until the last view goes.
        unused = _READERS.forget(frames)
        if unused and self._spare is None and not self._abandoned:
            spare = self._prefix + "spare"
            with contextlib.suppress(OSError):
                os.rename(frames, spare)
                self._spare = spare
                return
        _unlink(frames)

    def _keep_index(self, segment: Segment) -> None:
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

    def abandon(self) -> None:
        """The disk refused: give up every segment's frames (their indexes are kept for
        exact gaps) and write nothing more."""
        self._abandoned = True
        self.close_files()
        self._drop_pending()
        for segment in self.segments:
            _unlink(self._path(segment, ".frames"))
            self._keep_index(segment)
        self.segments.clear()
        if self._spare is not None:
            _unlink(self._spare)
            self._spare = None

    def close(self) -> None:
        """Delete the files (large ones off the event loop) and forget everything."""
        self._abandoned = True
        self.close_files()
        self._drop_pending()
        on_disk = sum(segment.size for segment in self.segments)
        self.segments.clear()
        self._kept.clear()
        self._forgotten = array("q")
        _READERS.forget_all(self._prefix)
        _remove(self.directory, on_disk)

    # -- reading --------------------------------------------------------------------------

    def _path(self, segment: Segment, suffix: str) -> str:
        return f"{self._prefix}{segment.number:010d}{suffix}"

    def _segment_of(self, seq: int, *, kept: bool) -> Segment | None:
        for segments in (self.segments, self._kept) if kept else (self.segments,):
            for segment in reversed(segments):
                if segment.first_seq <= seq < segment.end_seq:
                    return segment
        return None

    def record(self, seq: int) -> tuple[int, ...] | None:
        """The index record of chunk ``seq``, retained or evicted with its index kept
        (``None`` if no segment has it): ``(position, offset, ts, size, head, stream)``."""
        segment = self._segment_of(seq, kept=True)
        if segment is None:
            return None
        try:
            return next(self._records(segment, seq, 1))
        except (OSError, StopIteration):  # an index the disk refused to complete
            return None

    def offset_of(self, seq: int) -> int | None:
        """Byte offset of chunk ``seq`` from an index, or where the forgotten segment
        holding it began (``None`` if the store never knew it)."""
        record = self.record(seq)
        if record is not None:
            return int(record[1])
        forgotten = self._forgotten
        for i in range(len(forgotten) - 2, -1, -2):
            if forgotten[i] <= seq:
                return forgotten[i + 1]
        return None

    def _sealed(self, segment: Segment) -> bool:
        """Nothing more is written to ``segment``: every frame and record is in its files."""
        return self._fds is None or segment is not self.segments[-1]

    def _records(self, segment: Segment, seq: int, count: int) -> Iterator[tuple[int, ...]]:
        """Index records of chunks ``seq ..`` (at most ``count``) of ``segment``, unpacked
        as they are taken (a reader takes a few of the many it may)."""
        if seq + count > self.flushed:
            self.flush()
        start = (seq - segment.first_seq) * INDEX_RECORD
        path = self._path(segment, ".index")
        total = segment.count * INDEX_RECORD
        return _RECORD.iter_unpack(
            self._bytes(segment, path, total, start, start + count * INDEX_RECORD)
        )

    def _bytes(self, segment: Segment, path: str, total: int, start: int, stop: int) -> memoryview:
        """Bytes ``start .. stop`` of one of ``segment``'s files (``total`` bytes long once
        sealed): a view of its mapping if the segment is sealed, else — or where the file
        cannot be mapped — a copy read with ``pread``."""
        if self._sealed(segment) and total:
            view = _READERS.mapped(path, total)
            if view is not None:
                return view[start:stop]
        return memoryview(_pread(path, stop - start, start))

    def read(
        self,
        cursor: int,
        stop: int,
        max_bytes: int,
        chunks: list[C],
        size: int,
        make: MakeChunk[C],
    ) -> int:
        """Append chunks ``cursor ..`` (before ``stop``) of the retained segments to
        ``chunks``, built by ``make``, while their payloads fit in ``max_bytes`` (at least
        one, at most :data:`READ_RECORDS` in ``chunks``); returns ``size`` plus the
        payload bytes read."""
        while cursor < stop and len(chunks) < READ_RECORDS:
            segment = self._segment_of(cursor, kept=False)
            if segment is None:
                break
            end = min(segment.end_seq, stop, cursor + READ_RECORDS - len(chunks))
            records: list[tuple[int, ...]] = []
            full = False
            for record in self._records(segment, cursor, end - cursor):
                if (chunks or records) and size + record[3] > max_bytes:
                    full = True
                    break
                size += record[3]
                records.append(record)
            if not records:
                return size
            start = records[0][0]
            last = records[-1]
            stop_at = last[0] + last[4] + last[3]
            path = self._path(segment, ".frames")
            frames = self._bytes(segment, path, segment.size, start, stop_at)
            names = self._stream_names
            for pos, offset, ts, payload, head_size, stream in records:
                at = pos - start
                head = frames[at : at + head_size]
                data = frames[at + head_size : at + head_size + payload]
                chunks.append(make(cursor, names[stream], offset, ts, payload, head, data))
                cursor += 1
            if full:
                break
        return size


_IOV_MAX = 1024


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
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
"""A store with more than this on disk is deleted off the event loop (~60 ms per GiB)."""


_REMOVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandboxkit-remove")
"""Deletes large stores in the background, one directory after the other (so the removal
of a directory and of the one holding it never race). Its thread starts on first use and
is joined at interpreter exit."""


def _remove(directory: Path, size: int) -> None:
    if size <= _REMOVE_IN_THREAD:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        _REMOVER.submit(shutil.rmtree, directory, True)


async def remove_tree(directory: str | os.PathLike[str]) -> None:
    """Delete ``directory`` and what is in it, off the event loop, after the large stores
    closed before (a sandbox's runtime directory, once its logs are closed)."""
    await asyncio.wrap_future(_REMOVER.submit(shutil.rmtree, directory, True))


class _ReadFiles:
    """Files open for reading, shared by every store of the daemon: the most recently read
    :data:`_READ_FILES` of them, so a reader catching up does not open its segment for
    every batch (an open cost as much as the read), and a daemon with many logs does not
    run out of descriptors. Reads are of recent data (the page cache) and at most about a
    send batch: fast enough for the event loop.

    A sealed segment (nothing more is written to it) is read through a mapping instead,
    the :data:`_MAPPED` most recently read of them: a reader gets views of the page cache,
    and the only copy of its bytes is the one into the socket, as for a chunk in memory.
    Reading with ``pread`` copied every byte once more for every reader behind the cache:
    a quarter of the daemon's CPU with 16 readers (benchmarks/compare.py, P7). The pages
    count in the daemon's RSS while mapped (as file pages: the kernel may drop them)."""

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._held: list[tuple[str, mmap.mmap]] = []
        """Mappings let go of while views of them were still out (a sender's chunks), kept
        track of until they close: their files must not be written over before."""

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

    def mapped(self, path: str, size: int) -> memoryview | None:
        """The first ``size`` bytes of the sealed file ``path``, mapped; ``None`` if it
        cannot be (a file system without ``mmap``, a file shorter than that)."""
        mapping = self._maps.get(path)
        if mapping is None or len(mapping) < size:
            if mapping is not None:
                self._let_go(path, self._maps.pop(path))
            self._held = [(p, held) for p, held in self._held if not _unmap(held)]
            # Not populated up front (MAP_POPULATE): readers of many logs taking turns
            # would map whole segments over and over to read a batch of each.
            try:
                with open(path, "rb") as file:
                    mapping = mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ)
            except (OSError, ValueError):
                return None
            self._maps[path] = mapping
            if len(self._maps) > _MAPPED:
                self._let_go(*self._maps.popitem(last=False))
        else:
            self._maps.move_to_end(path)
        return memoryview(mapping)[:size]

    def forget(self, path: str) -> bool:
        """``path`` is about to be removed or renamed; ``False`` if views of its mapping
        are still in use (senders hold them): its pages must not be written over."""
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)
        mappings = [m for p, m in self._held if p == path]
        self._held = [(p, m) for p, m in self._held if p != path]
        mapping = self._maps.pop(path, None)
        if mapping is not None:
            mappings.append(mapping)
        # (One that cannot close goes when its last view does.)
        return all([_unmap(m) for m in mappings])

    def forget_all(self, prefix: str) -> None:
        paths = {*self._fds, *self._maps, *(p for p, _ in self._held)}
        for path in [p for p in paths if p.startswith(prefix)]:
            self.forget(path)

    def _let_go(self, path: str, mapping: mmap.mmap) -> None:
        if not _unmap(mapping):
            self._held.append((path, mapping))


def _unmap(mapping: mmap.mmap) -> bool:
    # A mapping with views still out (a chunk a consumer has not sent yet) cannot be
    # closed: it goes when its last view does.
    try:
        mapping.close()
    except BufferError:
        return False
    return True


_READ_FILES = 32
_MAPPED = 16
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
