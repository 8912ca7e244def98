"""What an output log hands its readers: chunks of output, each with its ``data`` frame
encoded once, and gaps (what a reader lost to retention)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["CHUNK_OVERHEAD", "Chunk", "Gap"]


class Chunk(NamedTuple):
    """One piece of output: ``seq`` is monotonic per process, ``offset`` counts every byte
    the process wrote before this chunk (all streams).

    The chunk keeps its ``data`` frame encoded once as ``head`` (header and metadata)
    plus the output bytes as read, not joined: copying every 64 KiB read into a new frame
    was up to half the daemon's CPU with a large retention (fresh heap pages, faulted in).
    A consumer joins heads and payloads into the one buffer it sends anyway. A chunk read
    back from disk holds views into the buffer of that read instead of copies.

    A named tuple, not a frozen dataclass: a reader behind the cache builds one per chunk
    it reads, and a frozen dataclass's ``__init__`` (a ``object.__setattr__`` per field)
    was a tenth of that read's CPU.
    """

    seq: int
    stream: str
    offset: int
    ts: float
    size: int
    head: bytes | memoryview
    data: bytes | memoryview
    """The output bytes (a view, for a chunk read back from disk)."""

    @property
    def frame(self) -> bytes:
        """The encoded ``data`` frame (a copy: senders join ``head`` and ``data``)."""
        return b"".join((self.head, self.data))

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


@dataclass(frozen=True, slots=True)
class Gap:
    """Chunks ``cursor .. first_available - 1`` were evicted before this reader got them."""

    cursor: int
    first_available: int
    bytes_lost: int
