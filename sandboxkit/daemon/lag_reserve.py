"""Memory the daemon lends to logs whose slowest reader sits at the oldest chunk of their
cache (:class:`LagReserve`), so that it goes on reading from memory instead of falling
behind the cache onto the segment files.

A log caches its newest ``output_cache_bytes`` for the readers that keep up. A producer
that writes faster than its consumers drain (a burst, 16 consumers on 2 cores) leaves the
slowest of them a few MiB behind the head; once they are past the cache's edge, every
byte they get is read back from a file, copied and checked (a sandbox could have written
to it), and the file's lock is shared with the writer. That read-back was the whole
difference in the daemon's CPU per GB fanned out between this daemon and the slower one
before it (perf: ``filemap_read`` copies, the CRC and the file's mutex, 12 % of its
samples), which kept its readers within the cache by taking the output slower.

A lagging reader costs the others nothing but memory, so the memory is bounded: every log
of the daemon borrows from one reserve of :data:`LAG_BYTES`. A log keeps its oldest
chunk past its cache size only while a reader's cursor is at that chunk and the reserve
has room; a reader that stops reading is left behind once the reserve is spent (then it
reads the files, as before), and the cache shrinks back as soon as no reader is there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

__all__ = ["LAG_BYTES", "LAG_RESERVE", "LagLoan", "LagReserve", "Reader"]

LAG_BYTES = 64 << 20
"""The daemon's memory lent to caches, in all its logs together. With 64 MiB, 16 unisolated
consumers of a producer at full speed cost the daemon 0.84× the CPU per GB they did with
none (20 rounds in pairs; ``docs/performance.md``); 400 consumers of one process, a
quarter of them slow, added less memory than with none (``benchmarks/memory.py``)."""


class Reader(Protocol):
    """A reader of a log, as its loan sees it (a consumer)."""

    @property
    def cursor(self) -> int: ...  # the next chunk it will read

    @property
    def closed_at(self) -> float | None: ...  # when it left, if it did


class LagReserve:
    """Bytes lent to logs' caches beyond their size, at most ``limit`` in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lent = 0


class LagLoan:
    """What one log has borrowed from a :class:`LagReserve`, and where its readers are."""

    __slots__ = ("held", "readers", "reserve", "spans")

    def __init__(
        self,
        reserve: LagReserve,
        readers: Mapping[str, Reader],
        spans: Callable[[], bool] | None = None,
    ) -> None:
        self.reserve = reserve
        self.readers = readers
        self.spans = spans
        """Whether the log's readers get spans of its files now (:mod:`.file_span`): then
        they do not read the cache, and it keeps nothing for them."""
        self.held = 0

    def slowest(self, first: int) -> int:
        """The smallest open reader's cursor at or past ``first`` (the cache's oldest
        chunk), -1 if none."""
        if self.spans is not None and self.spans():
            return -1
        readers = self.readers.values()
        return min(
            (r.cursor for r in readers if r.closed_at is None and r.cursor >= first), default=-1
        )

    def covers(self, over: int) -> bool:
        """Whether the log may hold ``over`` bytes beyond its cache size."""
        return over <= self.held + self.reserve.limit - self.reserve.lent

    def settle(self, over: int) -> None:
        """The log holds ``over`` bytes beyond its cache size now (0: it gives all back)."""
        over = max(over, 0)
        self.reserve.lent += over - self.held
        self.held = over


LAG_RESERVE = LagReserve(LAG_BYTES)
"""The daemon's reserve, shared by the logs of all its processes."""
