"""A consumer's send in flight, watched: one that makes no progress for the stall timeout
gets its consumer kicked (F2: a reader that stopped reading costs only itself)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["StallWatch"]


class StallWatch:
    """When the send in flight started, and the kick once it has waited too long.

    Not a timeout per send (a timer scheduled and cancelled on every call, 6-10 % of the
    daemon's CPU at full rate): one timer per consumer, armed by a send when none is
    pending, that on firing checks the send in flight and re-arms for its deadline."""

    def __init__(self, kick: Callable[[str, float], None]) -> None:
        """``kick(reason, blocked_for)``: ends the consumer."""
        self.since: float | None = None
        """Monotonic time the send in flight started (``None``: not sending)."""
        self.timeout: float | None = None
        """How long a send may make no progress (``None``: any; set by the owner)."""
        self._kick = kick
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> float:
        """A send starts; returns when."""
        self.since = now = time.monotonic()
        if self._timer is None:
            self._arm(now)
        return now

    def stop(self) -> None:
        """The send in flight is done (the timer stays armed for the next one)."""
        self.since = None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, since: float) -> None:
        if self.timeout is None:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(
            loop.time() + self.timeout - (time.monotonic() - since), self._fire
        )

    def _fire(self) -> None:
        self._timer = None
        since, timeout = self.since, self.timeout
        if since is None or timeout is None:
            return  # not sending: the next send arms it again
        blocked_for = time.monotonic() - since
        if blocked_for >= timeout:
            self._kick("stalled", blocked_for)
        else:
            self._arm(since)
