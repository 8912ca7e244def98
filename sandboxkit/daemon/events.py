"""The event journal: every lifecycle transition, timestamped, with a reason."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Event", "EventJournal"]


@dataclass(frozen=True)
class Event:
    """One transition: ``kind`` such as ``sandbox.paused`` or ``consumer.kicked``."""

    seq: int
    ts: float
    kind: str
    sandbox_id: str | None = None
    pid: int | None = None
    reason: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


class EventJournal:
    """A bounded, append-only journal; readers ask for events after a sequence number."""

    def __init__(self, maxlen: int = 20_000) -> None:
        self._events: deque[Event] = deque(maxlen=maxlen)
        self._next = 0
        # Followers by the sandbox they follow (``None``: the whole journal). An event
        # wakes its sandbox's followers and the whole journal's, no one else: with a view
        # per sandbox, waking every follower made each event cost (followers x journal).
        self._waiters: dict[str | None, dict[asyncio.Future[None], None]] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once the daemon stops: a long poll no longer waits."""
        return self._closed

    def close(self) -> None:
        """The daemon stops: every long poll answers now (with what it has: maybe nothing),
        rather than hold the stop until its ``wait`` is up."""
        self._closed = True
        for key in list(self._waiters):
            self._wake(key)

    @property
    def waiting(self) -> int:
        """Followers waiting for the next event."""
        return sum(len(w) for w in self._waiters.values())

    @property
    def next_seq(self) -> int:
        """The sequence number the next event will get (where a new reader starts)."""
        return self._next

    def record(
        self,
        kind: str,
        *,
        sandbox_id: str | None = None,
        pid: int | None = None,
        reason: str | None = None,
        **data: Any,
    ) -> Event:
        """Append an event and return it."""
        event = Event(self._next, time.time(), kind, sandbox_id, pid, reason, data)
        self._next += 1
        self._events.append(event)
        if self._waiters:
            self._wake(None)
            if sandbox_id is not None:
                self._wake(sandbox_id)
        return event

    def _wake(self, key: str | None) -> None:
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:  # recorded from a thread
            here = None
        for waiter in waiters:
            if waiter.get_loop() is here:
                _wake(waiter)
            else:
                with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                    waiter.get_loop().call_soon_threadsafe(_wake, waiter)

    async def wait(self, timeout: float, *, sandbox_id: str | None = None) -> None:
        """Return when the next event is recorded (of ``sandbox_id``, if given), or after
        ``timeout`` seconds (a long poll: a view hears of a lifecycle change at once, not
        at its next poll)."""
        if self._closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(sandbox_id, {})[waiter] = None
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            pass
        finally:
            waiters = self._waiters.get(sandbox_id)
            if waiters is not None:
                waiters.pop(waiter, None)
                if not waiters:
                    del self._waiters[sandbox_id]

    def since(
        self, seq: int = 0, *, sandbox_id: str | None = None, pid: int | None = None
    ) -> list[Event]:
        """Events with ``seq >= seq``, optionally for one sandbox or process."""
        # Read from the newest back to ``seq``: a follower at the head pays for the events
        # it gets, not for the journal's length (sequence numbers rise along the deque).
        found = []
        for e in reversed(self._events):
            if e.seq < seq:
                break
            if (sandbox_id is None or e.sandbox_id == sandbox_id) and (pid is None or e.pid == pid):
                found.append(e)
        found.reverse()
        return found

    def __len__(self) -> int:
        return len(self._events)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
