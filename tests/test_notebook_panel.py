"""ProcessPanel, PanelState and DeltaPump: the terminal's byte deltas, the rate cap, the
status line, the buttons, the STALLED badge and the throttle — driven without a browser
(what the browser would receive is read from recording comms), against the in-process
daemon.

Sync tests (no running loop) use a sync ``Sandbox``: handlers block, the test flushes.
Async tests (a running loop, like a Jupyter kernel) use an ``AsyncSandbox`` or a sync
``Sandbox``: handlers return tasks and a ticker on the test loop flushes the widgets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import comm
import pytest
from support import fast_config, poll, wait_until

from sandboxkit import AsyncSandbox, Sandbox
from sandboxkit.daemon.server import WORKER_THREADS
from sandboxkit.notebook import PanelState, ProcessPanel
from sandboxkit.notebook.panel import DeltaPump
from sandboxkit.notebook.panel_state import count_newlines

# Numbered lines, a few hundred a second, until killed.
COUNTER = [
    sys.executable,
    "-u",
    "-c",
    "import time\nfor i in range(10**7):\n    print(i, flush=True)\n    "
    "time.sleep(0.002)\n",  # sleep-ok: the child process's pace
]
# 2000 numbered lines paced at 1000 lines/s, one write each.
PACED = [
    sys.executable,
    "-u",
    "-c",
    "import sys, time\n"
    "t0 = time.monotonic()\n"
    "for i in range(2000):\n"
    "    delay = t0 + i / 1000 - time.monotonic()\n"
    "    if delay > 0:\n"
    "        time.sleep(delay)\n"
    "    sys.stdout.write(f'{i}\\n')\n",
]
# The counter, its first 2000 lines at once: a long output without waiting for it. Each
# line is one write (under -u, print writes the number and its newline separately), so
# every chunk the daemon reads ends a line.
BURST_THEN_COUNTER = [
    sys.executable,
    "-u",
    "-c",
    "import sys, time\nfor i in range(10**7):\n    sys.stdout.write(f'{i}\\n')\n    "
    "time.sleep(0.002 if i >= 2000 else 0)\n",  # sleep-ok: the child process's pace
]
# A "begin" line, then the counter: one "begin" per process run.
MARKED = [
    sys.executable,
    "-u",
    "-c",
    "import time\nprint('begin', flush=True)\n"
    "for i in range(10**7):\n    print(i, flush=True)\n    "
    "time.sleep(0.002)\n",  # sleep-ok: the child process's pace
]
CAT = ["cat"]


# -- helpers -----------------------------------------------------------------------------


def numbered(lines: list[str]) -> list[str]:
    """The sequence a counter's lines must be when nothing was lost or duplicated."""
    return [str(i) for i in range(len(lines))]


async def more_lines(panel: ProcessPanel, n: int) -> None:
    """Poll until the panel received ``n`` more lines."""
    target = panel.line_count + n
    await poll(lambda: panel.line_count >= target, what=f"{n} more lines")


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


OpenPanel = Callable[..., tuple[Sandbox, int, ProcessPanel]]


@pytest.fixture
def open_panel(conn: dict[str, Any]) -> Iterator[OpenPanel]:
    """The sync tests' setup: ``open_panel(argv, **panel_options)`` creates a sync Sandbox,
    starts ``argv`` in it without following it, and opens a ProcessPanel on the process;
    returns (sandbox, pid, panel). At teardown the panel closes (close is idempotent: a
    test may close it first), then the sandbox."""
    with contextlib.ExitStack() as stack:

        def open_(argv: list[str], **options: Any) -> tuple[Sandbox, int, ProcessPanel]:
            sbx = stack.enter_context(Sandbox.create(**conn))
            pid = start_sync(sbx, argv)
            panel = ProcessPanel(sbx, pid, **options)
            stack.callback(panel.close)
            return sbx, pid, panel

        yield open_


