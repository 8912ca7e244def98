"""``StallLab``: the reattach experiment of :mod:`sandboxkit.lab` behind a "Run" button.

Pick fan-out policies, a ghost kind, a number of cycles and a deadline; "Run" runs
:func:`sandboxkit.lab.reattach_cycles` for each policy — what
:func:`sandboxkit.lab.compare` does, with the cycle counter feeding an
``ipywidgets.IntProgress`` instead of tqdm — then shows the stall table
(:func:`sandboxkit.lab.stall_table`) and the stall-rate plot
(:func:`sandboxkit.lab.plot_stall_rates`).

Threading: the experiment runs on the client's background loop thread
(:func:`~sandboxkit.client.loop_thread.shared_loop_thread`); its per-cycle callback only
updates :class:`LabState` under a lock. Widgets are set only by :meth:`StallLab.flush`, on
the thread that built the lab. Inside a running kernel, :meth:`StallLab.on_run` returns at
once with an owned task on the kernel's loop that waits for the experiment and flushes at
most ``flush_hz`` times a second while it runs (``await lab.on_run()`` in a cell waits for
the result). Outside a running loop (a script, a test) :meth:`~StallLab.on_run` blocks
until the experiment is done and flushes once at the end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import html
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]
import pandas as pd

from sandboxkit.client.loop_thread import shared_loop_thread
from sandboxkit.errors import InvalidArgument
from sandboxkit.lab.experiment import CYCLE_COLUMNS, reattach_cycles
from sandboxkit.lab.plots import plot_stall_rates
from sandboxkit.lab.stats import format_duration, stall_table
from sandboxkit.lab_options import FANOUT_POLICIES, GHOST_KINDS
from sandboxkit.notebook._figures import figure_png
from sandboxkit.notebook._runtime import Runtime
from sandboxkit.notebook._widget import close_tree

__all__ = ["LabState", "StallLab", "stall_table_html"]

_CLOSE_TIMEOUT = 15.0
"""How long :meth:`StallLab.close` waits for a cancelled run to kill its sandbox."""


@dataclass
class LabState:
    """The experiment's progress and outcome, as plain data (``version`` grows on every
    change)."""

    total: int = 0
    """Cycles the current run will make."""
    done: int = 0
    """Cycles finished so far."""
    stalled_cycles: int = 0
    """Stalled cycles so far."""
    current: str = ""
    """The configuration running now (``policy/ghost``)."""
    running: bool = False
    error: str | None = None
    result: pd.DataFrame | None = None
    elapsed: float = math.nan
    version: int = 0


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a task's exception as seen (it is shown in the widget)."""
    if not task.cancelled():
        task.exception()


# The stall table's own layout. It is shown inside an ipywidgets ``HTML`` (whose content
# has a 28 px line height and no table style) and as a notebook output (JupyterLab's
# table style): both would centre or right-align the headers over left-aligned cells and
# wrap "pause-snapshot" in two. Here every header sits exactly over its column (text
# left, numbers right), nothing wraps but the two-line headers, and a table wider than
# its output scrolls sideways instead of being cut off.
_STALL_TABLE_CSS = """
.sandboxkit-stall-wrap { overflow-x: auto; max-width: 100%; }
.sandboxkit-stall-wrap table.sandboxkit-stall { border-collapse: collapse; border: none;
  font-size: 12px; line-height: 1.35; margin: 4px 0; table-layout: auto; }
.sandboxkit-stall-wrap table.sandboxkit-stall th,
.sandboxkit-stall-wrap table.sandboxkit-stall td { padding: 3px 5px; white-space: nowrap;
  text-align: left; vertical-align: bottom; border: none; max-width: none; }
.sandboxkit-stall-wrap table.sandboxkit-stall thead th { border-bottom: 1px solid #999;
  font-weight: 600; }
.sandboxkit-stall-wrap table.sandboxkit-stall tbody tr:nth-child(odd) { background: #f5f5f5; }
.sandboxkit-stall-wrap table.sandboxkit-stall .sandboxkit-num { text-align: right;
  font-variant-numeric: tabular-nums; }
"""


