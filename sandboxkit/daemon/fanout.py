"""Fan-out: how a process's output reaches its consumers.

sandboxkit's contract is :class:`CursorFanout`: every consumer pulls from the shared log
through its own cursor, in its own task, so nobody waits for anybody (F1) and a consumer
that makes no progress is kicked on its own, without delaying the rest (F2).

A policy hands each consumer a :class:`Feed` at attach, with what the consumer needs from
it (where it starts, how long a send may stall); it never reaches into the consumer. The
fault lab's policies (the shipped designs behind F1/F2) implement the same interface,
fenced off in :mod:`sandboxkit.daemon.faults`.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from sandboxkit.daemon.file_span import FileSpan
from sandboxkit.daemon.output_log import Chunk, Gap, OutputLog

__all__ = ["CursorFanout", "Eager", "Fanout", "Feed", "Kick", "Offered", "Pull"]

Kick = Callable[[str, float], None]
"""How a policy kicks a consumer from outside its task: ``kick(reason, blocked_for)``."""


class Offered(enum.Enum):
    """What a consumer's :data:`Eager` did with output offered to it."""

    LEFT = "left"
    """Not sent: its task reads it, a turn of the event loop later."""
    SENT = "sent"
    """Sent; its task still has work (bytes the transport holds, to wait for)."""
    DONE = "done"
    """Sent, and nothing for its task to do: the pull goes on waiting, the task asleep."""


Eager = Callable[[], Offered]
"""What a consumer may hand its pull: run in the producer's own turn when output arrives
while the pull waits, it sends that output at once if it can (its cursor then past it)
and says so. The output leaves a turn of the event loop earlier than through the
consumer's task (P3, docs/performance.md); it must not raise nor wait."""


@dataclass
class Pull:
    """What a consumer got from its feed: a gap, chunks, the end — or nothing (idle)."""

    gap: Gap | None = None
    chunks: list[Chunk] = field(default_factory=list)
    ended: bool = False
    span: FileSpan | None = None
    """Frames of a segment file to send as they are (after ``gap``; the consumer closes
    it): what a reader behind the cache of a zero-copy log gets instead of chunks."""
    served: bool = False
    """Output that came while this pull waited was sent by the consumer's :data:`Eager`:
    the consumer's cursor moved (read from it again)."""


class Feed(abc.ABC):
    """One consumer's source of chunks under some fan-out policy."""

    start: int
    """The cursor the consumer starts from (a policy may not honour the one it asked for)."""

    stall_timeout: float | None = None
    """Per-consumer stall kick (``None``: this policy never kicks from the consumer)."""

    @abc.abstractmethod
    async def pull(
        self, cursor: int, max_bytes: int, timeout: float, eager: Eager | None = None
    ) -> Pull:
        """Next chunks from ``cursor``; an empty :class:`Pull` after ``timeout`` idle.
        ``eager``: offered new output as it arrives, where the policy can (see
        :data:`Eager`); the pull then returns ``Pull(served=True)``."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """The consumer is gone."""


class Fanout(abc.ABC):
    """A fan-out policy for one process's log."""

    name: ClassVar[str]

    def __init__(self, log: OutputLog) -> None:
        self.log = log

    @abc.abstractmethod
    def attach(self, cursor: int, kick: Kick) -> Feed:
        """A feed for a consumer that asks to start at ``cursor``; ``kick`` ends it."""

    def nudge(self) -> None:
        """Wake every idle feed (its pull returns empty): its consumer sends a state
        change now instead of at its next keepalive."""
        self.log.nudge()

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to stop by default
        """Stop whatever background work the policy runs."""


class _LogFeed(Feed):
    def __init__(self, log: OutputLog, start: int, stall_timeout: float) -> None:
        self.log = log
        self.start = start
        self.stall_timeout = stall_timeout

    async def pull(
        self, cursor: int, max_bytes: int, timeout: float, eager: Eager | None = None
    ) -> Pull:
        log = self.log
        pulled = self._read(cursor, max_bytes)
        if pulled.gap is None and not pulled.chunks and pulled.span is None:
            if log.ended:
                return Pull(ended=True)
            served = False

            def offer() -> bool:
                nonlocal served
                assert eager is not None
                offered = eager()
                served = served or offered is not Offered.LEFT
                return offered is Offered.DONE and not log.ended

            woke = await log.wait(cursor, timeout, None if eager is None else offer)
            if served:
                # Its cursor moved: nothing to read from the old one. A timeout (no output
                # since the last line sent) leaves an idle pull: a keepalive is due.
                return Pull(served=woke)
            pulled = self._read(cursor, max_bytes)
            pulled.ended = pulled.gap is None and not pulled.chunks and log.ended
        return pulled

    def _read(self, cursor: int, max_bytes: int) -> Pull:
        log = self.log
        # Frames in the files go as they are where the log allows (zero-copy), the rest
        # (the newest, not yet written; a log in memory) as chunks.
        spanned = log.read_span(cursor, max_bytes) if log.zero_copy else None
        if spanned is not None:
            return Pull(spanned[0], span=spanned[1])
        gap, chunks = log.read(cursor, max_bytes)
        return Pull(gap, chunks)


class CursorFanout(Fanout):
    """Each consumer reads the log through its own cursor (immune to F1/F2)."""

    name = "cursor"

    def __init__(self, log: OutputLog, stall_timeout: float) -> None:
        super().__init__(log)
        self.stall_timeout = stall_timeout

    def attach(self, cursor: int, kick: Kick) -> Feed:
        # The consumer kicks itself (its own stall watchdog): ``kick`` is not needed here.
        return _LogFeed(self.log, cursor, self.stall_timeout)
