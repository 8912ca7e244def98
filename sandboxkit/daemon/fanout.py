"""Fan-out policies: how a process's output reaches its consumers.

``cursor`` is sandboxkit's contract: every consumer pulls from the shared log through its
own cursor, in its own task, so nobody waits for anybody (F1) and a consumer that makes no
progress is kicked on its own, without delaying the rest (F2).

``blocking`` and ``kick`` exist for the fault lab. They reproduce, on the same workload,
how a real sandbox daemon shipped it: one shared loop hands each chunk to each consumer's
bounded queue in turn —

* ``blocking``: with a blocking put — one consumer that stops reading wedges everyone (F1);
* ``kick``: with a grace wait *inside the shared loop* when a queue is full, then a kick —
  each ghost still stalls everyone for the grace, and N ghosts add up (F2).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from sandboxkit._compat import within
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.output_log import Chunk, Gap, OutputLog
from sandboxkit.errors import InvalidArgument

if TYPE_CHECKING:
    from sandboxkit.daemon.consumers import Consumer

__all__ = [
    "FANOUT_POLICIES",
    "BlockingFanout",
    "CursorFanout",
    "Fanout",
    "Feed",
    "KickFanout",
    "Pull",
    "make_fanout",
]


@dataclass
class Pull:
    """What a consumer got from its feed: a gap, chunks, the end — or nothing (idle)."""

    gap: Gap | None = None
    chunks: list[Chunk] = field(default_factory=list)
    ended: bool = False


class Feed(abc.ABC):
    """One consumer's source of chunks under some fan-out policy."""

    stall_timeout: float | None = None
    """Per-consumer stall kick (``None``: this policy never kicks from the consumer)."""

    @abc.abstractmethod
    async def pull(self, cursor: int, max_bytes: int, timeout: float) -> Pull:
        """Next chunks from ``cursor``; an empty :class:`Pull` after ``timeout`` idle."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """The consumer is gone."""


class Fanout(abc.ABC):
    """A fan-out policy for one process's log."""

    name: ClassVar[str]

    def __init__(self, log: OutputLog) -> None:
        self.log = log

    @abc.abstractmethod
    def attach(self, consumer: Consumer) -> Feed:
        """Give ``consumer`` its feed (may move its cursor: queue policies do not replay)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to stop by default
        """Stop whatever background work the policy runs."""


class _LogFeed(Feed):
    def __init__(self, log: OutputLog, stall_timeout: float) -> None:
        self.log = log
        self.stall_timeout = stall_timeout

    async def pull(self, cursor: int, max_bytes: int, timeout: float) -> Pull:
        log = self.log
        gap, chunks = log.read(cursor, max_bytes)
        if gap is None and not chunks:
            if log.ended:
                return Pull(ended=True)
            await log.wait(cursor, timeout)
            gap, chunks = log.read(cursor, max_bytes)
        return Pull(gap, chunks, ended=gap is None and not chunks and log.ended)


class CursorFanout(Fanout):
    """Each consumer reads the log through its own cursor (the default, immune to F1/F2)."""

    name = "cursor"

    def __init__(self, log: OutputLog, stall_timeout: float) -> None:
        super().__init__(log)
        self.stall_timeout = stall_timeout

    def attach(self, consumer: Consumer) -> Feed:
        return _LogFeed(self.log, self.stall_timeout)


_END = object()


class _QueueFeed(Feed):
    def __init__(self, owner: _SharedLoopFanout, consumer: Consumer, size: int) -> None:
        self.owner = owner
        self.consumer = consumer
        self.queue: asyncio.Queue[object] = asyncio.Queue(size)

    async def pull(self, cursor: int, max_bytes: int, timeout: float) -> Pull:
        try:
            first = await within(self.queue.get(), timeout)
        except TimeoutError:
            return Pull()
        items = [first]
        size = first.frame_size if isinstance(first, Chunk) else 0
        while size < max_bytes and not self.queue.empty() and items[-1] is not _END:
            item = self.queue.get_nowait()
            items.append(item)
            size += item.frame_size if isinstance(item, Chunk) else 0
        chunks = [i for i in items if isinstance(i, Chunk)]
        return Pull(chunks=chunks, ended=items[-1] is _END)

    def close(self) -> None:
        self.owner.detach(self)


class _SharedLoopFanout(Fanout):
    """One pump per process delivers every chunk to every consumer's queue in turn."""

    def __init__(self, log: OutputLog, queue_size: int) -> None:
        super().__init__(log)
        self.queue_size = queue_size
        self._feeds: list[_QueueFeed] = []
        self._cursor = log.head
        self._pump: asyncio.Task[None] | None = None

    def attach(self, consumer: Consumer) -> Feed:
        feed = _QueueFeed(self, consumer, self.queue_size)
        if self._pump is None:
            self._cursor = self.log.head
            self._pump = asyncio.get_running_loop().create_task(self._run())
        # Like the shipped daemons: a new subscriber sees new output only (no replay).
        consumer.cursor = self._cursor
        self._feeds.append(feed)
        return feed

    def detach(self, feed: _QueueFeed) -> None:
        with contextlib.suppress(ValueError):
            self._feeds.remove(feed)

    async def _run(self) -> None:
        log = self.log
        while True:
            gap, chunks = log.read(self._cursor, 1 << 20)
            if gap is not None:
                self._cursor = gap.first_available
            for chunk in chunks:
                for feed in list(self._feeds):
                    if feed in self._feeds:
                        await self._deliver(feed, chunk)
                self._cursor = chunk.seq + 1
            if chunks or gap is not None:
                continue
            if log.ended:
                for feed in list(self._feeds):
                    await self._deliver(feed, _END)
                return
            await log.wait(self._cursor, None)

    @abc.abstractmethod
    async def _deliver(self, feed: _QueueFeed, item: object) -> None: ...

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)


class BlockingFanout(_SharedLoopFanout):
    """F1 as shipped: a blocking put per consumer, in turn, in one shared loop."""

    name = "blocking"

    async def _deliver(self, feed: _QueueFeed, item: object) -> None:
        await feed.queue.put(item)


class KickFanout(_SharedLoopFanout):
    """F2 as first fixed: a full queue gets a grace wait inside the shared loop, then the
    consumer is kicked (and what it had not read is lost to it)."""

    name = "kick"

    def __init__(self, log: OutputLog, queue_size: int, grace: float) -> None:
        super().__init__(log, queue_size)
        self.grace = grace

    async def _deliver(self, feed: _QueueFeed, item: object) -> None:
        try:
            feed.queue.put_nowait(item)
            return
        except asyncio.QueueFull:
            pass
        try:
            await within(feed.queue.put(item), self.grace)
        except TimeoutError:
            self.detach(feed)
            feed.consumer.kick(reason="queue_full", blocked_for=self.grace)


FANOUT_POLICIES = ("cursor", "blocking", "kick")


def make_fanout(name: str, log: OutputLog, config: DaemonConfig, *, grace: float) -> Fanout:
    """The policy called ``name`` for one process's log."""
    if name == "cursor":
        return CursorFanout(log, config.stall_timeout)
    if name == "blocking":
        return BlockingFanout(log, config.blocking_queue)
    if name == "kick":
        return KickFanout(log, config.kick_queue, grace)
    raise InvalidArgument(f"fanout must be one of {', '.join(FANOUT_POLICIES)}", field="fanout")
