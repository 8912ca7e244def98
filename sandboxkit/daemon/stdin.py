"""Exactly-once stdin: a ledger of numbered batches per writer session."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sandboxkit.errors import StdinBusy, StdinSeqMismatch

__all__ = ["StdinLedger"]


class StdinLedger:
    """Remembers, per session, the next batch number it expects.

    A batch already applied is acked again without being written (a client resending
    after a reconnect); a batch from the future is refused, so nothing is ever written
    twice or out of order.

    Sessions are kept by *lifetime*, not by count: a session is forgotten only after
    ``ttl`` seconds without a batch, so however many other sessions (one-shot writes
    included) come and go, a live session keeps its place and a resend within the lifetime
    is never applied twice. Memory is bounded by ``max_sessions`` live sessions: past it a
    *new* session is refused with the retryable :class:`~sandboxkit.errors.StdinBusy` —
    an existing one is never evicted to make room.
    """

    def __init__(
        self,
        pid: int,
        *,
        ttl: float = 3600.0,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pid = pid
        self.ttl = ttl
        self.max_sessions = max_sessions
        self._clock = clock
        # session -> (next batch number, last use); ordered by last use, oldest first.
        self._sessions: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        """Sessions remembered now."""
        self._expire()
        return len(self._sessions)

    def expected(self, session: str) -> int:
        """The batch number ``session`` must send next."""
        self._expire()
        entry = self._sessions.get(session)
        return entry[0] if entry is not None else 0

    def apply(
        self, session: str, seq: int, data: bytes, write: Callable[[bytes], None]
    ) -> dict[str, Any]:
        """Write batch ``seq`` of ``session`` through ``write`` unless already applied."""
        expected = self.expected(session)
        now = self._clock()
        if seq < expected:
            self._sessions[session] = (expected, now)
            self._sessions.move_to_end(session)
            return {"session": session, "acked": seq, "next_seq": expected, "duplicate": True}
        if seq > expected:
            raise StdinSeqMismatch(
                f"stdin batch {seq} arrived before batch {expected}",
                pid=self.pid,
                expected=expected,
                got=seq,
            )
        if session not in self._sessions and len(self._sessions) >= self.max_sessions:
            raise StdinBusy(
                f"{len(self._sessions)} stdin sessions are live; retry later",
                pid=self.pid,
                buffered=len(self._sessions),
                limit=self.max_sessions,
            )
        write(data)
        self._sessions[session] = (seq + 1, now)
        self._sessions.move_to_end(session)
        return {"session": session, "acked": seq, "next_seq": seq + 1, "duplicate": False}

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl
        sessions = self._sessions
        while sessions:
            oldest = next(iter(sessions))
            if sessions[oldest][1] >= horizon:
                return
            del sessions[oldest]
