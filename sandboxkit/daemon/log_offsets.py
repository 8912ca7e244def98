"""Where chunks an output log no longer holds started: what lets a gap say exactly how
many bytes a reader lost (:meth:`~sandboxkit.daemon.output_log.OutputLog.offset_of`)."""

from __future__ import annotations

from array import array
from collections import OrderedDict

__all__ = ["EvictedOffsets", "ReadEnds"]


class EvictedOffsets:
    """A log in memory: the offsets of its evicted chunks, 8 bytes each, the newest
    ``keep`` of them (at least), trimmed in amortised O(1), so that the index costs at
    most an eighth of the retention at the default."""

    def __init__(self, keep: int) -> None:
        self._offsets = array("q")
        self._keep = keep

    @property
    def nbytes(self) -> int:
        return self._offsets.itemsize * len(self._offsets)

    def add(self, offset: int) -> None:
        """The next chunk evicted started at ``offset``."""
        self._offsets.append(offset)

    def trim(self) -> None:
        if len(self._offsets) > 2 * self._keep:
            del self._offsets[: len(self._offsets) - self._keep]

    def get(self, seq: int, first_seq: int) -> int | None:
        """Where evicted chunk ``seq`` started (``first_seq``: the oldest chunk held);
        ``None`` if it is older than the index goes back."""
        index = seq - (first_seq - len(self._offsets))
        return self._offsets[index] if index >= 0 else None

    def clear(self) -> None:
        self._offsets = array("q")


class ReadEnds:
    """A log on disk: where its last ``size`` reads ended (seq, offset: ~100 bytes each),
    so that a reader coming back there gets an exact gap even when the index that says
    where its cursor is was the damaged part."""

    def __init__(self, size: int = 128) -> None:
        self._ends: OrderedDict[int, int] = OrderedDict()
        self._size = size

    def add(self, seq: int, offset: int) -> None:
        ends = self._ends
        ends[seq] = offset
        if len(ends) > self._size:
            ends.popitem(last=False)

    def get(self, seq: int) -> int | None:
        return self._ends.get(seq)
