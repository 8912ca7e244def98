"""Exactly-once stdin: a ledger of numbered batches per writer session."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sandboxkit.errors import StdinSeqMismatch

__all__ = ["StdinLedger"]


class StdinLedger:
    """Remembers, per session, the next batch number it expects.

    A batch already applied is acked again without being written (a client resending
    after a reconnect); a batch from the future is refused, so nothing is ever written
    twice or out of order.
    """

    def __init__(self, pid: int, max_sessions: int = 1024) -> None:
        self.pid = pid
        self.max_sessions = max_sessions
        self._next: OrderedDict[str, int] = OrderedDict()

    def expected(self, session: str) -> int:
        """The batch number ``session`` must send next."""
        return self._next.get(session, 0)

    def apply(
        self, session: str, seq: int, data: bytes, write: Callable[[bytes], None]
    ) -> dict[str, Any]:
        """Write batch ``seq`` of ``session`` through ``write`` unless already applied."""
        expected = self.expected(session)
        if seq < expected:
            return {"session": session, "acked": seq, "next_seq": expected, "duplicate": True}
        if seq > expected:
            raise StdinSeqMismatch(
                f"stdin batch {seq} arrived before batch {expected}",
                pid=self.pid,
                expected=expected,
                got=seq,
            )
        write(data)
        self._next[session] = seq + 1
        self._next.move_to_end(session)
        while len(self._next) > self.max_sessions:
            self._next.popitem(last=False)
        return {"session": session, "acked": seq, "next_seq": seq + 1, "duplicate": False}
