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

    A session ends in one of three ways. Its writer ends it (:meth:`end`) once it holds every
    ack and will send nothing more (the SDK does, as every ``send_stdin`` finishes): then
    no resend can come, and the session is dropped at once, so one-shot writes leave
    nothing behind. It is unused for ``ttl`` seconds. Or the ledger is full
    (``max_sessions``) and a new session arrives: the least recently used session idle for
    more than ``idle_grace`` seconds makes room for it. Within the grace a session is never
    evicted, however many others come and go, so a writer resending after a reconnect is
    never applied twice; when every session was used within the grace, the *new* one is
    refused with the retryable :class:`~sandboxkit.errors.StdinBusy`.
    """

    def __init__(
        self,
        pid: int,
        *,
        ttl: float = 3600.0,
        max_sessions: int = 100_000,
        idle_grace: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pid = pid
        self.ttl = ttl
        self.max_sessions = max_sessions
        self.idle_grace = idle_grace
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
            self._make_room(now)
        write(data)
        self._sessions[session] = (seq + 1, now)
        self._sessions.move_to_end(session)
        return {"session": session, "acked": seq, "next_seq": seq + 1, "duplicate": False}

    def end(self, session: str) -> dict[str, Any]:
        """Forget ``session``: its writer holds every ack and sends nothing more. Ending
        a session that is not (or no longer) known is not an error: a resent end."""
        entry = self._sessions.pop(session, None)
        next_seq = entry[0] if entry is not None else 0
        return {
            "session": session,
            "acked": next_seq - 1,
            "next_seq": next_seq,
            "duplicate": entry is None,
            "ended": True,
        }

    def _make_room(self, now: float) -> None:
        sessions = self._sessions
        oldest = next(iter(sessions), None)
        if oldest is not None and now - sessions[oldest][1] > self.idle_grace:
            del sessions[oldest]  # least recently used, idle past the grace
            return
        raise StdinBusy(
            f"{len(sessions)} stdin sessions were used within {self.idle_grace:g} s; retry later",
            pid=self.pid,
            sessions=len(sessions),
            limit=self.max_sessions,
        )

    def _expire(self) -> None:
        horizon = self._clock() - self.ttl
        sessions = self._sessions
        while sessions:
            oldest = next(iter(sessions))
            if sessions[oldest][1] >= horizon:
                return
            del sessions[oldest]
