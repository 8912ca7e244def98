"""The readers waiting for an output log's next chunk, woken together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

__all__ = ["OnWake", "Waiters"]

logger = logging.getLogger(__name__)

OnWake = Callable[[], bool]
"""What a waiter may run in the waker's own turn, before its task would be woken: a reader
at the head of the log sends the new output from there (``fanout._LogFeed``), a turn of
the event loop earlier than its task would. ``True``: it did all its task would have done
with this wake, and the waiter goes on waiting, its task asleep (a line a reader sent this
way cost a turn of Python besides, in the task that found nothing left to do); ``False``:
its task is woken. It must not block; one that raises is logged and its task woken."""


class _Waiter:
    """One reader's wait: its future, its ``on_wake``, and when its timeout ends (pushed
    back each time its ``on_wake`` takes a wake: counted from the last output it took)."""

    __slots__ = ("deadline", "future", "on_wake", "timeout", "timer")

    def __init__(
        self, future: asyncio.Future[bool], on_wake: OnWake | None, timeout: float | None
    ) -> None:
        self.future = future
        self.on_wake = on_wake
        self.timeout = timeout
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def expire(self) -> None:
        # One timer per timeout, not one per wake taken: at the old deadline it sets the
        # next, if a wake pushed it back meanwhile.
        if self.future.done():
            return
        loop = self.future.get_loop()
        if loop.time() < self.deadline:
            self.timer = loop.call_at(self.deadline, self.expire)
        else:
            self.future.set_result(False)


class Waiters:
    """One future per waiting reader, woken in the order they came; a reader that gives
    up (timeout, cancellation) takes only its own future away."""

    def __init__(self) -> None:
        self._futures: dict[asyncio.Future[bool], _Waiter] = {}

    async def wait(self, timeout: float | None, on_wake: OnWake | None = None) -> bool:
        """Wait for :meth:`wake`; ``False`` after ``timeout`` seconds (``None``: none).
        ``on_wake`` runs in the waker's turn; while it returns ``True`` this waits on."""
        # Its own future, awaited directly: no shield (an extra loop iteration per wake)
        # and a timer only when the caller set a timeout.
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), on_wake, timeout)
        self._futures[waiter.future] = waiter
        if timeout is not None:
            waiter.deadline = loop.time() + timeout
            waiter.timer = loop.call_at(waiter.deadline, waiter.expire)
        try:
            return await waiter.future
        finally:
            if waiter.timer is not None:
                waiter.timer.cancel()
            self._futures.pop(waiter.future, None)

    def wake(self) -> None:
        """Wake every reader waiting now (but those whose ``on_wake`` took the wake)."""
        if self._futures:
            futures, self._futures = self._futures, {}
            for future, waiter in futures.items():
                if future.done():
                    continue
                if waiter.on_wake is not None and _took(waiter.on_wake):
                    self._futures[future] = waiter
                    if waiter.timeout is not None:
                        waiter.deadline = future.get_loop().time() + waiter.timeout
                    continue
                future.set_result(True)


def _took(on_wake: OnWake) -> bool:
    try:
        return on_wake()
    except Exception:  # a reader's fault must not reach the producer
        logger.exception("a reader's on_wake failed; its task goes on")
        return False
