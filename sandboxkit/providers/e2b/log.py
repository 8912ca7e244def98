"""The client-side log of one E2B process: what this client's tap received, bounded in
bytes, which readers follow from a cursor as the daemon's consumers follow its output log."""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sandboxkit.vocab import ProcessState

if TYPE_CHECKING:
    from sandboxkit.providers.e2b.reader import Reader
    from sandboxkit.providers.e2b.tap import Tap

__all__ = ["Entry", "ProcessLog"]


@dataclass
class Entry:
    offset: int
    stream: str  # "stdout" | "stderr" | "gap"
    data: bytes = b""
    reason: str = ""


class ProcessLog:
    """What this client's tap received from one process, bounded in bytes: readers follow
    it from a cursor (a byte offset), as the daemon's consumers follow its output log."""

    def __init__(self, pid: int, spec: dict[str, Any], keep_bytes: int) -> None:
        self.pid = pid
        self.spec = spec
        self.keep_bytes = keep_bytes
        # Entries by sequence number: entry ``seq`` is ``entries[seq - base]``; the first
        # ``skip`` of the list are evicted (dropped in bulk now and then, so that evicting
        # and finding an entry both stay O(1)).
        self.entries: list[Entry] = []
        self.base = 0
        self.skip = 0
        self.size = 0
        self.head = 0
        """Output bytes received in total (the offset the next byte gets)."""
        self.first = 0
        """Offset of the oldest byte still kept."""
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.error: str | None = None
        self.ended = False
        self.readers: set[Reader] = set()
        self.tap: Tap | None = None
        self.restarted_from: int | None = None
        self.restarted_to: int | None = None
        self.passed: dict[int, int] = {}
        """Cursor → the entry after the gaps a reader detached there had delivered: a
        gap marks a position, not bytes, so a cursor alone cannot say whether the gaps at
        it were read; a reattach at that cursor starts after them (no marker twice)."""
        self.pty = bool(spec.get("pty"))
        """Started through E2B's pty API: its output is raw bytes, read through
        ``pty.connect``, and its stdin is the terminal's."""
        self._changed = asyncio.Event()

    def waiter(self) -> asyncio.Event:
        """An event set at the next change (take it before reading the state)."""
        return self._changed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def first_seq(self) -> int:
        """Sequence number of the oldest entry kept."""
        return self.base + self.skip

    @property
    def next_seq(self) -> int:
        """Sequence number the next entry gets."""
        return self.base + len(self.entries)

    def entry(self, seq: int) -> Entry:
        return self.entries[seq - self.base]

    def seek(self, cursor: int) -> int:
        """The first entry a reader at byte ``cursor`` has not read: data ending after
        it, or a gap at or after it."""

        def key(e: Entry) -> int:
            return e.offset if e.stream == "gap" else e.offset + len(e.data) - 1

        return self.base + bisect.bisect_left(self.entries, cursor, lo=self.skip, key=key)

    def append(self, stream: str, data: bytes) -> None:
        if not data:
            return
        self.entries.append(Entry(self.head, stream, data))
        self.head += len(data)
        self.size += len(data)
        # The newest entry stays whole, however large: a reader following live gets
        # every chunk the tap received (only what it fell behind on is evicted).
        while self.size > self.keep_bytes and len(self.entries) - self.skip > 1:
            self.size -= len(self.entries[self.skip].data)
            self.skip += 1
            self.first = self.entries[self.skip].offset
        if self.skip > 1024 and self.skip * 2 > len(self.entries):
            del self.entries[: self.skip]
            self.base += self.skip
            self.skip = 0
        self._notify()

    def unknown_gap(self, reason: str) -> None:
        self.entries.append(Entry(self.head, "gap", reason=reason))
        self._notify()

    def end(self, exit_code: int | None, error: str | None = None) -> None:
        if self.ended:
            return
        self.ended, self.exit_code, self.error = True, exit_code, error
        self.ended_at = time.time()
        self._notify()

    def state(self) -> ProcessState:
        return "exited" if self.ended else "running"
