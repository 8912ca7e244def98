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
        self._waiters: list[asyncio.Future[None]] = []

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
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                    waiter.get_loop().call_soon_threadsafe(_wake, waiter)
        return event

    async def wait(self, timeout: float) -> None:
        """Return when the next event is recorded, or after ``timeout`` seconds (a long
        poll: a view hears of a lifecycle change at once, not at its next poll)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def since(
        self, seq: int = 0, *, sandbox_id: str | None = None, pid: int | None = None
    ) -> list[Event]:
        """Events with ``seq >= seq``, optionally for one sandbox or process."""
        return [
            e
            for e in self._events
            if e.seq >= seq
            and (sandbox_id is None or e.sandbox_id == sandbox_id)
            and (pid is None or e.pid == pid)
        ]

    def __len__(self) -> int:
        return len(self._events)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
