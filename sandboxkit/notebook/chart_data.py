"""What the charts show, as plain Python that tests drive without a browser: each
consumer's lag and state samples (:class:`BackpressureData`) and a sandbox's events with
their pause and stall spans (:class:`TimelineData`). :mod:`sandboxkit.notebook.charts`
polls the daemon, feeds these and sends the browser what they return.

A chart shows a consumer **starved** when its lag keeps growing while its ``bytes_sent``
does not move for :data:`~sandboxkit.vocab.STARVED_AFTER` seconds, the daemon's own
measure, even where the daemon (or a provider) calls it streaming: so the ``blocking``
policy's victims never read as streaming.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sandboxkit.vocab import FINAL_CONSUMER_STATES, ROLE_TEXT, STARVED_AFTER

__all__ = ["LAG_COLORS", "MARKERS", "ROWS", "BackpressureData", "ConsumerTrack", "TimelineData"]

LAG_COLORS = ("#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#393b79", "#637939")
"""Lag line colours: none of them is a state colour, so a line never reads as a state."""


def _label(row: dict[str, Any], panel_consumer: str | None) -> str:
    """Who reads, by role (as the daemon knows it, else as far as we can tell), and the
    consumer's short name to tell two of a kind apart."""
    cid = str(row["consumer_id"])
    role = row.get("role")
    name = row.get("name")
    short = str(name) if isinstance(name, str) and name else cid[:6]
    if row.get("ghost") is True or role == "ghost":
        text = "ghost"
    elif isinstance(role, str) and role:
        text = ROLE_TEXT.get(role, role)
    elif cid == panel_consumer:
        text = "panel"
    else:
        text = "consumer"
    return f"{text} · {short}"


@dataclass
class ConsumerTrack:
    """One consumer's samples (bounded by the chart's window) and what we infer."""

    consumer_id: str
    label: str
    color: str
    points: deque[tuple[float, int, str]] = field(default_factory=deque)
    """``(t, lag_bytes, state)``; ``t`` in seconds since the chart started."""
    last_sent: int | None = None
    last_lag: int | None = None
    lag_rising_since: float | None = None
    closed: bool = False

    @property
    def state(self) -> str:
        return self.points[-1][2] if self.points else "streaming"


class BackpressureData:
    """Per-consumer lag and state of one process, as plain Python (see the module doc).

    ``ingest(rows, now)`` takes one poll's consumer rows of the process and returns the
    sample to send (``None`` when nothing a person would see changed). A consumer whose
    lag keeps growing while its ``bytes_sent`` does not move for ``starved_after``
    seconds is shown **starved** (so the ``blocking`` policy's victims never read as
    streaming), whatever the daemon calls it if it does not know the state itself. A
    closed consumer gets one last sample and then no more.
    """

    def __init__(self, pid: int, *, window: float = 120.0, starved_after: float = STARVED_AFTER):
        self.pid = pid
        self.window = window
        self.starved_after = starved_after
        self.tracks: dict[str, ConsumerTrack] = {}
        self.restarts: deque[tuple[float, int, int]] = deque(maxlen=50)
        """``(t, old pid, new pid)`` of the restarts seen."""
        self._signature: tuple[Any, ...] | None = None
        self._colors = 0

    def follow(self, pid: int, now: float) -> dict[str, Any] | None:
        """Chart process ``pid`` from now on; the restart message (``None``: same pid)."""
        if pid == self.pid:
            return None
        self.restarts.append((now, self.pid, pid))
        old, self.pid = self.pid, pid
        for track in self.tracks.values():
            track.closed = True
        self._signature = None
        return {"type": "restart", "t": now, "old": old, "pid": pid}

    def _state(self, track: ConsumerTrack, row: dict[str, Any], now: float) -> str:
        state = str(row.get("state") or "streaming")
        closed = state in FINAL_CONSUMER_STATES or row.get("closed_at") not in (None, "")
        if closed and isinstance(row.get("closed_at"), float):
            state = "kicked" if state == "kicked" else "closed"
        lag, sent = int(row.get("lag_bytes") or 0), int(row.get("bytes_sent") or 0)
        if track.last_lag is not None and lag > track.last_lag and sent == track.last_sent:
            if track.lag_rising_since is None:
                track.lag_rising_since = now
        elif lag <= (track.last_lag or 0) or sent != track.last_sent:
            track.lag_rising_since = None
        track.last_lag, track.last_sent = lag, sent
        if (
            state == "streaming"
            and track.lag_rising_since is not None
            and now - track.lag_rising_since >= self.starved_after
        ):
            return "starved"
        return state

    def ingest(
        self, rows: list[dict[str, Any]], now: float, panel_consumer: str | None = None
    ) -> dict[str, Any] | None:
        """Take one poll of the process's consumers; the sample to send, if any."""
        rows = [r for r in rows if r.get("pid") == self.pid]
        sample: dict[str, Any] = {"type": "sample", "t": now, "lags": {}, "states": {}}
        new_labels: dict[str, dict[str, str]] = {}
        for row in rows:
            cid = str(row["consumer_id"])
            track = self.tracks.get(cid)
            if track is None:
                color = LAG_COLORS[self._colors % len(LAG_COLORS)]
                self._colors += 1
                track = self.tracks[cid] = ConsumerTrack(cid, _label(row, panel_consumer), color)
                new_labels[cid] = {"label": track.label, "color": track.color}
            label = _label(row, panel_consumer)
            if label != track.label:  # e.g. the panel's stream became a ghost at a pause
                track.label = label
                new_labels[cid] = {"label": track.label, "color": track.color}
            if track.closed:
                continue  # a closed consumer stops: nothing after its last sample
            state = self._state(track, row, now)
            lag = int(row.get("lag_bytes") or 0)
            track.points.append((now, lag, state))
            if state in FINAL_CONSUMER_STATES:
                track.closed = True
            sample["lags"][cid] = lag
            sample["states"][cid] = state
        for track in self.tracks.values():
            while len(track.points) > 1 and now - track.points[1][0] > self.window:
                track.points.popleft()
        for cid, track in list(self.tracks.items()):
            if track.closed and track.points and now - track.points[-1][0] > self.window:
                del self.tracks[cid]
        signature = tuple(
            sorted((c, sample["lags"][c], sample["states"][c]) for c in sample["lags"])
        )
        if signature == self._signature and not new_labels:
            return None
        self._signature = signature
        if new_labels:
            sample["labels"] = new_labels
        return sample

    def snapshot(self) -> dict[str, Any]:
        """Everything kept (bounded by the window), for a view that (re)renders."""
        return {
            "type": "snapshot",
            "pid": self.pid,
            "window": self.window,
            "labels": {c: {"label": t.label, "color": t.color} for c, t in self.tracks.items()},
            "points": {c: [list(p) for p in t.points] for c, t in self.tracks.items()},
            "restarts": [list(r) for r in self.restarts],
        }