def stall_table_html(df: pd.DataFrame) -> str:
    """The stall table of a per-cycle frame as HTML (with its own style): rates in percent
    with their Wilson interval, completion times in ms/s, every header over its column."""
    table = stall_table(df)
    confidence = float(table.attrs.get("confidence", 0.95))
    # (header lines, numeric?, values)
    columns: list[tuple[tuple[str, ...], bool, list[str]]] = [
        (("policy",), False, [str(v) for v in table["policy"]]),
        (("ghost",), False, [str(v) for v in table["ghost"]]),
        (("stalls",), True, [str(v) for v in table["stalls"]]),
        (
            ("stall rate", f"[{confidence * 100:g}% CI]"),
            True,
            [
                f"{r:.0%} [{lo:.0%}–{hi:.0%}]"
                for r, lo, hi in zip(
                    table["stall_rate"], table["ci_low"], table["ci_high"], strict=True
                )
            ],
        ),
        (("median", "done"), True, [format_duration(t) for t in table["median_time_to_complete"]]),
        (("max", "done"), True, [format_duration(t) for t in table["max_time_to_complete"]]),
        (("kicks",), True, [str(v) for v in table["kicks"]]),
        (("gaps",), True, [str(v) for v in table["gaps"]]),
    ]

    def cell(tag: str, numeric: bool, text: str) -> str:
        cls = ' class="sandboxkit-num"' if numeric else ""
        return f"<{tag}{cls}>{text}</{tag}>"

    head = "".join(
        cell("th", numeric, "<br>".join(html.escape(line) for line in lines))
        for lines, numeric, _ in columns
    )
    body = "".join(
        "<tr>"
        + "".join(cell("td", numeric, html.escape(values[i])) for _, numeric, values in columns)
        + "</tr>"
        for i in range(len(table))
    )
    return (
        f"<style>{_STALL_TABLE_CSS}</style>"
        '<div class="sandboxkit-stall-wrap"><table class="sandboxkit-stall">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


class StallLab:
    """The stall experiment as a widget: choose, press "Run", read the table and plot.

    Args:
        policies: policies selected at start (any of ``blocking``, ``kick``, ``cursor``).
        ghost: the ghost kind (one of :data:`sandboxkit.lab.GHOST_KINDS`).
        cycles: reattach cycles per policy.
        deadline: seconds each cycle waits for the refresh answers.
        flush_hz: the most renders per second while a run is going.
        lab_options: passed on to :func:`sandboxkit.lab.reattach_cycles` (e.g. ``url``,
            ``token``, ``response_size``, ``kick_grace``, ``ghost_buffer``).
    """

    def __init__(
        self,
        *,
        policies: Sequence[str] = ("blocking", "cursor"),
        ghost: str = "pause-snapshot",
        cycles: int = 3,
        deadline: float = 2.0,
        flush_hz: float = 10.0,
        **lab_options: Any,
    ) -> None:
        if "on_cycle" in lab_options:
            raise TypeError("StallLab counts cycles itself; on_cycle cannot be passed")
        self.lab_options = lab_options
        self.flush_hz = flush_hz
        self.state = LabState()
        self._lock = threading.Lock()
        self._rendered = -1
        self._rendered_result: pd.DataFrame | None = None
        self._closed = False
        self._runtime = Runtime()
        self._task: asyncio.Task[pd.DataFrame] | None = None
        self._future: concurrent.futures.Future[pd.DataFrame] | None = None
        self._started = threading.Event()
        self._stopped = threading.Event()

        self.policies = widgets.SelectMultiple(
            options=list(FANOUT_POLICIES),
            value=list(policies),
            description="policies",
            rows=len(FANOUT_POLICIES),
        )
        self.ghost = widgets.Dropdown(options=list(GHOST_KINDS), value=ghost, description="ghost")
        self.cycles = widgets.IntSlider(value=cycles, min=1, max=30, description="cycles")
        self.deadline = widgets.BoundedFloatText(
            value=deadline, min=0.1, max=60.0, step=0.5, description="deadline (s)"
        )
        self.run_button = widgets.Button(description="Run", icon="play", button_style="primary")
        self.run_button.on_click(lambda _b: self.on_run())
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="cycles")
        self.status = widgets.HTML()
        self.table = widgets.HTML()
        # Hidden while empty (an empty Image shows a broken-image icon); never taller than
        # a laptop's viewport, never stretched beyond its pixels.
        self.plot = widgets.Image(
            format="png",
            layout=widgets.Layout(
                display="none", max_width="100%", max_height="420px", object_fit="contain"
            ),
        )
        self.table.add_class("sandboxkit-stall-table")
        # The rows wrap where the output is narrower than them (a laptop with the file
        # browser open) instead of cutting off the controls on the right.
        wrap = widgets.Layout(flex_flow="row wrap")
        self.widget = widgets.VBox(
            [
                widgets.HBox(
                    [
                        self.policies,
                        widgets.VBox([self.ghost, self.cycles, self.deadline, self.run_button]),
                    ],
                    layout=wrap,
                ),
                widgets.HBox([self.progress, self.status], layout=wrap),
                self.table,
                self.plot,
            ]
        )
        self.widget.add_class("sandboxkit-stall-lab")
        self.flush()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)  # type: ignore[no-untyped-call, unused-ignore]

    @property
    def result(self) -> pd.DataFrame | None:
        """The per-cycle frame of the last finished run (columns
        :data:`sandboxkit.lab.CYCLE_COLUMNS`), or ``None``."""
        with self._lock:
            return self.state.result

    @property
    def running(self) -> bool:
        """Whether a run is going."""
        with self._lock:
            return self.state.running

    # -- the run -----------------------------------------------------------------------

    def on_run(self) -> pd.DataFrame | asyncio.Task[pd.DataFrame]:
        """Run the experiment with the settings of the widgets; the per-cycle frame.

        Outside a running loop this blocks until the run ends and returns the frame.
        Inside a running kernel it returns the owned task at once (``await`` it for the
        frame); pressing "Run" again while it goes returns the same task. A failed run is
        shown in the status line and raised (from the call, or from the awaited task).
        """
        if self._closed:
            raise RuntimeError("this StallLab is closed")
        if self._task is not None and not self._task.done():
            return self._task
        policies = list(self.policies.value)
        ghost = str(self.ghost.value)
        cycles = int(self.cycles.value)
        deadline = float(self.deadline.value)
        if not policies:
            self._update(error="choose at least one policy", running=False)
            self.flush()
            raise InvalidArgument("choose at least one policy", field="policies")
        self._update(
            total=len(policies) * cycles,
            done=0,
            stalled_cycles=0,
            current="",
            running=True,
            error=None,
            result=None,
            elapsed=math.nan,
        )
        self.flush()
        started = time.monotonic()
        self._started.clear()
        self._stopped.clear()
        future = shared_loop_thread().submit(self._experiment(policies, ghost, cycles, deadline))
        self._future = future
        if self._runtime.live:
            task = self._runtime.spawn_ui(
                self._follow(future, started), name="sandboxkit-stall-lab"
            )
            task.add_done_callback(_retrieve)  # a button click never awaits it
            self._task = task
            return task
        try:
            result = future.result()
        except BaseException as error:
            self._failed(error, started)
            raise
        self._finish(result, started)
        return result

    async def _experiment(
        self, policies: list[str], ghost: str, cycles: int, deadline: float
    ) -> pd.DataFrame:
        """Runs on the client's loop thread: each policy in turn, counting cycles."""
        frames: list[pd.DataFrame] = []
        try:
            self._started.set()
            for policy in policies:
                self._update(current=f"{policy}/{ghost}")
                frames.append(
                    await reattach_cycles(
                        cycles,
                        policy,
                        ghost,
                        deadline=deadline,
                        on_cycle=self._on_cycle,
                        **self.lab_options,
                    )
                )
        finally:
            self._stopped.set()  # every sandbox of the run is killed by now
        result: pd.DataFrame = (
            pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=CYCLE_COLUMNS)
        )
        return result

    def _on_cycle(self, row: dict[str, Any]) -> None:
        """Per-cycle callback (loop thread): count only; never touch a widget."""
        with self._lock:
            self.state.done += 1
            self.state.stalled_cycles += int(bool(row.get("stalled")))
            self.state.version += 1

    async def _follow(
        self, future: concurrent.futures.Future[pd.DataFrame], started: float
    ) -> pd.DataFrame:
        """The owned task on the kernel's loop: flush while the run goes, then show it."""
        waiting = asyncio.wrap_future(future)
        period = 1.0 / self.flush_hz if self.flush_hz > 0 else 0.1
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=period)
                if done:
                    break
                self.flush()
            result = waiting.result()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as error:
            self._failed(error, started)
            raise
        self._finish(result, started)
        return result

    def _finish(self, result: pd.DataFrame, started: float) -> None:
        self._update(result=result, running=False, elapsed=time.monotonic() - started)
        self.flush()

    def _failed(self, error: BaseException, started: float) -> None:
        self._update(
            error=f"{type(error).__name__}: {error}",
            running=False,
            elapsed=time.monotonic() - started,
        )
        self.flush()

    def _update(self, **changes: Any) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(self.state, key, value)
            self.state.version += 1

    # -- rendering ---------------------------------------------------------------------

    def flush(self) -> bool:
        """Render the state into the widgets if it changed; True if it rendered. Call on
        the thread that owns the widgets."""
        with self._lock:
            state = self.state
            if state.version == self._rendered:
                return False
            self._rendered = state.version
            total, done, stalled = state.total, state.done, state.stalled_cycles
            current, running, error = state.current, state.running, state.error
            result, elapsed = state.result, state.elapsed
        self.progress.max = max(total, 1)
        self.progress.value = min(done, self.progress.max)
        self.progress.bar_style = "info" if running else ("danger" if error else "success")
        self.run_button.disabled = running
        if error:
            self.status.value = f"<span style='color:#d62728'>{html.escape(error)}</span>"
        elif running:
            self.status.value = html.escape(
                f"{done}/{total} cycles, {stalled} stalled — running {current}"
            )
        elif result is not None:
            self.status.value = html.escape(
                f"{done}/{total} cycles, {stalled} stalled, in {elapsed:.1f} s"
            )
        else:
            self.status.value = "press Run"
        if result is not self._rendered_result:
            self._rendered_result = result
            if result is None:
                self.table.value = ""
                self.plot.value = b""
                self.plot.layout.display = "none"
            else:
                self.table.value = stall_table_html(result)
                self.plot.value = figure_png(plot_stall_rates(result), dpi=90)
                self.plot.layout.display = ""
        return True

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Cancel a run that is going (its sandbox is killed) and wait, bounded, for it.

        Call it on the thread that built the lab (the kernel's), never on the client's
        loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._runtime.close()  # cancels the owned task, if a run is going
        self._stop_run()
        self._closed_flush()
        close_tree(self.widget)

    async def aclose(self) -> None:
        """:meth:`close` for a coroutine: the waits happen off the running loop."""
        if self._closed:
            return
        self._closed = True
        await self._runtime.aclose()
        await asyncio.to_thread(self._stop_run)
        self._closed_flush()
        close_tree(self.widget)

    def _stop_run(self) -> None:
        """Cancel the experiment on the loop thread and wait until its cleanup is done."""
        future, self._future = self._future, None
        if future is None:
            return
        future.cancel()
        # Cancelling marks the future at once, while the run's own cleanup (killing its
        # sandbox) goes on in the loop thread. A no-op round trip lets the loop deliver
        # the cancellation first: a run that had not started by then never will; one that
        # had sets ``_stopped`` when its cleanup is done.
        with contextlib.suppress(RuntimeError, TimeoutError):
            shared_loop_thread().run(asyncio.sleep(0), timeout=_CLOSE_TIMEOUT)
        if self._started.is_set():
            self._stopped.wait(_CLOSE_TIMEOUT)

    def _closed_flush(self) -> None:
        self._update(running=False)
        self.flush()

    def __enter__(self) -> StallLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<StallLab {self.state.done}/{self.state.total} cycles>"
