"""Small shims over Python-version differences."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["within"]

T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[T], seconds: float | None) -> T:
        """Await ``aw``, raising TimeoutError after ``seconds`` (no extra task on 3.11+)."""
        async with asyncio.timeout(seconds):
            return await aw

else:  # pragma: no cover - Python 3.10

    async def within(aw: Awaitable[T], seconds: float | None) -> T:
        """Await ``aw``, raising TimeoutError after ``seconds``."""
        try:
            return await asyncio.wait_for(aw, seconds)
        except asyncio.TimeoutError:
            raise TimeoutError from None