def assert_fresh_run(lines: list[str]) -> None:
    """Lines of one run of MARKED, from its start: "begin", 0, 1, 2..."""
    assert lines[0] == "begin" and lines.count("begin") == 1, lines[:5]
    assert lines[1:] == numbered(lines[1:])


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class RecordingComm:
    """A comm that records what a widget sends, with its buffers."""

    kernel = "recording"

    def __init__(self, **kwargs: Any) -> None:
        self.comm_id = uuid.uuid4().hex
        self.messages: list[tuple[Any, list[bytes]]] = []

    def open(self, *args: Any, **kwargs: Any) -> None:
        pass

    def on_msg(self, *args: Any, **kwargs: Any) -> None:
        pass

    def send(self, data: Any = None, metadata: Any = None, buffers: Any = None) -> None:
        self.messages.append((data, [bytes(b) for b in buffers or []]))

    def close(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.fixture(autouse=True)
def recording_comms(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RecordingComm]]:
    """Every widget created in a test gets a RecordingComm (ipywidgets 8 creates comms
    through ``comm.create_comm``)."""
    created: list[RecordingComm] = []

    def create_comm(**kwargs: Any) -> RecordingComm:
        new = RecordingComm(**kwargs)
        created.append(new)
        return new

    monkeypatch.setattr(comm, "create_comm", create_comm)
    yield created


def custom(panel: ProcessPanel) -> list[tuple[dict[str, Any], list[bytes]]]:
    """The custom messages the panel's terminal sent to the browser, in order."""
    recorded = panel.terminal.comm.messages
    return [
        (data["content"], buffers)
        for data, buffers in recorded
        if isinstance(data, dict) and data.get("method") == "custom"
    ]


