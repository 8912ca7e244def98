"""Charts of what the daemon measures: consumer backpressure and the sandbox lifecycle.

``BackpressureChart(sbx, pid, *, interval=0.5, window=120)`` polls ``consumers()`` and
plots each consumer's lag (bytes) and state over the last ``window`` seconds.
``LifecycleTimeline(sbx, *, interval=1.0)`` polls ``events()`` and plots pause/resume
spans, consumer attach/detach/kick/gap/ghost events, process start/exit/restart and stall
intervals (a kicked consumer's blocked time).

Both render one persistent matplotlib :class:`~matplotlib.figure.Figure` (Agg, no pyplot)
into PNG bytes on an ``ipywidgets.Image`` — only when the polled data changed, and at most
twice a second (a ticker on the kernel loop, period ``max(interval, 0.5)``). Common API:
``refresh()`` polls once and redraws if the data changed (without a running loop it blocks
and returns whether it redrew; inside one it returns a task whose result that is),
``renders`` counts redraws, ``widget`` is the box to display, ``close()`` /
``await aclose()`` stop the ticker and close the widgets and the figure.
"""

from __future__ import annotations

import asyncio
import html
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]
import pandas as pd
from matplotlib.axes import Axes

from sandboxkit.notebook._runtime import AnySandbox, Runtime, figure_png, new_figure

__all__ = ["MIN_PERIOD", "BackpressureChart", "LifecycleTimeline"]

MIN_PERIOD = 0.5
"""Charts redraw at most once per this many seconds from their ticker (~2 Hz)."""

STATE_COLORS = {
    "streaming": "#2ca02c",
    "blocked": "#ff7f0e",
    "kicked": "#d62728",
    "closed": "#9e9e9e",
}

D = TypeVar("D")


class _PolledChart(Generic[D]):
    """A figure redrawn from polled data of type ``D``, only when that data changed."""

    css_class = "sandboxkit-chart"

    def __init__(self, sbx: AnySandbox, interval: float, width: float, height: float) -> None:
        self._rt = Runtime(sbx)
        assert self._rt.sandbox is not None
        self._sbx = self._rt.sandbox
        self.interval = interval
        self.renders = 0
        """How many times the figure was redrawn (and the image's value set)."""
        self.polls = 0
        self.error: str | None = None
        self._closed = False
        self.figure = new_figure(width, height)
        self.image = widgets.Image(format="png", value=b"")
        self.caption = widgets.HTML(value="")
        self.widget = widgets.VBox([self.image, self.caption])
        self.widget.add_class(self.css_class)
        self._ticker = self._rt.ticker(self._tick, 1.0 / max(interval, MIN_PERIOD))

    # -- subclass hooks ----------------------------------------------------------------

    async def _fetch(self) -> D:
        """Poll the daemon (runs on the sandbox loop)."""
        raise NotImplementedError

    def ingest(self, data: D) -> bool:
        """Take polled data in; True if what the figure shows changed."""
        raise NotImplementedError

    def _draw(self) -> None:
        """Draw the current data into :attr:`figure` (already cleared)."""
        raise NotImplementedError

    def _summary(self) -> str:
        return ""

    # -- polling and drawing -------------------------------------------------------------

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

    def _apply(self, data: D) -> bool:
        if self._closed:
            return False
        self.polls += 1
        self.error = None
        if not self.ingest(data):
            return False
        self.redraw()
        return True

    def redraw(self) -> None:
        """Draw the figure now and set the image (counted in :attr:`renders`)."""
        self.figure.clear()
        self._draw()
        self.image.value = figure_png(self.figure)
        self.caption.value = html.escape(self._summary())
        self.renders += 1

    def refresh(self) -> bool | asyncio.Task[bool] | None:
        """Poll once and redraw if the data changed. Without a running loop: blocks and
        returns whether it redrew; inside one: returns a task with that result."""
        fetch: Coroutine[Any, Any, D] = self._fetch()
        return self._rt.dispatch(fetch, self._apply, self._failed)

    @property
    def tasks(self) -> int:
        """Owned tasks still running (0 once closed)."""
        return self._rt.tasks

    # -- display and teardown ----------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)  # type: ignore[no-untyped-call, unused-ignore]

    def close(self) -> None:
        """Stop polling, close the widgets and release the figure. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._rt.close()
        for widget in (self.image, self.caption, self.widget):
            widget.close()
        self.figure.clear()

    async def aclose(self) -> None:
        """:meth:`close`, awaiting the ticker's end."""
        self.close()
        await self._rt.aclose()


