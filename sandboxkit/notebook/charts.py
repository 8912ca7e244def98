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

The data lives in plain classes that tests drive without a browser
(:mod:`sandboxkit.notebook.chart_data`): :class:`BackpressureData` (per-consumer samples,
the starved state, closed consumers stopping) and :class:`TimelineData` (the bounded event
list and its spans). The consumer states' colours are the vocabulary's
(:data:`sandboxkit.vocab.STATE_COLORS`), handed to ``charts.js`` with the widget. Common API:
``refresh()`` polls once (without a running loop it blocks and returns whether anything
changed; inside one it returns a task with that result), ``sends`` counts messages to the
browser, ``widget`` is the box to display, ``close()`` / ``await aclose()``.
"""

from __future__ import annotations

import asyncio
import html
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]
import traitlets
from matplotlib.figure import Figure

from sandboxkit.notebook._figures import new_figure
from sandboxkit.notebook._frontend import HERE, VendoredWidget, esm
from sandboxkit.notebook._runtime import AnySandbox
from sandboxkit.notebook._widget import WidgetBase
from sandboxkit.notebook.chart_data import (
    LAG_COLORS,
    MARKERS,
    ROWS,
    BackpressureData,
    TimelineData,
)
from sandboxkit.providers.base import metrics_scope
from sandboxkit.vocab import FINAL_CONSUMER_STATES, STATE_COLORS

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

_LINE_WIDTHS = (3.0, 1.8, 1.1)
"""Lag line widths in the figure, by drawing order (``LINE_WIDTHS`` in charts.js)."""


class ChartWidget(VendoredWidget):
    """uPlot in the browser (``charts.js``); fed by a chart's messages."""

    _esm = esm("charts.js")
    _css = HERE / "charts.css"
    kind = traitlets.Unicode("backpressure").tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)
    height = traitlets.Int(220).tag(sync=True)
    state_colors = traitlets.Dict(default_value=dict(STATE_COLORS)).tag(sync=True)
    """Each consumer state's colour (:data:`sandboxkit.vocab.STATE_COLORS`): the browser
    draws with these, and defines none of its own."""
    final_states = traitlets.List(default_value=sorted(FINAL_CONSUMER_STATES)).tag(sync=True)
    """The states a consumer's line stops at (:data:`sandboxkit.vocab.FINAL_CONSUMER_STATES`)."""


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


class BackpressureChart(_PolledChart[list[dict[str, Any]]]):
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

    async def _fetch(self) -> list[dict[str, Any]]:
        return await self._sbx.raw_consumers()

    def _panel_consumer(self) -> str | None:
        follower = getattr(self.panel, "_follower", None) if self.panel is not None else None
        handle = getattr(follower, "handle", None)
        return getattr(getattr(handle, "stream", None), "consumer_id", None)

    def ingest(self, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
        now = round(time.monotonic() - self._t0, 3)
        messages = []
        restart = self.data.follow(self._followed(), now)
        if restart is not None:
            messages.append(restart)
        sample = self.data.ingest(data, now, self._panel_consumer())
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
        y = {row: i for i, row in enumerate(ROWS)}
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
            row, marker, color, label = MARKERS[kind]
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
        ax.set_yticks(range(len(ROWS)))
        ax.set_yticklabels(["stalls", "consumers", "processes", "paused"], fontsize=7)
        ax.set_ylim(-0.6, len(ROWS) - 0.4)
        ax.set_xlim(0, max(t_end, 1.0) * 1.02)
        ax.set_xlabel("seconds since the first event", fontsize=8)
        if seen:
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
