"""The lab's fan-out policies: the shipped designs behind F1 and F2, on purpose.

They reproduce, on the same workload as sandboxkit's own ``cursor`` fan-out
(:mod:`sandboxkit.daemon.fanout`), how a real sandbox daemon shipped it: one shared loop
hands each chunk to each consumer's bounded queue in turn —

* ``blocking``: with a blocking put — one consumer that stops reading wedges everyone (F1);
* ``kick``: with a grace wait *inside the shared loop* when a queue is full, then a kick —
  each ghost still stalls everyone for the grace, and N ghosts add up (F2).

Like those designs, a new subscriber sees new output only: the cursor it asks for is not
honoured (its feed's ``start`` says where it really starts).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib

from sandboxkit._compat import within
from sandboxkit.daemon.fanout import Eager, Fanout, Feed, Kick, Pull
from sandboxkit.daemon.output_log import Chunk, OutputLog

__all__ = ["BlockingFanout", "KickFanout"]

_END = object()
_NUDGE = object()  # wakes an idle feed: its pull returns empty (a state change to send)


class _QueueFeed(Feed):
    def __init__(self, owner: _SharedLoopFanout, start: int, kick: Kick, size: int) -> None:
        self.owner = owner
        self.start = start
        self.kick = kick
        self.queue: asyncio.Queue[object] = asyncio.Queue(size)

    async def pull(
        self, cursor: int, max_bytes: int, timeout: float, eager: Eager | None = None
    ) -> Pull:
        # (The shared loop's queue hands chunks over one at a time: nothing is eager.)
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

    def attach(self, cursor: int, kick: Kick) -> Feed:
        if self._pump is None:
            self._cursor = self.log.head
            self._pump = asyncio.get_running_loop().create_task(self._run())
        # Like the shipped daemons: a new subscriber sees new output only (no replay).
        feed = _QueueFeed(self, self._cursor, kick, self.queue_size)
        self._feeds.append(feed)
        return feed

    def nudge(self) -> None:
        for feed in list(self._feeds):
            with contextlib.suppress(asyncio.QueueFull):  # full: its consumer is busy anyway
                feed.queue.put_nowait(_NUDGE)

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
            feed.kick("queue_full", self.grace)