class BackpressureChart(_PolledChart[pd.DataFrame]):
    """Per-consumer lag and state of process ``pid`` over the last ``window`` seconds."""

    css_class = "sandboxkit-backpressure"

    def __init__(
        self, sbx: AnySandbox, pid: int, *, interval: float = 0.5, window: float = 120
    ) -> None:
        self.pid = pid
        self.window = window
        self._t0 = time.monotonic()
        self._signature: tuple[tuple[Any, ...], ...] | None = None
        self.history: dict[str, deque[tuple[float, int, str]]] = {}
        """Per consumer id: ``(seconds since the chart started, lag_bytes, state)``."""
        self.names: dict[str, str] = {}
        super().__init__(sbx, interval, 7.0, 3.6)

    async def _fetch(self) -> pd.DataFrame:
        return await self._sbx.consumers()

    def ingest(self, data: pd.DataFrame) -> bool:
        rows = data[data["pid"] == self.pid] if len(data) else data
        records = rows.to_dict("records")
        signature = tuple(
            sorted(
                (
                    str(r["consumer_id"]),
                    str(r["state"]),
                    int(r["cursor"]),
                    int(r["head"]),
                    int(r["lag_bytes"]),
                )
                for r in records
            )
        )
        if signature == self._signature:
            return False
        self._signature = signature
        now = time.monotonic() - self._t0
        for r in records:
            cid = str(r["consumer_id"])
            points = self.history.setdefault(cid, deque())
            point = (now, int(r["lag_bytes"]), str(r["state"]))
            if not points or points[-1][1:] != point[1:]:
                points.append(point)
            name = r.get("name")
            self.names[cid] = str(name) if isinstance(name, str) and name else cid[:8]
        present = {str(r["consumer_id"]) for r in records}
        for cid, points in list(self.history.items()):
            while len(points) > 1 and now - points[1][0] > self.window:
                points.popleft()
            if cid not in present and now - points[-1][0] > self.window:
                del self.history[cid]
        return True

    def _draw(self) -> None:
        fig = self.figure
        ax_lag, ax_state = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
        now = time.monotonic() - self._t0
        fig.suptitle(f"Backpressure of process {self.pid}", fontsize=10)
        if not self.history:
            ax_lag.text(
                0.5, 0.5, "no consumers yet", ha="center", va="center", transform=ax_lag.transAxes
            )
        consumers = list(self.history)[-8:]
        for i, cid in enumerate(consumers):
            points = list(self.history[cid])
            xs = [p[0] for p in points] + [now]
            lags = [p[1] for p in points] + [points[-1][1]]
            ax_lag.step(xs, lags, where="post", label=self.names.get(cid, cid[:8]))
            for (t, _, state), t_next in zip(points, xs[1:], strict=True):
                ax_state.broken_barh(
                    [(t, max(t_next - t, 1e-3))],
                    (i - 0.4, 0.8),
                    color=STATE_COLORS.get(state, "#1f77b4"),
                )
        ax_lag.set_ylabel("lag (bytes)", fontsize=8)
        if consumers:
            ax_lag.legend(fontsize=7, loc="upper left", frameon=False)
        ax_state.set_yticks(range(len(consumers)))
        ax_state.set_yticklabels([self.names.get(c, c[:8]) for c in consumers], fontsize=7)
        ax_state.set_xlabel("seconds", fontsize=8)
        ax_state.set_xlim(max(0.0, now - self.window), max(now, 1.0))
        _state_legend(ax_state)

    def _summary(self) -> str:
        open_states = [
            points[-1][2] for points in self.history.values() if points[-1][2] != "closed"
        ]
        return f"consumers: {len(self.history)} · " + ", ".join(open_states)


def _state_legend(ax: Axes) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=s) for s, c in STATE_COLORS.items()]
    ax.legend(
        handles=handles,
        fontsize=6,
        loc="upper left",
        ncols=4,
        frameon=False,
        bbox_to_anchor=(0, -0.35),
    )


# Timeline rows and markers: event kind -> (row, marker, colour, label).
_MARKERS: dict[str, tuple[str, str, str, str]] = {
    "process.started": ("processes", "o", "#2ca02c", "start"),
    "process.exited": ("processes", "s", "#555555", "exit"),
    "process.restarted": ("processes", "P", "#1f77b4", "restart"),
    "consumer.attached": ("consumers", "^", "#2ca02c", "attach"),
    "consumer.detached": ("consumers", "v", "#9e9e9e", "detach"),
    "consumer.kicked": ("consumers", "X", "#d62728", "kick"),
    "consumer.gap": ("consumers", "D", "#ff7f0e", "gap"),
    "consumer.ghosted": ("consumers", "h", "#9467bd", "ghost"),
}
_ROWS = ("stalls", "consumers", "processes", "sandbox")


class LifecycleTimeline(_PolledChart[list[dict[str, Any]]]):
    """Pause/resume spans, consumer and process events and stall intervals of a sandbox."""

    css_class = "sandboxkit-timeline"

    def __init__(self, sbx: AnySandbox, *, interval: float = 1.0) -> None:
        self.events: list[dict[str, Any]] = []
        """Every event seen so far, as the daemon sends it (``seq``, ``ts``, ``kind``...)."""
        self._next_seq = 0
        self._started = False
        super().__init__(sbx, interval, 7.0, 2.8)

    async def _fetch(self) -> list[dict[str, Any]]:
        return await self._sbx.raw_events(self._next_seq)

    def ingest(self, data: list[dict[str, Any]]) -> bool:
        new = [e for e in data if int(e["seq"]) >= self._next_seq]
        first = not self._started
        self._started = True
        if not new:
            return first
        self.events.extend(new)
        self._next_seq = max(int(e["seq"]) for e in new) + 1
        return True

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

    def _draw(self) -> None:
        ax = self.figure.add_subplot()
        self.figure.suptitle(f"Lifecycle of sandbox {self._sbx.sandbox_id}", fontsize=10)
        if not self.events:
            ax.text(0.5, 0.5, "no events yet", ha="center", va="center", transform=ax.transAxes)
            return
        t0 = float(self.events[0]["ts"])
        t_end = max(time.time(), float(self.events[-1]["ts"])) - t0
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

    def _summary(self) -> str:
        return (
            f"events: {len(self.events)} · pauses: {len(self.pause_spans)} · "
            f"stalls: {len(self.stall_spans)}"
        )
