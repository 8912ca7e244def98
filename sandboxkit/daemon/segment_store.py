"""Where an output log keeps its chunks on disk: append-only segment files, each with a
fixed-size index, read back with ``os.pread`` and given back a whole segment at a time.

The log (:mod:`sandboxkit.daemon.output_log`) decides what is retained and what is cached
in memory; this module only stores frames and finds them again. Every method that touches
the disk raises :class:`OSError` when the disk refuses; the log then goes on in memory
(:meth:`SegmentStore.abandon`).

Everything on disk is untrusted. The files live in the daemon's own runtime directory,
not beside a sandbox's working directory, but a process running as the daemon's user
can still find them and write, shrink or replace them at any moment (without the
namespaces of ``docs/isolation.md`` nothing hides a path from the same user; files
unlinked after opening would still be reachable through ``/proc/<daemon>/fd``, and
would cost a descriptor per segment, kept for its life). So:

* Nothing is read through a mapping. A mapped page past a file's new end, once someone
  shrinks it, kills the daemon with ``SIGBUS`` wherever Python touches it (a sender
  joining a frame), and bytes checked in a shared mapping can change after the check.
  Reads copy with ``pread`` into private memory, where neither can happen, and readers
  at the same place share one verified copy (:mod:`.segment_blocks`), so the copy and
  its check are paid once per block, not once per reader. (Where no one else can write
  the files, frames also go out of them unread, with ``sendfile``: :meth:`SegmentStore.span`
  and :mod:`~sandboxkit.daemon.file_span`, which says when they are checked.)
* Every frame's index record carries the CRC-32 of the frame and of the record itself
  (in the index, not in the frames file: the frames file stays exactly the bytes a
  client gets, so that a run of frames is a run of the file). A record or frame that is
  missing, short or fails its check makes the store raise :class:`SegmentDamaged`; the
  log then gives up that segment and everything older, which readers see as an exact
  gap, like any eviction: never a crash, never a malformed frame.
* Files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be regular files (a FIFO
  put in a segment's place would otherwise block the event loop, a symlink redirect a
  write); new ones with ``O_EXCL``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import struct
import zlib
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, cast

from sandboxkit.daemon.file_span import FileSpan
from sandboxkit.daemon.segment_blocks import BLOCK_BYTES as _BLOCK_BYTES
from sandboxkit.daemon.segment_blocks import BLOCKS as _BLOCKS
from sandboxkit.daemon.segment_blocks import Block as _Block
from sandboxkit.daemon.segment_blocks import Blocks as _Blocks  # noqa: F401 (tests size their own)
from sandboxkit.daemon.segment_blocks import Record
from sandboxkit.daemon.segment_files import READERS as _READERS
from sandboxkit.daemon.segment_files import open_file as _open
from sandboxkit.daemon.segment_files import pread as _pread
from sandboxkit.daemon.segment_files import pread_into as _pread_into
from sandboxkit.daemon.segment_files import remove as _remove
from sandboxkit.daemon.segment_files import remove_tree
from sandboxkit.daemon.segment_files import unlink as _unlink
from sandboxkit.daemon.segment_files import write_all as _write_all
from sandboxkit.wire import FrameKind

__all__ = ["INDEX_RECORD", "Segment", "SegmentDamaged", "SegmentStore", "remove_tree"]

# One index record per chunk, in the segment's ``.index`` file at ``(seq - first) * size``:
# where its frame starts in the ``.frames`` file, its byte offset, time, payload size,
# head length and stream, the CRC-32 of its frame, and the CRC-32 of the record itself
# (its fields, started from the chunk's seq: a record copied to another place fails).
# Fixed-size, so chunk ``seq`` is found without a search, and the index costs no memory:
# the page cache holds what is read often.
_FIELDS = struct.Struct("<QqdQHBI")
_CRC = struct.Struct("<I")
_RECORD = struct.Struct("<QqdQHBII")

INDEX_RECORD = _RECORD.size
"""Bytes of index on disk per chunk (charged to retention with the frame)."""

_FRAME_HEADER = struct.Struct("!BII")
"""The fixed start of every frame (:func:`sandboxkit.wire.encode_frame_head`): kind, meta
length, payload length; checked on each frame read back, besides its CRC."""

_FLUSH_BYTES = 256 * 1024
"""Frames are written in batches of about this many bytes (one syscall for many chunks)."""

READ_RECORDS = 512
"""Most chunks one read returns from disk: each is an object to build (~2 us), and a read
runs on the event loop; 512 tiny chunks take about a millisecond."""

MAX_SEGMENT = 8 << 20
"""Largest segment file; retention is given back a segment at a time. No larger than the
daemon's default output cache, so that readers behind the cache mostly read segments
nothing is written to any more."""


def _payload_crc32() -> Callable[[bytes | memoryview, int], int]:
    # ISA-L's CRC-32 (``sandboxkit[fast]``) is the same checksum as zlib's, computed with
    # carry-less multiplication: ~28 GB/s against zlib's ~3 on this project's machine, so
    # checking every byte written costs the producer ~0.04 CPU-s per GB instead of ~0.3.
    try:
        module = importlib.import_module("isal.isal_zlib")
    except ImportError:
        return zlib.crc32
    return cast("Callable[[bytes | memoryview, int], int]", module.crc32)


_payload_crc = _payload_crc32()


def _frame_crc(head: bytes | memoryview, data: bytes | memoryview) -> int:
    """The CRC-32 of a frame: its head, then its payload (zlib for what is small: ISA-L
    costs more per call)."""
    crc = zlib.crc32(head)
    return _payload_crc(data, crc) if len(data) > 1024 else zlib.crc32(data, crc)


class SegmentDamaged(OSError):
    """A segment's files no longer hold what was written to them: shrunk, overwritten,
    zeroed or replaced (by a process running as the daemon's user, or the disk)."""

    def __init__(self, segment: Segment, why: str) -> None:
        super().__init__(f"segment {segment.number} damaged: {why}")
        self.segment = segment


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
``data`` are views into the one private copy a read made (slicing them out as ``bytes``
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
    verified: int = 0
    """Chunks ``first_seq .. verified - 1`` were read back and found as written (their
    frames may be sent without another look: :mod:`~sandboxkit.daemon.file_span`)."""
    pins: int = 0
    """Spans of its frames file being sent: the file is not written over until none."""

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
        # Its parent now (an error here is the log's ``disk_error`` from the start); the
        # directory itself with the first segment: most commands print nothing, and a
        # mkdir and its removal were a tenth of the daemon's CPU for a ``run(["true"])``.
        if not directory.parent.is_dir():
            directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = directory
        self._made = False
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
        # (measured), and spares an unlink. (Readers hold private copies, never the
        # file's pages: writing over it changes nothing they hold.)
        self._spare: str | None = None
        self._abandoned = False
        self.blocks: list[_Block] = []
        """Copies read back recently (at most a few; see :mod:`.segment_blocks`)."""

    @property
    def memory_bytes(self) -> int:
        """What the store holds in memory (buffers, copies read back, bookkeeping)."""
        size = len(self._pending_index) + 8 * len(self._forgotten)
        size += sum(block.size for block in self.blocks)
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
        # The checksums are of the daemon's own copy, before anything reaches the disk.
        crc = _frame_crc(chunk.head, chunk.data)
        fields = _FIELDS.pack(
            segment.size, chunk.offset, chunk.ts, chunk.size, len(chunk.head), stream, crc
        )
        self._pending_index += fields
        self._pending_index += _CRC.pack(zlib.crc32(fields, chunk.seq & 0xFFFFFFFF))
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
        if not self._made:
            self.directory.mkdir(mode=0o700, exist_ok=True)
            self._made = True
        segment = Segment(self._next_number, chunk.seq, chunk.offset, verified=chunk.seq)
        self._next_number += 1
        create = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        path = self._path(segment, ".frames")
        if self._spare is not None:
            # Written from its start; what is left of its old frames past the new ones is
            # never read (readers go by the index).
            os.rename(self._spare, path)
            self._spare = None
            frames = _open(path, os.O_WRONLY)
        else:
            frames = _open(path, create)
        try:
            index = _open(self._path(segment, ".index"), create)
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
        _BLOCKS.drop(self, before=segment.end_seq)
        self._retire(segment)
        self._keep_index(segment)
        return segment

    def _retire(self, segment: Segment) -> None:
        frames = self._path(segment, ".frames")
        _READERS.forget(frames)
        # A file being sent (a span holds it) is unlinked, never written over: the send
        # goes on with the bytes it was checked to hold.
        if self._spare is None and not self._abandoned and not segment.pins:
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
        _BLOCKS.drop(self)
        for segment in self.segments:
            _unlink(self._path(segment, ".frames"))
            self._keep_index(segment)
        self.segments.clear()
        if self._spare is not None:
            _unlink(self._spare)
            self._spare = None

    def drop_copies(self) -> None:
        """Let go of the copies read back (readers holding chunks keep theirs)."""
        _BLOCKS.drop(self)

    def close(self) -> None:
        """Delete the files (large ones off the event loop) and forget everything."""
        self._abandoned = True
        self.close_files()
        self._drop_pending()
        _BLOCKS.drop(self)
        on_disk = sum(segment.size for segment in self.segments)
        self.segments.clear()
        self._kept.clear()
        self._forgotten = array("q")
        _READERS.forget_all(self._prefix)
        if self._made:
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

    def _index(self, segment: Segment, seq: int, end: int) -> bytes:
        """The index records of chunks ``seq .. end - 1`` of ``segment`` as in its file
        (fewer if the file is shorter than it should be)."""
        if end > self.flushed:
            self.flush()
        start = (seq - segment.first_seq) * INDEX_RECORD
        return _pread(self._path(segment, ".index"), (end - seq) * INDEX_RECORD, start)

    def _records(self, segment: Segment, seq: int, raw: bytes, payload: int = 0) -> list[Record]:
        """The records in ``raw`` (chunks ``seq ..``) up to the first that fails its
        check or does not follow from the one before, and (with ``payload``) no more than
        it takes to hold that many payload bytes (checked as they are taken: a reader
        uses a few of the many a read may cover)."""
        records: list[Record] = []
        held = 0
        names = len(self._stream_names)
        position = 0 if seq == segment.first_seq else -1
        offset = segment.first_offset if seq == segment.first_seq else -1
        for record in _RECORD.iter_unpack(raw[: len(raw) - len(raw) % INDEX_RECORD]):
            at = len(records) * INDEX_RECORD
            checked = zlib.crc32(raw[at : at + _FIELDS.size], (seq + len(records)) & 0xFFFFFFFF)
            pos, off, _ts, size, head, stream, _frame_crc, crc = record
            if (
                crc != checked
                or (position >= 0 and pos != position)
                or (offset >= 0 and off != offset)
                or stream >= names
                or head < _FRAME_HEADER.size
                or pos + head + size > segment.size
            ):
                break
            records.append(record)
            position, offset = pos + head + size, off + size
            held += size
            if payload and held >= payload:
                break
        return records

    def record(self, seq: int) -> Record | None:
        """The index record of chunk ``seq``, retained or evicted with its index kept
        (``None`` if no segment has it or its record fails its check):
        ``(position, offset, ts, size, head, stream, frame CRC, record CRC)``."""
        segment = self._segment_of(seq, kept=True)
        if segment is None:
            return None
        try:
            records = self._records(segment, seq, self._index(segment, seq, seq + 1))
        except OSError:  # an index the disk refused to complete
            return None
        return records[0] if records else None

    def offset_of(self, seq: int) -> int | None:
        """Byte offset of chunk ``seq`` from an index, or where the segment holding it
        began if its index cannot tell (``None`` if the store never knew it)."""
        segment = self._segment_of(seq, kept=True)
        if segment is not None:
            if seq == segment.first_seq:
                return segment.first_offset
            record = self.record(seq)
            return segment.first_offset if record is None else record[1]
        forgotten = self._forgotten
        for i in range(len(forgotten) - 2, -1, -2):
            if forgotten[i] <= seq:
                return forgotten[i + 1]
        return None

    def _load(self, segment: Segment, cursor: int, stop: int, *, keep: bool = True) -> _Block:
        """Copy chunks ``cursor ..`` of ``segment`` out of its files and check them
        (raises :class:`SegmentDamaged` if chunk ``cursor`` fails); ``keep``: share the
        copy with the readers that come by (else it only checked the frames)."""
        end = min(segment.end_seq, stop, cursor + READ_RECORDS)
        raw = self._index(segment, cursor, end)
        records = self._records(segment, cursor, raw, _BLOCK_BYTES)
        if not records:
            raise SegmentDamaged(segment, f"index record of chunk {cursor}")
        start = records[0][0]
        last = records[-1]
        length = last[0] + last[4] + last[3] - start
        buffer = _BLOCKS.buffer(length)
        frames = _pread_into(self._path(segment, ".frames"), buffer, length, start)
        good = 0
        for pos, _off, _ts, size, head, _stream, crc, _ in records:
            at = pos - start
            if (
                at + head + size > len(frames)
                or _FRAME_HEADER.unpack_from(frames, at)
                != (FrameKind.DATA, head - _FRAME_HEADER.size, size)
                or _frame_crc(frames[at : at + head], frames[at + head : at + head + size]) != crc
            ):
                break
            good += 1
        if not good:
            raise SegmentDamaged(segment, f"frame of chunk {cursor}")
        del records[good:]
        block = _Block(self, cursor, records, frames, buffer, len(buffer))
        if cursor <= segment.verified < block.end_seq:
            segment.verified = block.end_seq
        if keep:
            _BLOCKS.add(block)
        return block

    def span(self, cursor: int, stop: int, max_bytes: int, fresh: int) -> FileSpan | None:
        """The frames of chunks ``cursor ..`` (before ``stop``, in one segment, about
        ``max_bytes`` of payload, at least one chunk) as a run of its frames file, checked
        unless at or past ``fresh`` (chunks the log still holds in memory, written
        moments ago: see :mod:`~sandboxkit.daemon.file_span`); ``None`` if no retained
        segment holds ``cursor``. Raises
        :class:`SegmentDamaged` if chunk ``cursor`` cannot be read back as written, or the
        file is shorter than its frames (see :mod:`~sandboxkit.daemon.file_span`)."""
        segment = self._segment_of(cursor, kept=False)
        if segment is None:
            return None
        while segment.verified <= cursor < fresh:
            # Checked once, the first time any reader gets there: one copy for every
            # reader, not kept (the spans send from the file).
            block = self._load(segment, segment.verified, stop, keep=False)
            block.frames.release()
            _BLOCKS.give_back(block.buffer)
        end = min(stop if cursor >= fresh else segment.verified, stop, cursor + READ_RECORDS)
        records = self._records(segment, cursor, self._index(segment, cursor, end), max_bytes)
        if not records:
            raise SegmentDamaged(segment, f"index record of chunk {cursor}")
        start = records[0][0]
        last = records[-1]
        size = last[0] + last[4] + last[3] - start
        fd = os.dup(_READERS.fd(self._path(segment, ".frames")))
        try:
            if os.fstat(fd).st_size < start + size:
                raise SegmentDamaged(
                    segment, f"frames file shorter than chunk {cursor + len(records) - 1}"
                )
        except BaseException:
            os.close(fd)
            raise
        segment.pins += 1
        payload = sum(record[3] for record in records)
        return FileSpan(fd, start, size, cursor, len(records), payload, last[1] + last[3], segment)

    def _block_at(self, seq: int) -> _Block | None:
        for block in reversed(self.blocks):
            if block.first_seq <= seq < block.end_seq:
                _BLOCKS.touch(block)
                return block
        return None

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
        payload bytes read.

        Raises :class:`SegmentDamaged` if chunk ``cursor`` cannot be read back as it was
        written (only when ``chunks`` is empty: a read that has some stops before)."""
        names = self._stream_names
        while cursor < stop and len(chunks) < READ_RECORDS:
            block = self._block_at(cursor)
            if block is None:
                segment = self._segment_of(cursor, kept=False)
                if segment is None:
                    break
                try:
                    block = self._load(segment, cursor, stop)
                except SegmentDamaged:
                    if chunks:
                        return size  # what came before is intact; the next read says
                    raise
            records, frames = block.records, block.frames
            base = records[0][0]
            i = cursor - block.first_seq
            while i < len(records) and cursor < stop and len(chunks) < READ_RECORDS:
                pos, offset, ts, payload, head_size, stream, _, _ = records[i]
                if chunks and size + payload > max_bytes:
                    return size
                at = pos - base
                head = frames[at : at + head_size]
                data = frames[at + head_size : at + head_size + payload]
                chunks.append(make(cursor, names[stream], offset, ts, payload, head, data))
                size += payload
                cursor += 1
                i += 1
        return size
