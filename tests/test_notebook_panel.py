"""ProcessPanel and PanelState: the live tail, its buttons, the STALLED badge and the
flush throttle — driven without a browser, against the in-process daemon.

Sync tests (no running loop) use a sync ``Sandbox``: handlers block, the test flushes.
Async tests (a running loop, like a Jupyter kernel) use an ``AsyncSandbox`` or a sync
``Sandbox``: handlers return tasks and a ticker on the test loop flushes the widgets.
"""

from __future__ import annotations

import asyncio
import html
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import comm
import pytest
from conftest import wait_until

from sandboxkit import AsyncSandbox, Sandbox
from sandboxkit.notebook import PanelState, ProcessPanel
from sandboxkit.notebook.panel import render_status

# Numbered lines, a few hundred a second, until killed.
COUNTER = [
    sys.executable,
    "-u",
    "-c",
    "import time\nfor i in range(10**7):\n    print(i, flush=True)\n    time.sleep(0.002)\n",  # noqa: sleep-ok - a steady writer
]
# 2000 numbered lines paced at 1000 lines/s, one write each.
PACED = [
    sys.executable,
    "-u",
    "-c",
    "import time\n"
    "t0 = time.monotonic()\n"
    "for i in range(2000):\n"
    "    delay = t0 + i / 1000 - time.monotonic()\n"
    "    if delay > 0:\n"
    "        time.sleep(delay)\n"
    "    print(i, flush=True)\n",
]
# A "begin" line, then the counter: one "begin" per process run.
MARKED = [
    sys.executable,
    "-u",
    "-c",
    "import time\nprint('begin', flush=True)\n"
    "for i in range(10**7):\n    print(i, flush=True)\n    time.sleep(0.002)\n",  # noqa: sleep-ok - a steady writer
]
CAT = ["cat"]


# -- helpers -----------------------------------------------------------------------------


def numbered(lines: list[str]) -> list[str]:
    """The sequence a counter's lines must be when nothing was lost or duplicated."""
    return [str(i) for i in range(len(lines))]