def screen(panel: ProcessPanel) -> str:
    """The text a browser view rendered from the start would hold: every delta, joined
    (ANSI stripped, ``\\r`` rewrites applied per line)."""
    data = b"".join(b"".join(bufs) for msg, bufs in custom(panel) if msg["type"] == "delta")
    text = _ANSI.sub("", data.decode("utf-8", "replace"))
    return "\n".join(
        line.rsplit("\r", 1)[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
        for line in text.split("\n")
    )


def screen_lines(panel: ProcessPanel) -> list[str]:
    return [line for line in screen(panel).split("\n")[:-1]]


def last_status(panel: ProcessPanel) -> str:
    """The status line the browser shows now (the newest one sent)."""
    for msg, _ in reversed(custom(panel)):
        if "status" in msg:
            return str(msg["status"]["text"]) + (" · STALLED" if msg["status"]["stalled"] else "")
    return ""


def status_lines(panel: ProcessPanel) -> int:
    match = re.search(r"lines (\d+)", last_status(panel))
    assert match, last_status(panel)
    return int(match.group(1))


def open_panel_consumers(sbx: Sandbox, pid: int) -> int:
    frame = sbx.consumers()
    rows = frame[(frame["pid"] == pid) & frame["closed_at"].isna()]
    return len(rows)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- PanelState and DeltaPump (plain Python) ------------------------------------------------


def test_state_counts_lines_across_chunks_and_marks_stderr() -> None:
    state = PanelState(7)
    state.feed_stdout("al")
    state.feed_stdout("pha\nbe")
    state.feed_stderr("warn\r\n")
    state.feed_stdout("ta\ngam")
    assert state.lines == ["alpha", "bewarn", "ta"]  # one terminal: streams interleave
    assert state.line_count == 3
    sent = state.take_output()
    assert sent == b"alpha\nbe\x1b[31mwarn\r\n\x1b[0mta\ngam"
    assert state.take_output() == b"", "each byte is sent once"
    assert state.bytes_received == len("alpha\nbewarn\r\nta\ngam")


def test_state_takes_raw_bytes_and_never_cuts_a_character_with_the_other_stream() -> None:
    """The panel reads its stream as bytes (the client decodes nothing): a character
    split between two chunks is held back until finished, so stderr's colour (or the
    other stream's bytes) never lands inside it; lines count across big chunks."""
    state = PanelState(7)
    euro = "€".encode()  # three bytes
    state.feed_stdout_bytes(b"price " + euro[:1])
    state.feed_stderr_bytes(b"oops\n")
    state.feed_stdout_bytes(euro[1:] + b"\n")
    sent = state.take_output()
    assert sent == b"price \x1b[31moops\n\x1b[0m" + euro + b"\n"
    assert state.bytes_received == len(b"price oops\n") + len(euro) + 1
    big = b"".join(b"%06d\n" % i for i in range(100_000))  # past the numpy threshold
    state.feed_stdout_bytes(big)
    assert state.line_count == 2 + 100_000
    assert count_newlines(big) == big.count(b"\n") == 100_000
    assert state.lines[-1] == "099999"


def test_state_tail_is_bounded_in_bytes_and_starts_at_a_line() -> None:
    state = PanelState(1, tail_bytes=1024)
    state.feed_stdout("".join(f"line {i:04d}\n" for i in range(1000)))  # 10 kB
    tail = state.tail()
    assert len(tail) <= 1024
    assert tail.startswith(b"line ") and tail.endswith(b"line 0999\n")
    assert state.lines[-1] == "line 0999" and state.line_count == 1000
    # A single 100 kB line (no newline) is bounded too.
    state.feed_stdout("x" * 100_000)
    assert len(state.tail()) <= 1024


def test_rate_cap_drops_the_oldest_pending_bytes_with_a_visible_marker() -> None:
    """The marker speaks the status line's units: bytes, and cursors (chunk numbers, as
    in "cursor 601"), not byte offsets dressed as cursors."""
    state = PanelState(1, max_pending=1024)
    for i in range(1000):  # one 10-byte line per chunk: chunk i leaves the cursor at i + 1
        state.feed_stdout(f"line {i:04d}\n", cursor=i + 1)
    sent = state.take_output().decode()
    assert len(sent) <= 1024 + 100, "at most one flush's worth, plus the marker"
    marker, rest = sent.split("\n", 1)[1], sent.split("\n", 2)[2]
    match = re.search(r"… (\d+) bytes skipped \(cursor (\d+)–(\d+)\)", marker)
    assert match, sent[:200]
    skipped, a, b = map(int, match.groups())
    assert rest.startswith("line ") and rest.endswith("line 0999\n"), "the newest output"
    assert skipped + len(rest) == 10_000, "every byte is either shown or counted"
    assert skipped % 10 == 0, "whole lines: the kept output starts at a line"
    assert (a, b) == (0, skipped // 10), "chunks 0 .. b-1 were skipped; b is shown next"
    assert state.snapshot().skipped == skipped
    assert state.snapshot().cursor == 1000
    # Below the cap nothing is skipped.
    state.feed_stdout("calm\n")
    assert state.take_output() == b"calm\n"


def test_pump_sends_status_only_when_a_person_would_read_something_new() -> None:
    clock = FakeClock()
    state = PanelState(5, clock=clock)
    pump = DeltaPump(state, status_period=0.5)
    first = pump.next()
    assert first is not None and first[0]["status"]["text"].startswith("pid 5 · connecting")
    assert pump.next() is None, "nothing changed: nothing sent"
    state.set_attached(True, cursor=0)
    state.update_process(state="running")
    msg = pump.next()
    assert msg is not None and "running" in msg[0]["status"]["text"]
    # Output flows: bytes every flush, the counters at most every 0.5 s.
    statuses = 0
    for i in range(20):
        clock.now += 0.1
        state.feed_stdout(f"{i}\n", cursor=i + 1)
        message = pump.next()
        assert message is not None and message[1] == [f"{i}\n".encode()]
        statuses += "status" in message[0]
    assert 3 <= statuses <= 5, statuses
    # A state change goes out at once.
    clock.now += 0.01
    state.update_process(sandbox_state="paused")
    message = pump.next()
    assert message is not None and "· paused ·" in message[0]["status"]["text"]
    # Idle: the rate decays to 0 (one more status), then silence.
    clock.now += 3
    pump.next()
    clock.now += 3
    assert pump.next() is None


def test_a_panel_sends_at_most_ten_messages_a_second_under_a_flood() -> None:
    """Issue 22: eight panels on one kernel. Over simulated seconds of a 10 MB/s flood
    with the status changing all the time, flushes asked for every millisecond (the
    ticker, action callbacks, anything) and the Pause label changing twice a second,
    every comm message the panel sends — deltas and label updates alike — fits in 10 a
    second, and no output waits more than a flush interval (0.1 s) to go out."""
    clock = FakeClock()
    state = PanelState(3, clock=clock, max_pending=25_600)
    pump = DeltaPump(state, min_interval=0.1)
    start = clock.now
    sent: list[float] = []  # when each comm message went out
    waited = 0.0
    oldest: float | None = None  # when the oldest byte not yet sent arrived
    for ms in range(3000):
        clock.now = start + ms / 1000
        state.feed_bytes("stdout", b"x" * 9_999 + b"\n", cursor=ms + 1)
        oldest = clock.now if oldest is None else oldest
        state.update_process(state="running", head=ms + 100 * (ms % 7))
        if ms % 500 == 0 and pump.ready():  # the Pause button's label: its own message
            pump.spend()
            sent.append(clock.now)
        message = pump.next()
        if message is not None:
            sent.append(clock.now)
            if message[1]:
                waited, oldest = max(waited, clock.now - oldest), None
    for t in sent:
        assert sum(1 for u in sent if t <= u < t + 1.0) <= 10, "more than 10 in a second"
    assert len(sent) >= 29, "the pump starves the browser"
    assert waited <= 0.1 + 1e-9, f"output waited {waited:.3f} s"
    # A view that renders gets the deltas before its snapshot, budget or not.
    state.feed_bytes("stdout", b"late\n")
    assert pump.next() is None and pump.next(force=True) is not None


def test_a_poll_from_before_an_action_is_not_applied_after_it() -> None:
    state = PanelState(1)
    epoch = state.epoch
    state.begin_action()  # e.g. Kill-restart began while the poll awaited the daemon
    state.reset(2)
    assert not state.update_process(head=428, epoch=epoch)
    assert state.head is None
    assert not state.update_process(head=428, pid=1), "a poll of the old pid"
    assert state.update_process(head=3, epoch=state.epoch, pid=2) and state.head == 3


def test_state_version_bumps_on_change_only() -> None:
    state = PanelState(1)
    v0 = state.version
    state.feed_stdout("x\n", cursor=1)
    assert state.version > v0
    state.update_process(state="running", head=1)
    v1 = state.version
    state.update_process(state="running", head=1)  # nothing new
    assert state.version == v1
    state.update_process(head=0)  # the head never goes back
    assert state.head == 1 and state.version == v1
    state.feed_stdout("y\n", cursor=4)  # received beyond the polled head: head follows
    assert state.head == 4 and state.cursor == 4
    state.reset(2)
    assert state.pid == 2 and state.lines == [] and state.line_count == 0
    assert state.generation == 1


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
    state.feed_stdout("2\n", cursor=3)
    assert not state.stalled()
    clock.now += 0.99
    assert not state.stalled()
    clock.now += 0.02
    assert state.stalled()
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


# -- ProcessPanel with a sync Sandbox, no running loop -----------------------------------


@pytest.mark.timeout(30)
def test_sync_panel_sends_each_byte_once_in_order(open_panel: OpenPanel) -> None:
    _sbx, pid, panel = open_panel(COUNTER)
    assert panel.pid == pid
    for _ in range(5):
        target = panel.line_count + 40
        wait_until(lambda t=target: panel.line_count >= t, timeout=10, what="lines")
        assert panel.flush()
    shown = screen_lines(panel)
    assert len(shown) >= 200 and shown == numbered(shown), "lost or duplicated bytes"
    assert f"pid {pid}" in last_status(panel)
    time.sleep(0.6)  # sleep-ok: counters ride along at most every 0.5 s
    count = panel.line_count
    panel.flush()
    assert status_lines(panel) >= count >= 200
    sent = sum(len(b) for _, bufs in custom(panel) for b in bufs)
    assert sent == panel.state.bytes_received == panel.bytes_sent


@pytest.mark.timeout(30)
def test_a_view_that_renders_gets_a_snapshot_then_deltas(open_panel: OpenPanel) -> None:
    _sbx, _pid, panel = open_panel(BURST_THEN_COUNTER, tail_bytes=4096)
    wait_until(lambda: panel.line_count >= 2000, timeout=15, what="lines")
    panel._on_frontend_message(panel.terminal, {"type": "hello", "view": "v1"}, [])
    snapshot = [(m, b) for m, b in custom(panel) if m["type"] == "snapshot"]
    assert len(snapshot) == 1 and snapshot[0][0]["view"] == "v1"
    tail = snapshot[0][1][0].decode()
    assert len(tail) <= 4096 and tail.endswith("\n")
    first_shown = int(tail.split("\n", 1)[0])
    assert first_shown > 1000, "the tail is the newest output, bounded"
    count = panel.line_count
    wait_until(lambda: panel.line_count > count + 20, timeout=10, what="more")
    panel.flush()
    later = custom(panel)[-1]
    assert later[0]["type"] == "delta"
    assert int(later[1][0].decode().split("\n", 1)[0]) == int(tail.split("\n")[-2]) + 1


@pytest.mark.timeout(30)
def test_sync_reattach_keeps_the_sequence_contiguous(open_panel: OpenPanel) -> None:
    _sbx, _pid, panel = open_panel(COUNTER)
    for round_ in range(5):
        target = panel.line_count + 40
        wait_until(lambda t=target: panel.line_count >= t, timeout=10, what="lines")
        assert panel.on_reattach() is None  # no running loop: it blocked until done
        assert panel.state.attached and panel.state.error is None, round_
    target = panel.line_count + 40
    wait_until(lambda: panel.line_count >= target, timeout=10, what="lines after")
    panel.flush()
    lines = screen_lines(panel)
    assert lines == numbered(lines), "a reattach lost or duplicated lines"
    assert panel.lines == numbered(panel.lines)
    assert panel.state.cursor is not None and panel.state.cursor > 0


@pytest.mark.timeout(30)
def test_sync_kill_restart_follows_the_new_pid(open_panel: OpenPanel) -> None:
    sbx, old, panel = open_panel(MARKED)
    wait_until(lambda: panel.line_count >= 300, timeout=10, what="old output")
    assert panel.on_kill_restart() is None
    new = panel.pid
    assert new != old
    assert sbx.commands.get(old).state == "exited"
    assert sbx.commands.get(new).restarted_from == old
    wait_until(lambda: (panel.state.cursor or 0) >= 20, timeout=10, what="new output")
    assert_fresh_run(panel.lines)
    panel.flush()
    assert last_status(panel).startswith(f"pid {new} ·")
    text = screen(panel)
    assert f"now following pid {new}" in text, "the restart is marked in the terminal"
    after = text.split(f"now following pid {new}", 1)[1].split("\n")[1:-1]
    assert_fresh_run([line for line in after if line])


@pytest.mark.timeout(30)
def test_sync_pause_resume_status_and_label_follow_at_once(open_panel: OpenPanel) -> None:
    sbx, _pid, panel = open_panel(COUNTER)
    wait_until(lambda: panel.line_count >= 10, timeout=10, what="output")
    panel.poll_interval = 0.05  # polls race the actions as hard as they can
    assert panel.pause_button.description == "Pause"
    for _ in range(3):
        panel.on_pause_resume()
        assert sbx.get_info().state == "paused"
        assert panel.pause_button.description == "Resume"
        assert " · paused · " in last_status(panel)
        panel.on_pause_resume()
        assert sbx.get_info().state == "running"
        assert panel.pause_button.description == "Pause"
        assert " · running · " in last_status(panel)
    count = panel.line_count
    wait_until(lambda: panel.line_count > count + 10, timeout=10, what="resumed output")
    panel.flush()
    assert " · running · " in last_status(panel)


@pytest.mark.timeout(30)
def test_sync_detach_stops_updates(open_panel: OpenPanel) -> None:
    sbx, pid, panel = open_panel(COUNTER)
    wait_until(lambda: panel.line_count >= 10, timeout=10, what="output")
    panel.on_detach()
    assert not panel.state.attached
    wait_until(lambda: open_panel_consumers(sbx, pid) == 0, timeout=5, what="closed")
    count, head = panel.line_count, sbx.commands.get(pid).head
    time.sleep(0.3)  # sleep-ok: observation window: nothing may arrive
    assert panel.line_count == count
    assert sbx.commands.get(pid).head > head, "the process kept writing meanwhile"
    panel.flush()
    assert "detached" in last_status(panel)
    panel.on_reattach()  # from the cursor: the missed lines arrive, in order
    wait_until(lambda: panel.line_count > count + 100, timeout=10, what="catch-up")
    panel.flush()
    assert screen_lines(panel) == numbered(screen_lines(panel))


@pytest.mark.timeout(30)
def test_sync_send_stdin_reaches_cat(open_panel: OpenPanel) -> None:
    _sbx, _pid, panel = open_panel(CAT)
    panel.on_send_stdin("hello panel")
    wait_until(lambda: "hello panel" in panel.lines, timeout=10, what="echo")
    panel.stdin_box.value = "from the box"
    panel.on_send_stdin()
    assert panel.stdin_box.value == ""
    wait_until(lambda: "from the box" in panel.lines, timeout=10, what="box echo")
    assert panel.lines == ["hello panel", "from the box"]
    panel.flush()
    assert screen_lines(panel) == ["hello panel", "from the box"]


@pytest.mark.timeout(30)
def test_sync_panel_shows_stderr_and_exit(open_panel: OpenPanel) -> None:
    _sbx, _pid, panel = open_panel(["sh", "-c", "echo out; echo 'e<r>r' >&2; printf tail; exit 3"])
    wait_until(lambda: panel.state.exit_code == 3, timeout=10, what="the exit")
    assert panel.line_count == 2
    panel.flush()
    # stdout and stderr are separate pipes: their relative order is the arrival's.
    assert sorted(screen(panel).split("\n")) in (
        sorted(["out", "e<r>r", "tail"]),
        sorted(["out", "taile<r>r", ""]),
    )
    raw = b"".join(b for _, bufs in custom(panel) for b in bufs)
    assert b"\x1b[31me<r>r\n\x1b[0m" in raw, "stderr is red"
    assert "exited" in last_status(panel) and "exit 3" in last_status(panel)
    assert not panel.state.stalled()


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
        assert panel.widget.comm is None and panel.terminal.comm is None
        assert all(b.comm is None for b in panel.buttons.values())
        # The in-process daemon's worker threads come and go with its own work.
        left = {t for t in threading.enumerate() if not t.name.startswith(WORKER_THREADS)}
        assert left <= threads, "close left a thread behind"
        count = panel.line_count
        time.sleep(0.2)  # sleep-ok: observation window: a closed panel stays still
        assert panel.line_count == count
        with pytest.raises(RuntimeError):
            panel.on_reattach()


# -- ProcessPanel inside a running loop (like a Jupyter kernel) ---------------------------


@pytest.mark.timeout(30)
async def test_async_panel_follows_reattaches_and_flushes_itself(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        pid = await start_async(sbx, COUNTER)
        panel = ProcessPanel(sbx, pid)
        try:
            await poll(lambda: panel.line_count >= 50, what="lines")
            # The ticker flushes on the loop: no explicit flush() here.
            await poll(lambda: len(screen_lines(panel)) >= 50, what="flushed lines")
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
                await asyncio.sleep(0.01)  # sleep-ok: poll interval
            target = panel.line_count + 30
            await poll(lambda: panel.line_count >= target, what="lines after")
            await poll(lambda: len(screen_lines(panel)) >= target, what="flushed")
            assert screen_lines(panel) == numbered(screen_lines(panel))
            assert panel.state.error is None
        finally:
            await panel.aclose()
        assert panel.tasks == 0


@pytest.mark.timeout(30)
async def test_async_kill_restart_pause_resume_detach(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        old = await start_async(sbx, MARKED)
        panel = ProcessPanel(sbx, old)
        try:
            await poll(lambda: panel.line_count >= 200, what="old output")
            await panel.on_kill_restart()  # type: ignore[misc]
            assert panel.pid != old
            assert (await sbx.commands.get(old)).state == "exited"
            await poll(lambda: (panel.state.cursor or 0) >= 20, what="new output")
            assert_fresh_run(panel.lines)

            await panel.on_pause_resume()  # type: ignore[misc]
            assert (await sbx.get_info()).state == "paused"
            assert panel.pause_button.description == "Resume"
            assert " · paused · " in last_status(panel)
            await panel.on_pause_resume()  # type: ignore[misc]
            assert (await sbx.get_info()).state == "running"
            assert panel.pause_button.description == "Pause"
            assert " · running · " in last_status(panel)

            await panel.on_detach()  # type: ignore[misc]
            count = panel.line_count
            head = (await sbx.commands.get(panel.pid)).head
            await asyncio.sleep(0.3)  # sleep-ok: observation window
            assert panel.line_count == count
            assert (await sbx.commands.get(panel.pid)).head > head
        finally:
            await panel.aclose()
        assert panel.tasks == 0


@pytest.mark.timeout(30)
async def test_a_poll_in_flight_during_kill_restart_does_not_write_the_old_head(
    conn: dict[str, Any],
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        old = await start_async(sbx, COUNTER)
        panel = ProcessPanel(sbx, old)
        try:
            await poll(lambda: panel.line_count >= 300, what="old output")
            real = sbx.raw_consumers
            gate = asyncio.Event()
            entered = asyncio.Event()

            async def slow_consumers() -> Any:
                frame = await real()
                entered.set()
                await gate.wait()  # the answer arrives after the restart
                return frame

            sbx.raw_consumers = slow_consumers  # type: ignore[method-assign]
            in_flight = asyncio.create_task(panel.poll())
            await entered.wait()
            sbx.raw_consumers = real  # type: ignore[method-assign]
            await panel.on_kill_restart()  # type: ignore[misc]
            gate.set()
            await in_flight
            assert panel.state.pid != old
            new_head = (await sbx.commands.get(panel.state.pid)).head
            assert panel.state.head is None or panel.state.head <= new_head, (
                "the old process's head leaked into the new state"
            )
            assert not panel.state.stalled()
        finally:
            await panel.aclose()


@pytest.mark.timeout(30)
async def test_async_send_stdin_and_close(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        pid = await start_async(sbx, CAT)
        panel = ProcessPanel(sbx, pid)
        await panel.on_send_stdin("ping")  # type: ignore[misc]
        await poll(lambda: "ping" in panel.lines, what="echo")
        await poll(lambda: "ping" in screen_lines(panel), what="flushed echo")
        panel.close()  # sync close on a running loop: the teardown finishes on the loop
        await panel.aclose()
        assert panel.tasks == 0

        async def open_consumers() -> int:
            frame = await sbx.consumers()
            return len(frame[(frame["pid"] == pid) & frame["closed_at"].isna()])

        deadline = time.monotonic() + 5
        while await open_consumers():  # the daemon sees the closed connection shortly
            assert time.monotonic() < deadline, "the panel's stream was not closed"
            await asyncio.sleep(0.01)  # sleep-ok: poll interval


@pytest.mark.timeout(30)
async def test_stalled_badge_for_paused_process_with_pending_output(
    conn: dict[str, Any],
) -> None:
    sbx = Sandbox.create(**conn)  # a sync Sandbox used from a running loop
    try:
        pid = start_sync(sbx, COUNTER)
        panel = ProcessPanel(sbx, pid, stall_after=0.3)
        try:
            await poll(lambda: panel.line_count >= 20, what="output")
            await panel.on_pause_resume()  # type: ignore[misc]
            await poll(lambda: panel.state.process_state == "paused", what="paused state")
            # Output written just before the pause may still be in flight: let it land.
            count = -1
            while panel.line_count != count:
                count = panel.line_count
                await asyncio.sleep(0.2)  # sleep-ok: poll until quiet (bounded by the timeout)
            await asyncio.sleep(0.5)  # sleep-ok: observation window > stall_after
            assert panel.line_count == count
            assert not panel.state.stalled()
            assert "STALLED" not in last_status(panel)
            cursor = panel.state.cursor
            assert cursor is not None
            panel.state.update_process(head=cursor + 5)  # output we do not get (wedged)
            await poll(lambda: "STALLED" in last_status(panel), timeout=5, what="badge")
            await panel.on_pause_resume()  # type: ignore[misc]
            await poll(lambda: "STALLED" not in last_status(panel), timeout=5, what="clear")
            assert panel.line_count > count
        finally:
            await panel.aclose()
    finally:
        sbx.kill()


@pytest.mark.timeout(40)
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_throttle_at_1000_lines_per_second(conn: dict[str, Any], kind: str) -> None:
    sbx: Sandbox | AsyncSandbox = (
        Sandbox.create(**conn) if kind == "sync" else await AsyncSandbox.create(**conn)
    )
    try:
        pid = await start_any(sbx, PACED)
        started = time.monotonic()
        panel = ProcessPanel(sbx, pid, flush_hz=10.0)
        try:
            await poll(lambda: panel.line_count >= 2000, timeout=20, what="all lines")
            await poll(lambda: "1999" in screen_lines(panel), timeout=5, what="final value")
            elapsed = time.monotonic() - started
            messages = len(custom(panel))
            assert panel.state.chunks >= 500, "the state changed per chunk"
            assert messages <= 10 * elapsed + 3, f"{messages} messages in {elapsed:.2f}s"
            assert messages >= 5, "the ticker flushed while the process ran"
            assert screen_lines(panel) == numbered(screen_lines(panel))
            sent = sum(len(b) for _, bufs in custom(panel) for b in bufs)
            assert sent == panel.state.bytes_received, "each byte sent once, nothing more"
            # Nothing changes any more but the rate decaying: then silence.
            await asyncio.sleep(2.5)  # sleep-ok: the rate window passes
            quiet = len(custom(panel))
            await asyncio.sleep(0.5)  # sleep-ok: observation window
            assert len(custom(panel)) == quiet
        finally:
            await panel.aclose()
        assert panel.tasks == 0
    finally:
        await kill_any(sbx)


@pytest.mark.timeout(90)
async def test_rate_cap_shows_the_newest_output_and_a_skip_marker(conn: dict[str, Any]) -> None:
    flood = [sys.executable, "-c", "import sys\nfor i in range(200000):\n    print(i)\n"]
    async with await AsyncSandbox.create(**conn) as sbx:
        pid = await start_async(sbx, flood)
        started = time.monotonic()
        panel = ProcessPanel(sbx, pid, rate_cap=64 * 1024)
        try:
            await poll(
                lambda: panel.state.exit_code is not None,
                timeout=60,
                what="exit",
                info=lambda: panel.state.snapshot(),
            )
            await poll(lambda: "199999" in screen_lines(panel), timeout=5, what="the end")
            elapsed = time.monotonic() - started
            text = screen(panel)
            assert re.search(r"… \d+ bytes skipped \(cursor \d+–\d+\)", text)
            sent = sum(len(b) for _, bufs in custom(panel) for b in bufs)
            assert panel.state.bytes_received > 1_200_000
            assert sent <= 64 * 1024 * elapsed * 1.2 + 64 * 1024, (sent, elapsed)
            assert len(custom(panel)) <= 10 * elapsed + 3
        finally:
            await panel.aclose()


@pytest.mark.timeout(30)
def test_the_daemon_knows_the_panel_by_its_role(open_panel: OpenPanel) -> None:
    sbx, pid, _panel = open_panel(CAT)
    wait_until(lambda: open_panel_consumers(sbx, pid) == 1, timeout=5, what="consumer")
    frame = sbx.consumers()
    rows = frame[(frame["pid"] == pid) & frame["closed_at"].isna()]
    assert list(rows["role"]) == ["panel"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("daemon_config", [fast_config(retention_bytes=4096)])
def test_output_evicted_before_the_panel_read_it_shows_as_a_marker(
    conn: dict[str, Any], daemon_config: Any
) -> None:
    """A panel attached from cursor 0 after the daemon evicted the start of the output
    shows how much was lost, in the terminal, not as a warning in the kernel's log."""
    with Sandbox.create(**conn) as sbx:
        # Two halves, the second once the first is in the log: two chunks at least, so the
        # older is evicted however the reads fall (a loaded machine read the whole output
        # at once, one chunk, and the newest chunk is always kept).
        writer = (
            "import sys\n"
            "for i in range(2000):\n"
            "    print(f'line {i:06d}')\n"
            "    if i == 999:\n"
            "        sys.stdout.flush(); sys.stdin.readline()\n"
        )
        pid = start_sync(sbx, [sys.executable, "-c", writer])
        wait_until(lambda: sbx.commands.get(pid).raw["head"] >= 1, timeout=10, what="a chunk")
        sbx.commands.send_stdin(pid, "\n")

        def exited() -> bool:
            return any(p.pid == pid and p.state == "exited" for p in sbx.commands.list())

        wait_until(exited, timeout=10, what="the writer's exit")
        # The start is given back once the log has written it out (a loaded machine: a
        # moment after the exit).
        wait_until(
            lambda: sbx.commands.get(pid).raw["evicted_bytes"] > 0, timeout=10, what="eviction"
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning would land in the kernel's stderr
            panel = ProcessPanel(sbx, pid, cursor=0)
            try:

                def shows_the_end() -> bool:
                    panel.flush()  # no kernel loop here: the test flushes
                    return "line 001999" in screen(panel)

                wait_until(shows_the_end, timeout=10, what="the last line on screen")
                assert re.search(r"\d+ bytes lost", screen(panel)), screen(panel)[:300]
                assert "sandboxkit: " not in screen(panel)  # not the SDK's stdout marker
            finally:
                panel.close()


@pytest.mark.timeout(60)
def test_a_panel_on_an_isolated_sandbox_shows_its_lines_and_an_oom_on_its_status(
    conn: dict[str, Any],
) -> None:
    from sandboxkit.daemon.isolation import probe

    if not probe().available and not os.environ.get("CI"):
        pytest.skip(f"no namespaces here: {probe().reason}")
    hog = "for i in range(3): print('line', i, flush=True)\nb = bytearray(512 * 1024 * 1024)\n"
    with Sandbox.create(isolation="namespaces", limits={"memory": "64M"}, **conn) as sbx:
        how = sbx.get_info().limits_enforced["memory"]
        sbx.files.write("hog.py", hog)
        pid = start_sync(sbx, ["python3", "hog.py"])
        panel = ProcessPanel(sbx, pid)
        try:

            def exited() -> bool:
                panel.flush()
                # The exit code, not the state alone: a stream attached after the end
                # says "exited" in its start frame, and the code with its end frame.
                return re.search(r"exit -?\d", last_status(panel)) is not None

            wait_until(exited, what="the exit code on the status line")
            panel.flush()
            assert screen_lines(panel)[:3] == ["line 0", "line 1", "line 2"]
            if how == "rlimit":  # no cgroup: the allocation fails, no OOM kill
                assert "exit 1" in last_status(panel)
            else:
                assert "exited · exit -9 (oom)" in last_status(panel)
        finally:
            panel.close()
