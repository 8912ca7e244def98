"""BackpressureChart and LifecycleTimeline: one persistent figure each, redrawn into an
``ipywidgets.Image`` only when the polled data changed, at most ~2 Hz, closed cleanly."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import wait_until

from sandboxkit import AsyncSandbox, Sandbox
from sandboxkit.notebook import BackpressureChart, LifecycleTimeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COUNTER = [
    sys.executable,
    "-u",
    "-c",
    "import time\nfor i in range(10**7):\n    print(i, flush=True)\n    time.sleep(0.005)\n",  # noqa: sleep-ok - a steady writer
]


async def apoll(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` on the running loop until it is true (a poll, not a sync)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.01)  # noqa: sleep-ok - poll interval


@pytest.mark.timeout(30)
def test_backpressure_redraws_only_when_consumers_change(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run(["cat"], background=True)  # one idle consumer
        chart = BackpressureChart(sbx, handle.pid)
        try:
            wait_until(lambda: len(sbx.consumers()) == 1, timeout=5, what="the consumer")
            assert chart.refresh() is True  # no running loop: blocks, says it redrew
            assert chart.renders == 1
            assert bytes(chart.image.value).startswith(PNG_MAGIC)
            first = bytes(chart.image.value)
            assert list(chart.history) == [str(sbx.consumers()["consumer_id"][0])]
            # Keepalives flow, but nothing the chart shows changes: no redraw.
            for _ in range(3):
                assert chart.refresh() is False
            assert chart.renders == 1 and bytes(chart.image.value) == first
            assert chart.polls == 4
            # Output moves the consumer's cursor: the data changed, so it redraws.
            handle.send_stdin("hello\n")
            wait_until(lambda: "hello" in handle.stdout, timeout=5, what="echo")
            assert chart.refresh() is True
            assert chart.renders == 2 and bytes(chart.image.value) != first
            assert chart.caption.value.startswith("consumers: 1")
        finally:
            chart.close()
            handle.disconnect()
        assert chart.tasks == 0
        assert chart.widget.comm is None and chart.image.comm is None
        chart.close()  # idempotent


@pytest.mark.timeout(30)
async def test_backpressure_ticker_redraws_at_most_twice_a_second(
    conn: dict[str, Any],
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        info = await sbx.commands.start(COUNTER)
        handle = await sbx.commands.connect(info.pid)  # a consumer whose cursor moves
        threads = set(threading.enumerate())
        chart = BackpressureChart(sbx, info.pid, interval=0.05)  # asks for 20 Hz
        try:
            await apoll(lambda: chart.renders >= 1, timeout=5, what="first render")
            started, renders = time.monotonic(), chart.renders
            await apoll(lambda: chart.renders >= renders + 3, timeout=10, what="renders")
            elapsed = time.monotonic() - started
            # Data changes on every poll here, yet redraws are capped at ~2 Hz.
            assert (chart.renders - renders) <= 2 * elapsed + 1.5, elapsed
            assert chart.polls <= chart.renders + 1
        finally:
            await chart.aclose()
            await handle.disconnect()
        assert chart.tasks == 0
        assert set(threading.enumerate()) <= threads
        renders = chart.renders
        await asyncio.sleep(0.7)  # noqa: sleep-ok - observation window: a closed chart stays
        assert chart.renders == renders


def test_backpressure_ingest_tracks_state_per_consumer() -> None:
    import pandas as pd

    from sandboxkit.client.sandbox import consumers_frame

    def row(cid: str, pid: int, state: str, cursor: int, lag: int) -> dict[str, Any]:
        return {
            "consumer_id": cid,
            "pid": pid,
            "state": state,
            "cursor": cursor,
            "head": cursor + 1,
            "lag_bytes": lag,
        }

    chart = BackpressureChart.__new__(BackpressureChart)
    chart.pid, chart.window, chart._t0, chart._signature = 5, 120.0, time.monotonic(), None
    chart.history, chart.names = {}, {}
    empty: pd.DataFrame = consumers_frame([])
    assert chart.ingest(empty) is True  # the first poll always draws
    assert chart.ingest(empty) is False
    frame = consumers_frame([row("a", 5, "streaming", 1, 10), row("z", 6, "blocked", 0, 99)])
    assert chart.ingest(frame) is True
    assert list(chart.history) == ["a"], "other processes' consumers are ignored"
    assert chart.ingest(frame) is False
    frame = consumers_frame([row("a", 5, "blocked", 1, 10)])
    assert chart.ingest(frame) is True
    assert [p[2] for p in chart.history["a"]] == ["streaming", "blocked"]


@pytest.mark.timeout(30)
def test_timeline_redraws_on_new_events_only(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run(["cat"], background=True)
        timeline = LifecycleTimeline(sbx)
        try:
            assert timeline.refresh() is True
            assert timeline.renders == 1 and bytes(timeline.image.value).startswith(PNG_MAGIC)
            kinds = [kind for _, kind, _ in timeline.markers]
            assert "process.started" in kinds
            wait_until(lambda: timeline.refresh() is False, timeout=5, what="quiet journal")
            renders = timeline.renders
            assert timeline.refresh() is False and timeline.renders == renders
            sbx.pause()
            sbx.resume()
            assert timeline.refresh() is True
            assert timeline.renders == renders + 1
            spans = timeline.pause_spans
            assert len(spans) == 1 and spans[0][1] is not None and spans[0][2] == "user"
            assert spans[0][0] <= spans[0][1]
            assert timeline.caption.value.startswith("events: ")
        finally:
            timeline.close()
            handle.disconnect()
        assert timeline.tasks == 0 and timeline.widget.comm is None


def test_timeline_derives_spans_and_markers_from_events() -> None:
    timeline = LifecycleTimeline.__new__(LifecycleTimeline)
    timeline.events, timeline._next_seq, timeline._started = [], 0, False
    events = [
        {"seq": 0, "ts": 100.0, "kind": "sandbox.created", "pid": None, "data": {}},
        {"seq": 1, "ts": 101.0, "kind": "consumer.attached", "pid": 1, "data": {}},
        {"seq": 2, "ts": 102.0, "kind": "sandbox.paused", "pid": None, "reason": "timeout"},
        {"seq": 3, "ts": 104.0, "kind": "sandbox.resumed", "pid": None, "reason": "auto"},
        {"seq": 4, "ts": 110.0, "kind": "consumer.kicked", "pid": 1, "data": {"blocked_for": 5}},
        {"seq": 5, "ts": 111.0, "kind": "sandbox.paused", "pid": None, "reason": "user"},
    ]
    assert timeline.ingest(events[:3]) is True
    assert timeline.pause_spans == [(102.0, None, "timeout")]
    assert timeline.ingest(events[:3]) is False, "already seen"
    assert timeline.ingest(events) is True
    assert timeline.pause_spans == [(102.0, 104.0, "timeout"), (111.0, None, "user")]
    assert timeline.stall_spans == [(105.0, 110.0, 1)]
    assert [k for _, k, _ in timeline.markers] == ["consumer.attached", "consumer.kicked"]


@pytest.mark.timeout(30)
async def test_timeline_ticker_picks_up_a_pause(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        timeline = LifecycleTimeline(sbx, interval=0.1)
        try:
            await apoll(lambda: timeline.renders >= 1, timeout=5, what="first render")
            await sbx.pause()
            await sbx.resume()
            await apoll(lambda: len(timeline.pause_spans) == 1, timeout=5, what="the span")
            assert timeline.renders >= 2
            task = timeline.refresh()  # inside a running loop: a task
            assert isinstance(task, asyncio.Task)
            assert await task is False
        finally:
            await timeline.aclose()
        assert timeline.tasks == 0