async def apoll(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` on the running loop until it is true (a poll, not a sync)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.01)  # noqa: sleep-ok - poll interval


async def more_lines(panel: ProcessPanel, n: int) -> None:
    """Poll until the panel received ``n`` more lines."""
    target = panel.line_count + n
    await apoll(lambda: panel.line_count >= target, what=f"{n} more lines")


def start_sync(sbx: Sandbox, argv: list[str]) -> int:
    """Start a process without following it; its pid."""
    handle = sbx.commands.run(argv, background=True)
    handle.disconnect()
    return int(handle.pid)


async def start_async(sbx: AsyncSandbox, argv: list[str]) -> int:
    """Start a process without following it; its pid."""
    return (await sbx.commands.start(argv)).pid


async def start_any(sbx: Sandbox | AsyncSandbox, argv: list[str]) -> int:
    if isinstance(sbx, Sandbox):
        return start_sync(sbx, argv)
    return await start_async(sbx, argv)


async def kill_any(sbx: Sandbox | AsyncSandbox) -> None:
    if isinstance(sbx, Sandbox):
        sbx.kill()
    else:
        await sbx.kill()


def assert_fresh_run(lines: list[str]) -> None:
    """Lines of one run of MARKED, from its start: "begin", 0, 1, 2..."""
    assert lines[0] == "begin" and lines.count("begin") == 1, lines[:5]
    assert lines[1:] == numbered(lines[1:])


def tail_lines(panel: ProcessPanel) -> list[str]:
    """The lines the tail widget shows (its value is one ``<pre>``)."""
    body = panel.tail.value.split("<pre", 1)[1].split(">", 1)[1].rsplit("</pre>", 1)[0]
    return [html.unescape(re.sub("<[^>]+>", "", line)) for line in body.split("\n")]


def status_lines(panel: ProcessPanel) -> int:
    """The ``lines <n>`` figure of the status widget."""
    match = re.search(r"lines (\d+)", panel.status.value)
    assert match, panel.status.value
    return int(match.group(1))


def open_panel_consumers(sbx: Sandbox, pid: int) -> int:
    frame = sbx.consumers()
    rows = frame[(frame["pid"] == pid) & frame["closed_at"].isna()]
    return len(rows)


class RecordingComm:
    """A comm that records what a widget sends (as ipywidgets' own tests do)."""

    kernel = "recording"

    def __init__(self, **kwargs: Any) -> None:
        self.comm_id = uuid.uuid4().hex
        self.messages: list[dict[str, Any]] = []

    def open(self, *args: Any, **kwargs: Any) -> None:
        pass

    def on_msg(self, *args: Any, **kwargs: Any) -> None:
        pass

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        self.messages.append(data)

    def close(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.fixture
def recording_comms(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RecordingComm]]:
    """Every widget created in the test gets a RecordingComm (ipywidgets 8 creates comms
    through ``comm.create_comm``)."""
    created: list[RecordingComm] = []

    def create_comm(**kwargs: Any) -> RecordingComm:
        new = RecordingComm(**kwargs)
        created.append(new)
        return new

    monkeypatch.setattr(comm, "create_comm", create_comm)
    yield created


def value_updates(widget: Any) -> int:
    """How many ``value`` updates a widget sent to the frontend."""
    return sum(
        1
        for m in widget.comm.messages
        if isinstance(m, dict) and m.get("method") == "update" and "value" in m.get("state", {})
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- PanelState (plain Python) ---------------------------------------------------------


def test_state_joins_lines_across_chunks_per_stream() -> None:
    state = PanelState(7, max_lines=100)
    state.feed_stdout("al")
    state.feed_stderr("warn")
    state.feed_stdout("pha\nbe")
    state.feed_stderr("ing\r\n")
    state.feed_stdout("ta\ngam")
    assert state.lines == ["alpha", "warning", "beta"]
    assert state.line_count == 3
    snap = state.snapshot()
    assert [s for s, _ in snap.entries] == ["stdout", "stderr", "stdout"]
    assert snap.partial == (("stdout", "gam"),)
    assert snap.text.endswith("beta\ngam")
    assert state.bytes_received == len("alwarnpha\nbeing\r\nta\ngam")


def test_state_keeps_only_the_newest_lines() -> None:
    state = PanelState(1, max_lines=3)
    state.feed_stdout("".join(f"{i}\n" for i in range(10)))
    assert state.lines == ["7", "8", "9"]
    assert state.line_count == 10


def test_state_version_bumps_on_change_only() -> None:
    state = PanelState(1)
    v0, lv0 = state.version, state.lines_version
    state.feed_stdout("x\n", cursor=1)
    assert state.version > v0 and state.lines_version > lv0
    state.update_process(state="running", head=1)
    v1, lv1 = state.version, state.lines_version
    assert lv1 == lv0 + 1
    state.update_process(state="running", head=1)  # nothing new
    assert state.version == v1
    state.update_process(head=0)  # the head never goes back
    assert state.head == 1 and state.version == v1
    state.feed_stdout("y\n", cursor=4)  # received beyond the polled head: head follows
    assert state.head == 4 and state.cursor == 4
    state.reset(2)
    assert state.pid == 2 and state.lines == [] and state.line_count == 0
    assert state.lines_version > lv1


def test_state_rate_counts_recent_bytes() -> None:
    clock = FakeClock()
    state = PanelState(1, clock=clock)
    state.feed_stdout("a" * 1000)
    clock.now += 0.5
    state.feed_stdout("b" * 1000)
    assert state.rate() == pytest.approx(2000 / 2.0)
    clock.now += 1.9  # the first chunk left the 2 s window
    assert state.rate() == pytest.approx(1000 / 2.0)
    clock.now += 5
    assert state.rate() == 0


def test_stalled_needs_alive_attached_pending_and_silence() -> None:
    clock = FakeClock()
    state = PanelState(1, stall_after=1.0, clock=clock)
    state.set_attached(True, cursor=0)
    state.update_process(state="paused", sandbox_state="paused")
    state.feed_stdout("0\n1\n", cursor=2)
    clock.now += 5
    assert not state.stalled(), "nothing pending: the daemon's head is at our cursor"
    state.update_process(head=5)
    assert state.stalled()
    snap = state.snapshot()
    assert snap.stalled and "STALLED" in snap.status
    # Fresh output clears it, until stall_after seconds of silence again.
    state.feed_stdout("2\n", cursor=3)
    assert not state.stalled()
    clock.now += 0.99
    assert not state.stalled()
    clock.now += 0.02
    assert state.stalled()
    # Not stalled once everything pending arrived, when detached, or once exited.
    state.feed_stdout("3\n4\n", cursor=5)
    clock.now += 2
    assert not state.stalled()
    state.update_process(head=9)
    assert state.stalled()
    state.set_attached(False)
    assert not state.stalled()
    state.set_attached(True)  # silence counts from the reattach
    assert not state.stalled()
    clock.now += 1.5
    assert state.stalled()
    state.update_process(state="exited", exit_code=0)
    assert not state.stalled()


def test_status_renders_pid_lines_and_badge() -> None:
    clock = FakeClock()
    state = PanelState(42, stall_after=1.0, clock=clock)
    state.set_attached(True, cursor=0)
    state.update_process(state="running", head=10)
    state.feed_stdout("a\nb\nc\n", cursor=3)
    html = render_status(state.snapshot())
    assert "pid 42" in html and "lines 3" in html and "cursor 3" in html
    assert "STALLED" not in html
    clock.now += 2
    html = render_status(state.snapshot())
    assert '<span class="sandboxkit-stalled"' in html and "STALLED" in html


# -- ProcessPanel with a sync Sandbox, no running loop -----------------------------------


@pytest.mark.timeout(30)
def test_sync_panel_tails_newest_lines(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        pid = start_sync(sbx, COUNTER)
        panel = ProcessPanel(sbx, pid, max_lines=50)
        try:
            assert panel.pid == pid
            wait_until(lambda: panel.line_count >= 200, timeout=10, what="200 lines")
            panel.flush()
            shown = tail_lines(panel)
            lines = panel.lines
            assert len(lines) == 50, "only max_lines are retained"
            assert lines == [str(i) for i in range(int(lines[0]), int(lines[0]) + 50)]
            # The tail shows the ring buffer as it was at the flush: the newest 50 lines.
            newest = int(shown[-1])
            assert shown == [str(i) for i in range(newest - 49, newest + 1)]
            assert newest >= 199 and int(lines[-1]) >= newest
            status = panel.status.value
            assert f"pid {pid}" in status
            assert status_lines(panel) >= 200
            count = panel.line_count
            wait_until(lambda: panel.line_count > count + 50, timeout=10, what="growth")
            panel.flush()
            assert status_lines(panel) > count + 50
            assert int(tail_lines(panel)[-1]) > newest + 50
        finally:
            panel.close()


@pytest.mark.timeout(30)
def test_sync_reattach_keeps_the_sequence_contiguous(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        pid = start_sync(sbx, COUNTER)
        panel = ProcessPanel(sbx, pid, max_lines=100_000)
        try:
            for round_ in range(5):
                target = panel.line_count + 40
                wait_until(lambda t=target: panel.line_count >= t, timeout=10, what="lines")
                assert panel.on_reattach() is None  # no running loop: it blocked until done
                assert panel.state.attached and panel.state.error is None, round_
            target = panel.line_count + 40
            wait_until(lambda: panel.line_count >= target, timeout=10, what="lines after")
            lines = panel.lines
            assert lines == numbered(lines), "a reattach lost or duplicated lines"
            assert panel.state.cursor is not None and panel.state.cursor > 0
        finally:
            panel.close()


@pytest.mark.timeout(30)
def test_sync_kill_restart_follows_the_new_pid(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        old = start_sync(sbx, MARKED)
        panel = ProcessPanel(sbx, old, max_lines=100_000)
        try:
            wait_until(lambda: panel.line_count >= 300, timeout=10, what="old output")
            assert panel.on_kill_restart() is None
            new = panel.pid
            assert new != old
            assert sbx.commands.get(old).state == "exited"
            assert sbx.commands.get(new).restarted_from == old
            # Once 20 chunks of the new process arrived, only its output is shown.
            wait_until(lambda: (panel.state.cursor or 0) >= 20, timeout=10, what="new output")
            assert_fresh_run(panel.lines)
            panel.flush()
            assert f"pid {new}" in panel.status.value
        finally:
            panel.close()


@pytest.mark.timeout(30)
def test_sync_pause_resume_toggles_sandbox_and_label(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        pid = start_sync(sbx, COUNTER)
        panel = ProcessPanel(sbx, pid)
        try:
            wait_until(lambda: panel.line_count >= 10, timeout=10, what="output")
            assert panel.pause_button.description == "Pause"
            panel.on_pause_resume()
            assert sbx.get_info().state == "paused"
            assert panel.pause_button.description == "Resume"
            panel.on_pause_resume()
            assert sbx.get_info().state == "running"
            assert panel.pause_button.description == "Pause"
            count = panel.line_count
            wait_until(lambda: panel.line_count > count + 10, timeout=10, what="resumed output")
        finally:
            panel.close()


@pytest.mark.timeout(30)
def test_sync_detach_stops_updates(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        pid = start_sync(sbx, COUNTER)
        panel = ProcessPanel(sbx, pid, max_lines=100_000)
        try:
            wait_until(lambda: panel.line_count >= 10, timeout=10, what="output")
            panel.on_detach()
            assert not panel.state.attached
            # The daemon sees the closed connection shortly after.
            wait_until(lambda: open_panel_consumers(sbx, pid) == 0, timeout=5, what="closed")
            count, head = panel.line_count, sbx.commands.get(pid).head
            time.sleep(0.3)  # noqa: sleep-ok - observation window: nothing may arrive
            assert panel.line_count == count
            assert sbx.commands.get(pid).head > head, "the process kept writing meanwhile"
            panel.flush()
            assert "detached" in panel.status.value
            panel.on_reattach()  # from the cursor: the missed lines arrive, in order
            wait_until(lambda: panel.line_count > count + 100, timeout=10, what="catch-up")
            assert panel.lines == numbered(panel.lines)
        finally:
            panel.close()


@pytest.mark.timeout(30)
def test_sync_send_stdin_reaches_cat(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        pid = start_sync(sbx, CAT)
        panel = ProcessPanel(sbx, pid)
        try:
            panel.on_send_stdin("hello panel")
            wait_until(lambda: "hello panel" in panel.lines, timeout=10, what="echo")
            panel.stdin_box.value = "from the box"
            panel.on_send_stdin()
            assert panel.stdin_box.value == ""
            wait_until(lambda: "from the box" in panel.lines, timeout=10, what="box echo")
            assert panel.lines == ["hello panel", "from the box"]
            panel.flush()
            assert "from the box" in panel.tail.value
        finally:
            panel.close()


@pytest.mark.timeout(30)
def test_sync_panel_shows_stderr_and_exit(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        pid = start_sync(sbx, ["sh", "-c", "echo out; echo 'e<r>r' >&2; printf tail; exit 3"])
        panel = ProcessPanel(sbx, pid)
        try:
            wait_until(lambda: panel.state.exit_code == 3, timeout=10, what="the exit")
            assert panel.lines == ["out", "e<r>r"] and panel.line_count == 2
            panel.flush()
            assert tail_lines(panel) == ["out", "e<r>r", "tail"]  # the unterminated tail too
            assert '<span style="color:#c0392b">e&lt;r&gt;r</span>' in panel.tail.value
            assert "exited" in panel.status.value and "exit 3" in panel.status.value
            assert not panel.state.stalled()
        finally:
            panel.close()


@pytest.mark.timeout(30)
def test_sync_close_releases_tasks_streams_and_widgets(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        pid = start_sync(sbx, COUNTER)
        threads = set(threading.enumerate())
        panel = ProcessPanel(sbx, pid)
        wait_until(lambda: panel.line_count >= 10, timeout=10, what="output")
        wait_until(lambda: open_panel_consumers(sbx, pid) == 1, timeout=5, what="consumer")
        assert panel.tasks >= 2  # the poll and the stream watcher
        panel.close()
        panel.close()  # idempotent
        assert panel.tasks == 0
        wait_until(lambda: open_panel_consumers(sbx, pid) == 0, timeout=5, what="closed")
        assert panel.widget.comm is None and panel.tail.comm is None
        assert set(threading.enumerate()) <= threads, "close left a thread behind"
        count = panel.line_count
        time.sleep(0.2)  # noqa: sleep-ok - observation window: a closed panel stays still
        assert panel.line_count == count
        with pytest.raises(RuntimeError):
            panel.on_reattach()


# -- ProcessPanel inside a running loop (like a Jupyter kernel) ---------------------------


@pytest.mark.timeout(30)
async def test_async_panel_follows_reattaches_and_flushes_itself(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        pid = await start_async(sbx, COUNTER)
        panel = ProcessPanel(sbx, pid, max_lines=100_000)
        try:
            await apoll(lambda: panel.line_count >= 50, what="lines")
            # The ticker flushes on the loop: no explicit flush() here.
            await apoll(lambda: panel.flushes > 0 and status_lines(panel) >= 50, what="flush")
            await apoll(lambda: "\n49\n" in panel.tail.value, what="tail value")
            for _ in range(3):
                await more_lines(panel, 30)
                task = panel.on_reattach()
                assert isinstance(task, asyncio.Task)
                await task
                assert panel.state.attached and panel.state.error is None

            async def attaches() -> int:
                events = await sbx.raw_events()
                return sum(e["kind"] == "consumer.attached" and e["pid"] == pid for e in events)

            # A click handled off the kernel loop's thread hops onto the loop.
            before = await attaches()
            assert await asyncio.to_thread(panel.on_reattach) is None
            deadline = time.monotonic() + 10
            while await attaches() <= before:
                assert time.monotonic() < deadline, "the reattach did not happen"
                await asyncio.sleep(0.01)  # noqa: sleep-ok - poll interval
            target = panel.line_count + 30
            await apoll(lambda: panel.line_count >= target, what="lines after")
            assert panel.lines == numbered(panel.lines)
            assert panel.state.error is None
        finally:
            await panel.aclose()
        assert panel.tasks == 0


@pytest.mark.timeout(30)
async def test_async_kill_restart_pause_resume_detach(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        old = await start_async(sbx, MARKED)
        panel = ProcessPanel(sbx, old, max_lines=100_000)
        try:
            await apoll(lambda: panel.line_count >= 200, what="old output")
            await panel.on_kill_restart()  # type: ignore[misc]
            assert panel.pid != old
            assert (await sbx.commands.get(old)).state == "exited"
            await apoll(lambda: (panel.state.cursor or 0) >= 20, what="new output")
            assert_fresh_run(panel.lines)

            await panel.on_pause_resume()  # type: ignore[misc]
            assert (await sbx.get_info()).state == "paused"
            assert panel.pause_button.description == "Resume"
            await panel.on_pause_resume()  # type: ignore[misc]
            assert (await sbx.get_info()).state == "running"
            assert panel.pause_button.description == "Pause"

            await panel.on_detach()  # type: ignore[misc]
            count = panel.line_count
            head = (await sbx.commands.get(panel.pid)).head
            await asyncio.sleep(0.3)  # noqa: sleep-ok - observation window
            assert panel.line_count == count
            assert (await sbx.commands.get(panel.pid)).head > head
        finally:
            await panel.aclose()
        assert panel.tasks == 0


@pytest.mark.timeout(30)
async def test_async_send_stdin_and_close(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        pid = await start_async(sbx, CAT)
        panel = ProcessPanel(sbx, pid)
        await panel.on_send_stdin("ping")  # type: ignore[misc]
        await apoll(lambda: "ping" in panel.lines, what="echo")
        await apoll(lambda: "ping" in panel.tail.value, what="flushed echo")
        panel.close()  # sync close on a running loop: the teardown finishes on the loop
        await panel.aclose()
        assert panel.tasks == 0

        async def open_consumers() -> int:
            frame = await sbx.consumers()
            return len(frame[(frame["pid"] == pid) & frame["closed_at"].isna()])

        deadline = time.monotonic() + 5
        while await open_consumers():  # the daemon sees the closed connection shortly
            assert time.monotonic() < deadline, "the panel's stream was not closed"
            await asyncio.sleep(0.01)  # noqa: sleep-ok - poll interval


@pytest.mark.timeout(30)
async def test_stalled_badge_for_paused_process_with_pending_output(
    conn: dict[str, Any],
) -> None:
    sbx = Sandbox.create(**conn)  # a sync Sandbox used from a running loop
    try:
        pid = start_sync(sbx, COUNTER)
        panel = ProcessPanel(sbx, pid, stall_after=0.3)
        try:
            await apoll(lambda: panel.line_count >= 20, what="output")
            await panel.on_pause_resume()  # type: ignore[misc]
            # Paused: nothing new arrives, and with nothing pending there is no badge.
            await apoll(lambda: panel.state.process_state == "paused", what="paused state")
            count = panel.line_count
            await asyncio.sleep(0.5)  # noqa: sleep-ok - observation window > stall_after
            assert panel.line_count == count
            assert not panel.state.stalled()
            assert "STALLED" not in panel.status.value
            # The daemon has output we do not get (as with a wedged stream).
            cursor = panel.state.cursor
            assert cursor is not None
            panel.state.update_process(head=cursor + 5)
            await apoll(lambda: "STALLED" in panel.status.value, timeout=5, what="badge")
            await panel.on_pause_resume()  # type: ignore[misc]
            await apoll(lambda: "STALLED" not in panel.status.value, timeout=5, what="clear")
            assert panel.line_count > count
        finally:
            await panel.aclose()
    finally:
        sbx.kill()


@pytest.mark.timeout(40)
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_flush_throttle_at_1000_lines_per_second(
    conn: dict[str, Any], recording_comms: list[RecordingComm], kind: str
) -> None:
    sbx: Sandbox | AsyncSandbox = (
        Sandbox.create(**conn) if kind == "sync" else await AsyncSandbox.create(**conn)
    )
    try:
        pid = await start_any(sbx, PACED)
        started = time.monotonic()
        panel = ProcessPanel(sbx, pid, max_lines=100, flush_hz=10.0)
        try:
            assert isinstance(panel.tail.comm, RecordingComm)
            await apoll(lambda: panel.line_count >= 2000, timeout=20, what="all lines")
            await apoll(lambda: "\n1999<" in panel.tail.value, timeout=5, what="final value")
            elapsed = time.monotonic() - started
            updates = value_updates(panel.tail)
            assert panel.state.lines_version >= 500, "the state changed per chunk"
            assert updates <= 12 * elapsed + 2, f"{updates} value updates in {elapsed:.2f}s"
            assert updates >= 5, "the ticker flushed while the process ran"
            assert panel.lines[-1] == "1999" and panel.lines == [str(i) for i in range(1900, 2000)]
            # Nothing changes any more: no further value updates.
            await asyncio.sleep(0.3)  # noqa: sleep-ok - observation window
            assert value_updates(panel.tail) == updates
        finally:
            await panel.aclose()
        assert panel.tasks == 0
    finally:
        await kill_any(sbx)
