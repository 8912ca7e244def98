"""The readers waiting for an output log's next chunk, woken together."""

from __future__ import annotations

import asyncio

__all__ = ["Waiters"]


class Waiters:
    """One future per waiting reader, woken in the order they came; a reader that gives
    up (timeout, cancellation) takes only its own future away."""

    def __init__(self) -> None:
        self._futures: dict[asyncio.Future[bool], None] = {}

    async def wait(self, timeout: float | None) -> bool:
        """Wait for :meth:`wake`; ``False`` after ``timeout`` seconds (``None``: none)."""
        # Its own future, awaited directly: no shield (an extra loop iteration per wake)
        # and a timer only when the caller set a timeout.
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._futures[waiter] = None
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
            for waiter in futures:
                if not waiter.done():
                    waiter.set_result(True)


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
