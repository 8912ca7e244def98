"""When a log on disk puts its new chunks into its segment store: not on the way from a
process's write to its readers' sockets.

A chunk's store work (its CRC, its index record, its buffering) used to run in the append
that made it, before the readers it woke could send it; then in the next turn of the
event loop, after their sends, but still once per chunk, in the turn that followed each
line, when the daemon, the reader's client and the process share two cores (P3,
docs/performance.md). Now a trickle of output (a line now and then) is written in one
batch a little later, :data:`DELAY` after the first chunk of the batch, on a timer of its
own; bulk output, a batch as large as :data:`BATCH_BYTES` or :data:`BATCH_CHUNKS`, in the
next turn as before. The log's cache holds the chunks meanwhile (a chunk leaves it only
once written, and a cache over its size writes at once), so nothing waits on the batch
but the files (readers read the cache) and retention (a log over it is written in the
next turn: only written output is evicted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["BATCH_BYTES", "BATCH_CHUNKS", "DELAY", "WriteBehind"]

DELAY = 0.02
"""Seconds a trickle's first unwritten chunk waits for the others of its batch."""
BATCH_BYTES = 64 * 1024
BATCH_CHUNKS = 32
"""Unwritten output this large is written in the next turn of the event loop (bulk)."""


class WriteBehind:
    """Runs ``write`` (the log's: its unwritten chunks into the store) once output is due
    to be written: see the module's docstring."""

    def __init__(self, write: Callable[[], None]) -> None:
        self._write = write
        self._handle: asyncio.Handle | None = None  # the write to come
        self._soon = False  # it comes in the next turn (not on the timer)

    def due(self, chunks: int, nbytes: int, over: bool) -> None:
        """Call after an append (and after the readers it woke were queued): ``chunks``
        chunks of ``nbytes`` wait to be written; ``over``: the log holds more than its
        retention, and only written output can be evicted (in the next turn, then).
        Outside an event loop (tools, tests), written at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write()
            return
        bulk = over or chunks >= BATCH_CHUNKS or nbytes >= BATCH_BYTES
        if self._handle is not None:
            if self._soon or not bulk:
                return
            self._handle.cancel()
        self._soon = bulk
        if bulk:
            self._handle = loop.call_soon(self._run)
        else:
            self._handle = loop.call_later(DELAY, self._run)

    def cancel(self) -> None:
        """The log is finished or closed: no write to come."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _run(self) -> None:
        self._handle = None
        self._write()
