"""Charts of what the daemon measures, drawn in the browser: consumer backpressure and the
sandbox lifecycle.

``BackpressureChart(sbx, pid_or_panel, *, interval=0.5, window=120)`` polls
``consumers()`` and shows each consumer's lag (bytes) and state over the last ``window``
seconds, labelled by role (the panel, the notebook's own handle, a ghost from a pause
snapshot...). Given a :class:`~sandboxkit.notebook.ProcessPanel` instead of a pid it
follows the panel's process: after a Kill-restart it charts the new pid and marks the
restart. ``LifecycleTimeline(sbx, *, interval=0.5, max_events=1000)`` polls ``events()``
and shows pause spans, consumer attach/detach/kick/gap/ghost events, process
start/exit/restart and stall intervals.

The kernel only polls and sends *new samples* (anywidget custom messages, at most once per
``interval``, only when something changed; ``charts.js`` draws them with uPlot on a canvas
sized to the device pixel ratio, so they are crisp at any width). Nothing is rendered on
the kernel's loop. ``figure()`` draws the same data with matplotlib, for saving.

The data lives in plain classes that tests drive without a browser:
:class:`BackpressureData` (per-consumer samples, the starved state, closed consumers
stopping) and :class:`TimelineData` (the bounded event list and its spans). Common API:
``refresh()`` polls once (without a running loop it blocks and returns whether anything
changed; inside one it returns a task with that result), ``sends`` counts messages to the
browser, ``widget`` is the box to display, ``close()`` / ``await aclose()``.
"""

from __future__ import annotations

import asyncio
import html
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]
import pandas as pd
import traitlets
from matplotlib.figure import Figure

from sandboxkit.notebook._figures import new_figure
from sandboxkit.notebook._frontend import HERE, VendoredWidget, esm
from sandboxkit.notebook._runtime import AnySandbox
from sandboxkit.notebook._widget import WidgetBase
from sandboxkit.providers.base import metrics_scope

if TYPE_CHECKING:
    from sandboxkit.notebook.panel import ProcessPanel

__all__ = [
    "LAG_COLORS",
    "MIN_PERIOD",
    "STATE_COLORS",
    "BackpressureChart",
    "BackpressureData",
    "ChartWidget",
    "LifecycleTimeline",
    "TimelineData",
]

MIN_PERIOD = 0.5
"""Charts poll (and send) at most once per this many seconds (~2 Hz)."""

STATE_COLORS = {
    "streaming": "#2ca02c",
    "starved": "#e6ab02",
    "blocked": "#ff7f0e",
    "kicked": "#d62728",
    "closed": "#9e9e9e",
}
"""Consumer state colours (badges and state strips)."""

LAG_COLORS = ("#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#393b79", "#637939")
"""Lag line colours: none of them is a state colour, so a line never reads as a state."""

_STARVED_AFTER = 1.0

_LINE_WIDTHS = (3.0, 1.8, 1.1)
"""Lag line widths in the figure, by drawing order (``LINE_WIDTHS`` in charts.js)."""


_ROLE_TEXT = {"panel": "panel", "sdk": "notebook handle", "ghost": "ghost"}


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
        text = _ROLE_TEXT.get(role, role)
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

    def __init__(self, pid: int, *, window: float = 120.0, starved_after: float = _STARVED_AFTER):
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
        closed = state in ("closed", "kicked") or row.get("closed_at") not in (None, "")
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
            if state in ("closed", "kicked"):
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


_MARKERS: dict[str, tuple[str, str, str, str]] = {
    "process.started": ("processes", "o", "#2ca02c", "start"),
    "process.exited": ("processes", "s", "#555555", "exit"),
    "process.restarted": ("processes", "P", "#1f77b4", "restart"),
    "consumer.attached": ("consumers", "^", "#17becf", "attach"),
    "consumer.detached": ("consumers", "v", "#9e9e9e", "detach"),
    "consumer.kicked": ("consumers", "X", "#d62728", "kick"),
    "consumer.gap": ("consumers", "D", "#ff7f0e", "gap"),
    "consumer.ghosted": ("consumers", "h", "#9467bd", "ghost"),
}
_ROWS = ("stalls", "consumers", "processes", "sandbox")


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
            (float(e["ts"]), e["kind"], e.get("pid")) for e in self.events if e["kind"] in _MARKERS
        ]

    def message(self, kind: str = "events") -> dict[str, Any]:
        """The state to send: markers and spans in seconds since the first event."""
        t0 = self.t0 or 0.0
        return {
            "type": kind,
            "t0": t0,
            "markers": [
                [ts - t0, _ROWS.index(_MARKERS[k][0]), _MARKERS[k][3], _MARKERS[k][2]]
                for ts, k, _ in self.markers
            ],
            "pauses": [[a - t0, None if b is None else b - t0] for a, b, _ in self.pause_spans],
            "stalls": [[a - t0, b - t0] for a, b, _ in self.stall_spans],
        }


