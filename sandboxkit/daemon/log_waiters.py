"""The readers waiting for an output log's next chunk, woken together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

__all__ = ["OnWake", "Waiters"]

logger = logging.getLogger(__name__)

OnWake = Callable[[], None]
"""What a waiter may run in the waker's own turn, just before its task is woken: a reader
at the head of the log sends the new output from there (``fanout._LogFeed``), a turn of
the event loop earlier than its task would. It must not raise nor block: it runs inside
the producer's append."""


class Waiters:
    """One future per waiting reader, woken in the order they came; a reader that gives
    up (timeout, cancellation) takes only its own future away."""

    def __init__(self) -> None:
        self._futures: dict[asyncio.Future[bool], OnWake | None] = {}

    async def wait(self, timeout: float | None, on_wake: OnWake | None = None) -> bool:
        """Wait for :meth:`wake`; ``False`` after ``timeout`` seconds (``None``: none).
        ``on_wake`` runs in the waker's turn, before this returns ``True``."""
        # Its own future, awaited directly: no shield (an extra loop iteration per wake)
        # and a timer only when the caller set a timeout.
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._futures[waiter] = on_wake
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._futures.pop(waiter, None)

    def wake(self) -> None:
        """Wake every reader waiting now."""
        if self._futures:
            futures, self._futures = self._futures, {}
            for waiter, on_wake in futures.items():
                if waiter.done():
                    continue
                if on_wake is not None:
                    try:
                        on_wake()
                    except Exception:  # a reader's fault must not reach the producer
                        logger.exception("a reader's on_wake failed; its task goes on")
                waiter.set_result(True)


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