MARKERS: dict[str, tuple[str, str, str, str]] = {
    "process.started": ("processes", "o", "#2ca02c", "start"),
    "process.exited": ("processes", "s", "#555555", "exit"),
    "process.restarted": ("processes", "P", "#1f77b4", "restart"),
    "consumer.attached": ("consumers", "^", "#17becf", "attach"),
    "consumer.detached": ("consumers", "v", "#9e9e9e", "detach"),
    "consumer.kicked": ("consumers", "X", "#d62728", "kick"),
    "consumer.gap": ("consumers", "D", "#ff7f0e", "gap"),
    "consumer.ghosted": ("consumers", "h", "#9467bd", "ghost"),
}
ROWS = ("stalls", "consumers", "processes", "sandbox")


class TimelineData:
    """The sandbox's events (the newest ``max_events``), their pause and stall spans."""

    def __init__(self, max_events: int = 1000) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.next_seq = 0
        self.t0: float | None = None

    def ingest(self, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Take polled events; the new ones."""
        new = [e for e in data if int(e["seq"]) >= self.next_seq]
        if not new:
            return []
        if self.t0 is None:
            self.t0 = float(new[0]["ts"])
        self.events.extend(new)
        self.next_seq = max(int(e["seq"]) for e in new) + 1
        return new

    @property
    def pause_spans(self) -> list[tuple[float, float | None, str | None]]:
        """``(paused at, resumed at or None, reason)``, wall-clock seconds."""
        spans: list[tuple[float, float | None, str | None]] = []
        start: tuple[float, str | None] | None = None
        for e in self.events:
            if e["kind"] == "sandbox.paused" and start is None:
                start = (float(e["ts"]), e.get("reason"))
            elif e["kind"] in ("sandbox.resumed", "sandbox.killed") and start is not None:
                spans.append((start[0], float(e["ts"]), start[1]))
                start = None
        if start is not None:
            spans.append((start[0], None, start[1]))
        return spans

    @property
    def stall_spans(self) -> list[tuple[float, float, int | None]]:
        """``(stall start, kick time, pid)`` of every kicked consumer (its blocked time)."""
        spans = []
        for e in self.events:
            if e["kind"] == "consumer.kicked":
                end = float(e["ts"])
                blocked = float((e.get("data") or {}).get("blocked_for") or 0.0)
                spans.append((end - blocked, end, e.get("pid")))
        return spans

    @property
    def markers(self) -> list[tuple[float, str, int | None]]:
        """``(time, kind, pid)`` of the events drawn as markers."""
        return [
            (float(e["ts"]), e["kind"], e.get("pid")) for e in self.events if e["kind"] in MARKERS
        ]

    def message(self, kind: str = "events") -> dict[str, Any]:
        """The state to send: markers and spans in seconds since the first event."""
        t0 = self.t0 or 0.0
        return {
            "type": kind,
            "t0": t0,
            "markers": [
                [ts - t0, ROWS.index(MARKERS[k][0]), MARKERS[k][3], MARKERS[k][2]]
                for ts, k, _ in self.markers
            ],
            "pauses": [[a - t0, None if b is None else b - t0] for a, b, _ in self.pause_spans],
            "stalls": [[a - t0, b - t0] for a, b, _ in self.stall_spans],
        }