class ChartWidget(VendoredWidget):
    """uPlot in the browser (``charts.js``); fed by a chart's messages."""

    _esm = esm("charts.js")
    _css = HERE / "charts.css"
    kind = traitlets.Unicode("backpressure").tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)
    height = traitlets.Int(220).tag(sync=True)


D = TypeVar("D")


class _PolledChart(WidgetBase, Generic[D]):
    """A chart whose kernel side polls and sends only what changed."""

    css_class = "sandboxkit-chart"
    kind = "backpressure"

    def __init__(self, sbx: AnySandbox, interval: float, height: int) -> None:
        super().__init__(sbx)
        assert self._rt.sandbox is not None
        self._sbx = self._rt.sandbox
        self.interval = max(interval, MIN_PERIOD)
        self.sends = 0
        """Messages sent to the browser."""
        self.polls = 0
        self.error: str | None = None
        self.view = ChartWidget(kind=self.kind, title=self._title(), height=height)
        self.view.on_msg(self._on_frontend_message)
        self.caption = widgets.HTML(value="")
        self.caption.add_class("sandboxkit-chart-caption")
        self.widget = widgets.VBox([self.view, self.caption])
        self.widget.add_class(self.css_class)
        self.widget.add_class("sandboxkit-chart")
        self.own(self.view, self.caption, self.widget)
        self._ticker = self._rt.ticker(self._tick, 1.0 / self.interval)

    # -- subclass hooks ----------------------------------------------------------------

    def _title(self) -> str:
        return ""

    async def _fetch(self) -> D:
        raise NotImplementedError

    def ingest(self, data: D) -> list[dict[str, Any]]:
        """Take polled data in; the messages to send (empty: nothing changed)."""
        raise NotImplementedError

    def _snapshot(self) -> dict[str, Any]:
        raise NotImplementedError

    def _summary(self) -> str:
        return ""

    def _draw(self, fig: Figure) -> None:
        raise NotImplementedError

    # -- polling and sending -------------------------------------------------------------

    async def _tick(self) -> None:
        try:
            data = await self._rt.call(self._fetch())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(exc)
            return
        self._apply(data)

    def _failed(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        if not self._closed:
            self.caption.value = f'<span style="color:#c0392b">{html.escape(self.error)}</span>'

    def _send(self, message: dict[str, Any]) -> None:
        self.view.send(message)
        self.sends += 1

    def _apply(self, data: D) -> bool:
        if self._closed:
            return False
        self.polls += 1
        if self.error is not None:
            self.error = None
            self.caption.value = ""
        messages = self.ingest(data)
        for message in messages:
            self._send(message)
        if messages:
            summary = html.escape(self._summary())
            if summary != self.caption.value:
                self.caption.value = summary
        title = self._title()
        if title != self.view.title:
            self.view.title = title
        return bool(messages)

    def _on_frontend_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if self._closed or not isinstance(content, dict) or content.get("type") != "hello":
            return
        message = self._snapshot()
        message["view"] = str(content.get("view", ""))
        self._send(message)

    def refresh(self) -> bool | asyncio.Task[bool] | None:
        """Poll once and send what changed. Without a running loop: blocks and returns
        whether anything changed; inside one: returns a task with that result."""
        fetch: Coroutine[Any, Any, D] = self._fetch()
        return self._rt.dispatch(fetch, self._apply, self._failed)

    def figure(self) -> Figure:
        """The same data as a matplotlib Figure (Agg, no pyplot), e.g. to save as PNG."""
        fig = new_figure(7.0, 3.6)
        self._draw(fig)
        return fig


class BackpressureChart(_PolledChart[pd.DataFrame]):
    """Per-consumer lag and state of one process over the last ``window`` seconds; given
    a panel, of whatever process the panel follows."""

    css_class = "sandboxkit-backpressure"
    kind = "backpressure"

    def __init__(
        self,
        sbx: AnySandbox,
        pid: int | ProcessPanel,
        *,
        interval: float = 0.5,
        window: float = 120,
    ) -> None:
        self.panel: ProcessPanel | None = None if isinstance(pid, int) else pid
        self._fixed_pid = pid if isinstance(pid, int) else None
        self._t0 = time.monotonic()
        self.data = BackpressureData(self._followed(), window=window)
        super().__init__(sbx, interval, 230)

    def _followed(self) -> int:
        if self.panel is not None:
            return self.panel.pid
        assert self._fixed_pid is not None
        return self._fixed_pid

    @property
    def pid(self) -> int:
        """The process charted now."""
        return self.data.pid

    @property
    def window(self) -> float:
        return self.data.window

    def _title(self) -> str:
        title = f"Backpressure of process {self.data.pid}"
        if metrics_scope(self._sbx) == "client":  # e.g. E2B: no consumer metrics to read
            title += " · client-side only (this kernel's readers; the provider reports none)"
        return title

    async def _fetch(self) -> pd.DataFrame:
        return await self._sbx.consumers()

    def _panel_consumer(self) -> str | None:
        follower = getattr(self.panel, "_follower", None) if self.panel is not None else None
        handle = getattr(follower, "handle", None)
        return getattr(getattr(handle, "stream", None), "consumer_id", None)

    def ingest(self, data: pd.DataFrame) -> list[dict[str, Any]]:
        now = round(time.monotonic() - self._t0, 3)
        messages = []
        restart = self.data.follow(self._followed(), now)
        if restart is not None:
            messages.append(restart)
        records = data.to_dict("records") if len(data) else []
        rows = [{str(k): (None if _isna(v) else v) for k, v in r.items()} for r in records]
        sample = self.data.ingest(rows, now, self._panel_consumer())
        if sample is not None:
            messages.append(sample)
        return messages

    def _snapshot(self) -> dict[str, Any]:
        message = self.data.snapshot()
        message["now"] = round(time.monotonic() - self._t0, 3)
        return message

    def _summary(self) -> str:
        open_tracks = [t for t in self.data.tracks.values() if not t.closed]
        return f"consumers: {len(open_tracks)} · " + ", ".join(
            f"{t.label}: {t.state}" for t in open_tracks
        )

    def _draw(self, fig: Figure) -> None:
        ax_lag, ax_state = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
        now = time.monotonic() - self._t0
        fig.suptitle(self._title(), fontsize=10)
        tracks = list(self.data.tracks.values())[-8:]
        if not tracks:
            ax_lag.text(
                0.5, 0.5, "no consumers yet", ha="center", va="center", transform=ax_lag.transAxes
            )
        for i, track in enumerate(tracks):
            points = list(track.points)
            if not points:
                continue
            end = points[-1][0] if track.closed else now
            xs = [p[0] for p in points] + [end]
            lags = [p[1] for p in points] + [points[-1][1]]
            # As in the browser: each later line thinner, ghosts dashed, so a line lying
            # on an earlier one leaves that one showing.
            ax_lag.step(
                xs,
                lags,
                where="post",
                label=track.label,
                color=track.color,
                linewidth=_LINE_WIDTHS[min(i, len(_LINE_WIDTHS) - 1)],
                linestyle=(0, (4, 3)) if track.label.startswith("ghost") else "-",
            )
            for (t, _, state), t_next in zip(points, xs[1:], strict=True):
                ax_state.broken_barh(
                    [(t, max(t_next - t, 1e-3))],
                    (i - 0.4, 0.8),
                    color=STATE_COLORS.get(state, "#1f77b4"),
                )
        for t, _old, new in self.data.restarts:
            ax_lag.axvline(t, color="#555555", linestyle="--", linewidth=1)
            ax_lag.annotate(
                f"restart → {new}", (t, 1), xycoords=("data", "axes fraction"), fontsize=7, va="top"
            )
        ax_lag.set_ylabel("lag (bytes)", fontsize=8)
        if tracks:
            ax_lag.legend(fontsize=7, loc="upper left", frameon=False)
        ax_state.set_yticks(range(len(tracks)))
        ax_state.set_yticklabels([t.label for t in tracks], fontsize=7)
        ax_state.set_xlabel("seconds", fontsize=8)
        ax_state.set_xlim(max(0.0, now - self.data.window), max(now, 1.0))
        from matplotlib.patches import Patch

        ax_state.legend(
            handles=[Patch(color=c, label=s) for s, c in STATE_COLORS.items()],
            fontsize=6,
            loc="upper left",
            ncols=5,
            frameon=False,
            bbox_to_anchor=(0, -0.35),
        )


def _isna(value: Any) -> bool:
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


class LifecycleTimeline(_PolledChart[list[dict[str, Any]]]):
    """Pause spans, consumer and process events and stall intervals of a sandbox."""

    css_class = "sandboxkit-timeline"
    kind = "timeline"

    def __init__(self, sbx: AnySandbox, *, interval: float = 0.5, max_events: int = 1000) -> None:
        self.data = TimelineData(max_events)
        super().__init__(sbx, interval, 170)

    @property
    def events(self) -> list[dict[str, Any]]:
        """The newest events seen (at most ``max_events``), as the daemon sends them."""
        return list(self.data.events)

    @property
    def pause_spans(self) -> list[tuple[float, float | None, str | None]]:
        return self.data.pause_spans

    @property
    def stall_spans(self) -> list[tuple[float, float, int | None]]:
        return self.data.stall_spans

    @property
    def markers(self) -> list[tuple[float, str, int | None]]:
        return self.data.markers

    def _title(self) -> str:
        title = f"Lifecycle of sandbox {self._sbx.sandbox_id}"
        if metrics_scope(self._sbx) == "client":  # e.g. E2B: it keeps no event journal
            title += " · as seen by this client (the provider keeps no journal)"
        return title

    async def _fetch(self) -> list[dict[str, Any]]:
        return await self._sbx.raw_events(self.data.next_seq)

    def ingest(self, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.data.ingest(data):
            return []
        message = self.data.message()
        message["now"] = time.time() - (self.data.t0 or time.time())
        return [message]

    def _snapshot(self) -> dict[str, Any]:
        message = self.data.message("snapshot")
        message["now"] = time.time() - (self.data.t0 or time.time())
        return message

    def _summary(self) -> str:
        return (
            f"events: {len(self.data.events)} · pauses: {len(self.pause_spans)} · "
            f"stalls: {len(self.stall_spans)}"
        )

    def _draw(self, fig: Figure) -> None:
        ax = fig.add_subplot()
        fig.suptitle(self._title(), fontsize=10)
        events = self.data.events
        if not events:
            ax.text(0.5, 0.5, "no events yet", ha="center", va="center", transform=ax.transAxes)
            return
        t0 = self.data.t0 or float(events[0]["ts"])
        t_end = max(time.time(), float(events[-1]["ts"])) - t0
        y = {row: i for i, row in enumerate(_ROWS)}
        for start, end, _ in self.pause_spans:
            stop = (end if end is not None else t0 + t_end) - t0
            ax.broken_barh(
                [(start - t0, max(stop - (start - t0), 1e-3))],
                (y["sandbox"] - 0.35, 0.7),
                color="#bbbbbb",
            )
        for start, end, _ in self.stall_spans:
            ax.broken_barh(
                [(start - t0, max(end - start, 1e-3))],
                (y["stalls"] - 0.35, 0.7),
                color="#d62728",
                alpha=0.6,
            )
        seen: set[str] = set()
        for ts, kind, _ in self.markers:
            row, marker, color, label = _MARKERS[kind]
            ax.scatter(
                [ts - t0],
                [y[row]],
                marker=marker,
                color=color,
                s=30,
                zorder=3,
                label=None if label in seen else label,
            )
            seen.add(label)
        ax.set_yticks(range(len(_ROWS)))
        ax.set_yticklabels(["stalls", "consumers", "processes", "paused"], fontsize=7)
        ax.set_ylim(-0.6, len(_ROWS) - 0.4)
        ax.set_xlim(0, max(t_end, 1.0) * 1.02)
        ax.set_xlabel("seconds since the first event", fontsize=8)
        if seen:
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
