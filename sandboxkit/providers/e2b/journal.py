"""This E2B client's own event journal (E2B keeps none to read)."""

from __future__ import annotations

import builtins
import itertools
import time
from collections import deque
from typing import Any

__all__ = ["Journal"]


class Journal:
    """This client's own event journal, in the daemon's event format, marked
    ``"source": "client"`` (E2B keeps none to read)."""

    def __init__(self, sandbox_id: str, limit: int = 10_000) -> None:
        self.sandbox_id = sandbox_id
        self.events: deque[dict[str, Any]] = deque(maxlen=limit)
        self._seq = itertools.count()

    def record(
        self,
        kind: str,
        pid: int | None = None,
        *,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        self.events.append(
            {
                "seq": next(self._seq),
                "ts": time.time(),
                "kind": kind,
                "sandbox_id": self.sandbox_id,
                "pid": pid,
                "reason": reason,
                "data": {**(data or {}), "source": "client"},
            }
        )

    def since(self, seq: int) -> builtins.list[dict[str, Any]]:
        return [e for e in self.events if e["seq"] >= seq]
