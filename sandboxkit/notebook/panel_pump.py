"""What one flush of a :class:`~sandboxkit.notebook.panel.ProcessPanel` sends the
browser: :class:`DeltaPump` (plain Python; tests drive it with an injected clock).

The panel flushes at most ``flush_hz`` times a second; each flush sends at most one
message — the pending output bytes as a binary buffer, and the status line only when a
person would read something new in it. A view that (re)renders gets a snapshot instead:
the state's byte tail and the whole status.

The bound is the pump's own, not only the ticker's pace: with ``min_interval`` the pump
sends nothing sooner than that after its last message, and a message the panel sends by
another route (a button's label is an ipywidgets state update: a comm message too) is
``spend``-ed from the same budget. So a panel costs the browser at most
``1 / min_interval`` comm messages a second whatever calls ``flush`` — eight panels on
one kernel stay a classroom, not a flood. Output that waits keeps its place (it is taken
at the next message) and the rate cap still bounds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sandboxkit.notebook.panel_state import PanelSnapshot, PanelState, format_rate

__all__ = ["DeltaPump"]


def _status_message(snap: PanelSnapshot) -> dict[str, Any]:
    age = None if snap.age is None else round(snap.age, 1)
    return {"text": snap.status_line, "stalled": snap.stalled, "age": age}


class DeltaPump:
    """Decides what one flush sends: pending bytes and, only when a person would read
    something new, the status — as one message (plain Python; tests drive it).

    The status goes out at once when the state, pid, exit code, attachment, error or
    STALLED badge changed, and for the counters (cursor, head, lines, rate) at most every
    ``status_period`` seconds along with output, or every second on its own. The browser
    ticks "last byte Ns ago" by itself.
    """

    def __init__(
        self,
        state: PanelState,
        *,
        status_period: float = 0.5,
        min_interval: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.state = state
        self.status_period = status_period
        self.min_interval = min_interval
        """No message sooner than this after the last one (seconds; 0: no bound)."""
        self.clock = clock or state.clock
        self._key: tuple[Any, ...] | None = None
        self._counters: tuple[Any, ...] | None = None
        self._status_at = float("-inf")
        self._sent_at = float("-inf")

    def ready(self, now: float | None = None) -> bool:
        """Whether a message may go out now (``min_interval`` since the last one)."""
        now = self.clock() if now is None else now
        return now - self._sent_at >= self.min_interval

    def spend(self, now: float | None = None) -> None:
        """Count a message the panel sent by another route against the budget."""
        self._sent_at = self.clock() if now is None else now

    def _status(self, snap: PanelSnapshot, now: float, with_data: bool) -> dict[str, Any] | None:
        key = (
            snap.pid,
            snap.shown_state,
            snap.exit_code,
            snap.exit_reason,
            snap.attached,
            snap.error,
            snap.stalled,
            snap.age is None,
        )
        counters = (snap.cursor, snap.head, snap.line_count, format_rate(snap.rate))
        urgent = key != self._key
        # Counters ride along with output at most every status_period; alone (no output
        # to carry them), at most every second: a message of its own costs an envelope.
        period = self.status_period if with_data else max(1.0, self.status_period)
        due = counters != self._counters and now - self._status_at >= period
        if not (urgent or due):
            return None
        self._key, self._counters, self._status_at = key, counters, now
        return _status_message(snap)

    def next(self, *, force: bool = False) -> tuple[dict[str, Any], list[bytes]] | None:
        """The message to send now (``None``: nothing a person would see changed, or the
        last message went out less than ``min_interval`` ago). ``force``: whatever the
        budget says (a view that renders must first get the deltas before its
        snapshot)."""
        now = self.clock()
        if not force and not self.ready(now):
            return None
        data = self.state.take_output()
        status = self._status(self.state.snapshot(now), now, bool(data))
        if not data and status is None:
            return None
        self._sent_at = now
        message: dict[str, Any] = {"type": "delta"}
        if status is not None:
            message["status"] = status
        return message, [data] if data else []

    def snapshot(self, view: str) -> tuple[dict[str, Any], list[bytes]]:
        """What a (re)rendered view starts from: the byte tail and the whole status."""
        snap = self.state.snapshot()
        return {"type": "snapshot", "view": view, "status": _status_message(snap)}, [
            self.state.tail()
        ]
