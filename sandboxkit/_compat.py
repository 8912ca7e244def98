"""Small shims over Python-version differences."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["uncancel", "within"]

T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[T], seconds: float | None) -> T:
        """Await ``aw``, raising TimeoutError after ``seconds`` (no extra task on 3.11+)."""
        async with asyncio.timeout(seconds):
            return await aw

else:  # pragma: no cover - Python 3.10

    async def within(aw: Awaitable[T], seconds: float | None) -> T:
        """Await ``aw``, raising TimeoutError after ``seconds``.

        Not ``asyncio.wait_for``: on 3.10 it swallows a cancellation that arrives in the
        same loop iteration as ``aw``'s result, so the cancelled task runs on. Like
        ``asyncio.timeout``, this awaits ``aw`` in the current task and cancels that.
        """
        if seconds is None:
            return await aw
        task = asyncio.current_task()
        assert task is not None
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        handle = asyncio.get_running_loop().call_later(max(seconds, 0.0), expire)
        try:
            return await aw
        except asyncio.CancelledError:
            if expired:
                raise TimeoutError from None
            raise
        finally:
            handle.cancel()


def uncancel() -> None:
    """Take back one cancellation request of the current task, where Python counts them
    (3.11+): a task cancelled on purpose (a consumer's kick) goes on to close cleanly."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()
