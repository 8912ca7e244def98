"""BackpressureChart and LifecycleTimeline: the kernel side polls and sends only new
samples to the browser (uPlot draws them); ``figure()`` draws the same data with
matplotlib. The data classes are driven as plain Python; the charts against the
in-process daemon, with recording comms standing in for the browser."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import comm
import pytest
from matplotlib.figure import Figure
from support import poll, wait_until

from sandboxkit import AsyncSandbox, Sandbox
from sandboxkit.daemon.server import WORKER_THREADS
from sandboxkit.notebook import BackpressureChart, LifecycleTimeline, ProcessPanel
from sandboxkit.notebook.charts import LAG_COLORS, STATE_COLORS, BackpressureData, TimelineData

COUNTER = [
    sys.executable,
    "-u",
    "-c",
    "import time\nfor i in range(10**7):\n    print(i, flush=True)\n    "
    "time.sleep(0.005)\n",  # sleep-ok: the child process's pace
]


class RecordingComm:
    kernel = "recording"

    def __init__(self, **kwargs: Any) -> None:
        self.comm_id = uuid.uuid4().hex
        self.messages: list[Any] = []

    def open(self, *args: Any, **kwargs: Any) -> None:
        pass

    def on_msg(self, *args: Any, **kwargs: Any) -> None:
        pass

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        self.messages.append(data)

    def close(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.fixture(autouse=True)
def recording_comms(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(comm, "create_comm", lambda **kw: RecordingComm(**kw))
    yield


def sent(chart: Any) -> list[dict[str, Any]]:
    """The custom messages the chart sent to the browser."""
    return [
        m["content"]
        for m in chart.view.comm.messages
        if isinstance(m, dict) and m.get("method") == "custom"
    ]


def row(cid: str, state: str, lag: int, sent_: int, **extra: Any) -> dict[str, Any]:
    return {
        "consumer_id": cid,
        "pid": 5,
        "state": state,
        "lag_bytes": lag,
        "bytes_sent": sent_,
        **extra,
    }


# -- BackpressureData (plain Python) -----------------------------------------------------


def test_a_consumer_whose_lag_grows_without_progress_is_starved_not_streaming() -> None:
    data = BackpressureData(5, starved_after=1.0)
    # The daemon says "streaming" throughout (as under `blocking` for its victims).
    samples = [
        data.ingest([row("victim", "streaming", 100 * i, 50), row("ok", "streaming", 0, 80 * i)], t)
        for i, t in enumerate([0.0, 0.5, 1.0, 1.5, 2.0])
    ]
    states = [s["states"] for s in samples if s is not None]
    assert states[0]["victim"] == "streaming"
    assert states[-1]["victim"] == "starved", states
    assert all(s["ok"] == "streaming" for s in states)
    # Progress again: streaming again.
    last = data.ingest([row("victim", "streaming", 0, 5000), row("ok", "streaming", 0, 900)], 2.5)
    assert last is not None and last["states"]["victim"] == "streaming"


def test_labels_by_role_and_lag_colours_are_not_state_colours() -> None:
    data = BackpressureData(5)
    sample = data.ingest(
        [
            row("a1", "streaming", 0, 0, role="panel", name="c7"),
            row("b2", "streaming", 0, 0, role="sdk", name="c8"),
            row("c3", "blocked", 9, 0, role="sdk", name="c9", ghost=True),
        ],
        0.0,
    )
    assert sample is not None
    labels = {cid: v["label"] for cid, v in sample["labels"].items()}
    assert labels == {"a1": "panel · c7", "b2": "notebook handle · c8", "c3": "ghost · c9"}
    colors = [v["color"] for v in sample["labels"].values()]
    assert len(set(colors)) == 3 and not set(colors) & set(STATE_COLORS.values())
    assert not set(LAG_COLORS) & set(STATE_COLORS.values())
    # The panel's stream becomes a ghost at a pause: its label says so from then on.
    later = data.ingest([row("a1", "blocked", 50, 0, role="panel", name="c7", ghost=True)], 1.0)
    assert later is not None and later["labels"] == {
        "a1": {"label": "ghost · c7", "color": colors[0]}
    }


def test_a_closed_consumer_stops_and_nothing_changed_sends_nothing() -> None:
    data = BackpressureData(5)
    assert data.ingest([row("a", "streaming", 10, 0)], 0.0) is not None
    assert data.ingest([row("a", "streaming", 10, 0)], 0.5) is None, "no change: no message"
    closed = data.ingest([row("a", "closed", 10, 0, closed_at=1.0)], 1.0)
    assert closed is not None and closed["states"] == {"a": "closed"}
    # The daemon keeps reporting it (its lag frozen or even rising): the chart stops it.
    for t in (1.5, 2.0, 2.5):
        later = data.ingest([row("a", "closed", 10 + int(t * 100), 0, closed_at=1.0)], t)
        assert later is None or "a" not in later["lags"]
    assert data.tracks["a"].points[-1][0] == 1.0


def test_following_a_new_pid_marks_the_restart_and_closes_the_old_consumers() -> None:
    data = BackpressureData(5)
    data.ingest([row("a", "streaming", 0, 0)], 0.0)
    assert data.follow(5, 1.0) is None
    restart = data.follow(9, 2.0)
    assert restart == {"type": "restart", "t": 2.0, "old": 5, "pid": 9}
    assert data.tracks["a"].closed and list(data.restarts) == [(2.0, 5, 9)]
    new = data.ingest([{**row("n", "streaming", 0, 0), "pid": 9}, row("a", "streaming", 0, 0)], 3)
    assert new is not None and list(new["lags"]) == ["n"], "only the new process's consumers"


def test_samples_are_bounded_by_the_window() -> None:
    data = BackpressureData(5, window=10.0)
    for i in range(1000):
        data.ingest([row("a", "streaming", i, i)], float(i))
    points = data.tracks["a"].points
    assert len(points) <= 12 and points[-1][0] == 999.0
    assert len(data.snapshot()["points"]["a"]) == len(points)


# -- the charts against the daemon -----------------------------------------------------------


def _ink(fig: Figure, color: str, tolerance: int = 10) -> int:
    """How many pixels of the rendered figure are ``color`` (within ``tolerance``)."""
    import numpy as np

    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)  # type: ignore[attr-defined]
    want = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(pixels - want) <= tolerance).all(axis=-1).sum())


@pytest.mark.timeout(30)
def test_the_figure_shows_both_of_two_lag_lines_that_coincide(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run(["cat"], background=True)
        chart = BackpressureChart(sbx, handle.pid)
        try:
            # The panel's stream and a ghost with the same lag all along: one line on top
            # of the other.
            chart._t0 = time.monotonic() - 30  # the chart has run for 30 s

            def lines(*which: str) -> BackpressureData:
                data = BackpressureData(5)
                for i in range(20):
                    lag = 4000 + 300 * (i % 5)
                    rows = [
                        row("a", "streaming", lag, i, role="panel"),
                        row("b", "streaming", lag, i),
                    ]
                    rows[1]["ghost"] = True
                    data.ingest([r for r in rows if r["consumer_id"] in which], 10.0 + i)
                return data

            shown = {}
            for cid in ("a", "b"):
                chart.data = lines(cid)
                alone = _ink(chart.figure(), chart.data.tracks[cid].color)
                chart.data = lines("a", "b")
                together = _ink(chart.figure(), chart.data.tracks[cid].color)
                shown[cid] = round(together / alone, 2)
            # The line beneath keeps a good share of what it shows alone (it showed 1 %);
            # the one on top (alone it is drawn first, at the first line's width) shows.
            assert shown["a"] >= 0.4 and shown["b"] >= 0.2, shown
        finally:
            chart.close()
            handle.disconnect()


@pytest.mark.timeout(30)
def test_a_chart_and_a_panel_poll_the_daemon_without_building_a_dataframe(
    conn: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A classroom's kernel polls the consumers 24 times a second (benchmarks/widgets.py
    # --panels 8): a DataFrame each was a millisecond, a tenth of the kernel's 25 %.
    def no_frame(rows: Any) -> Any:
        raise AssertionError("a widget's poll built a DataFrame")

    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run(["cat"], background=True)
        panel = ProcessPanel(sbx, handle.pid)
        chart = BackpressureChart(sbx, panel)
        try:
            wait_until(lambda: len(sbx.raw_consumers()) == 2, timeout=5, what="two consumers")
            monkeypatch.setattr("sandboxkit.client.sandbox.consumers_frame", no_frame)
            assert chart.refresh() is True
            assert set(sent(chart)[-1]["lags"]) == {r["consumer_id"] for r in sbx.raw_consumers()}
            panel._rt.call_blocking(panel.poll())
            assert panel.state.head == sbx.commands.get(handle.pid).head
        finally:
            chart.close()
            panel.close()
            handle.disconnect()


@pytest.mark.timeout(30)
def test_backpressure_sends_samples_only_when_consumers_change(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run(["cat"], background=True)  # one idle consumer
        chart = BackpressureChart(sbx, handle.pid)
        try:
            wait_until(lambda: len(sbx.consumers()) == 1, timeout=5, what="the consumer")
            assert chart.refresh() is True  # no running loop: blocks, says it sent
            first = sent(chart)
            assert len(first) == 1 and first[0]["type"] == "sample"
            cid = str(sbx.consumers()["consumer_id"][0])
            assert list(first[0]["lags"]) == [cid] and first[0]["states"][cid] == "streaming"
            assert "labels" in first[0]
            for _ in range(3):  # keepalives flow, but nothing shown changes
                assert chart.refresh() is False
            assert len(sent(chart)) == 1 and chart.polls == 4
            # A view that renders gets everything kept so far.
            chart._on_frontend_message(chart.view, {"type": "hello", "view": "v"}, [])
            snap = sent(chart)[-1]
            assert snap["type"] == "snapshot" and snap["view"] == "v" and cid in snap["points"]
            fig = chart.figure()
            assert isinstance(fig, Figure)
            assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
                chart.data.tracks[cid].label
            ]
            assert chart.view.title == f"Backpressure of process {handle.pid}"
        finally:
            chart.close()
            handle.disconnect()
        assert chart.tasks == 0
        assert chart.widget.comm is None and chart.view.comm is None
        chart.close()  # idempotent


@pytest.mark.slow
@pytest.mark.timeout(30)
async def test_backpressure_ticker_polls_at_most_twice_a_second(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        info = await sbx.commands.start(COUNTER)
        handle = await sbx.commands.connect(info.pid)  # a consumer whose cursor moves
        threads = set(threading.enumerate())
        chart = BackpressureChart(sbx, info.pid, interval=0.05)  # asks for 20 Hz
        try:
            await poll(lambda: chart.sends >= 1, timeout=5, what="first sample")
            started, polls = time.monotonic(), chart.polls
            await poll(lambda: chart.polls >= polls + 3, timeout=10, what="polls")
            elapsed = time.monotonic() - started
            assert (chart.polls - polls) <= 2 * elapsed + 1.5, elapsed
            assert chart.sends <= chart.polls, "a message only for a poll that changed"
        finally:
            await chart.aclose()
            await handle.disconnect()
        assert chart.tasks == 0
        # The in-process daemon's worker threads come and go with its own work.
        left = {t for t in threading.enumerate() if not t.name.startswith(WORKER_THREADS)}
        assert left <= threads
        sends = chart.sends
        await asyncio.sleep(0.7)  # sleep-ok: observation window: a closed chart stays
        assert chart.sends == sends


@pytest.mark.timeout(30)
async def test_a_chart_given_a_panel_follows_its_kill_restart(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        old = (await sbx.commands.start(COUNTER)).pid
        panel = ProcessPanel(sbx, old)
        chart = BackpressureChart(sbx, panel)
        try:
            await poll(lambda: any(m["type"] == "sample" for m in sent(chart)), what="sample")
            await panel.on_kill_restart()  # type: ignore[misc]
            new = panel.pid
            await poll(lambda: chart.pid == new, timeout=5, what="the chart to follow")
            restarts = [m for m in sent(chart) if m["type"] == "restart"]
            assert restarts and restarts[0]["old"] == old and restarts[0]["pid"] == new
            await poll(lambda: chart.view.title.endswith(str(new)), timeout=5, what="title")

            def new_sample() -> bool:
                return any(
                    m["type"] == "sample" and m["t"] >= restarts[0]["t"] and m["lags"]
                    for m in sent(chart)
                )

            await poll(new_sample, timeout=5, what="a sample of the new process")
        finally:
            await chart.aclose()
            await panel.aclose()


# -- LifecycleTimeline -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_timeline_sends_on_new_events_only(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run(["cat"], background=True)
        timeline = LifecycleTimeline(sbx)
        try:
            assert timeline.refresh() is True
            kinds = [kind for _, kind, _ in timeline.markers]
            assert "process.started" in kinds
            sent_before = [0]

            def quiet() -> bool:
                # A refresh that finds nothing new sends nothing (a late event of the
                # start, on a loaded machine, only makes it try again).
                sent_before[0] = len(sent(timeline))
                return timeline.refresh() is False

            wait_until(quiet, timeout=5, what="quiet journal")
            assert len(sent(timeline)) == sent_before[0]
            sbx.pause()
            sbx.resume()
            assert timeline.refresh() is True
            message = sent(timeline)[-1]
            assert message["type"] == "events" and len(message["pauses"]) == 1
            spans = timeline.pause_spans
            assert len(spans) == 1 and spans[0][1] is not None and spans[0][2] == "user"
            assert isinstance(timeline.figure(), Figure)
        finally:
            timeline.close()
            handle.disconnect()
        assert timeline.tasks == 0 and timeline.widget.comm is None


def test_timeline_derives_spans_and_markers_and_keeps_the_newest_events() -> None:
    data = TimelineData(max_events=100)
    events = [
        {"seq": 0, "ts": 100.0, "kind": "sandbox.created", "pid": None, "data": {}},
        {"seq": 1, "ts": 101.0, "kind": "consumer.attached", "pid": 1, "data": {}},
        {"seq": 2, "ts": 102.0, "kind": "sandbox.paused", "pid": None, "reason": "timeout"},
        {"seq": 3, "ts": 104.0, "kind": "sandbox.resumed", "pid": None, "reason": "auto"},
        {"seq": 4, "ts": 110.0, "kind": "consumer.kicked", "pid": 1, "data": {"blocked_for": 5}},
        {"seq": 5, "ts": 111.0, "kind": "sandbox.paused", "pid": None, "reason": "user"},
    ]
    assert data.ingest(events[:3])
    assert data.pause_spans == [(102.0, None, "timeout")]
    assert data.ingest(events[:3]) == [], "already seen"
    assert len(data.ingest(events)) == 3
    assert data.pause_spans == [(102.0, 104.0, "timeout"), (111.0, None, "user")]
    assert data.stall_spans == [(105.0, 110.0, 1)]
    assert [k for _, k, _ in data.markers] == ["consumer.attached", "consumer.kicked"]
    message = data.message()
    assert message["pauses"] == [[2.0, 4.0], [11.0, None]] and message["stalls"] == [[5.0, 10.0]]
    more = [
        {"seq": 6 + i, "ts": 120.0 + i, "kind": "consumer.attached", "pid": 1} for i in range(500)
    ]
    data.ingest(more)
    assert len(data.events) == 100 and data.events[-1]["seq"] == 505


@pytest.mark.timeout(30)
async def test_timeline_ticker_picks_up_a_pause(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        timeline = LifecycleTimeline(sbx, interval=0.1)
        try:
            await poll(lambda: timeline.sends >= 1, timeout=5, what="first events")
            await sbx.pause()
            await sbx.resume()
            await poll(lambda: len(timeline.pause_spans) == 1, timeout=5, what="the span")
            task = timeline.refresh()  # inside a running loop: a task
            assert isinstance(task, asyncio.Task)
            assert await task is False
        finally:
            await timeline.aclose()
        assert timeline.tasks == 0
