"""The E2B provider: sandboxkit's client and widgets on an E2B sandbox, through the
official ``e2b`` SDK in debug mode, against the daemon's own envd endpoint (loopback
only). The whole chain runs: widget → provider → e2b SDK → envd protocol → daemon.

The envd URL ends in ``/live``: there a reattach gets only new output, as from E2B's envd,
so what the provider cannot replay shows here as it would on E2B.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
from collections.abc import Iterator

import pytest
from support import poll, wait_until
from test_notebook_panel import custom, last_status, recording_comms, screen

from sandboxkit import AsyncCommandHandle, AsyncSandbox, ProcessInfo, Sandbox
from sandboxkit.client.stream import GapInfo
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import CommandExitError, OutputIncomplete, ResultUnavailable
from sandboxkit.notebook import BackpressureChart, LifecycleTimeline, ProcessPanel
from sandboxkit.notebook.dashboard import SandboxDashboard
from sandboxkit.providers import ProviderUnavailable, ProviderUnsupported, UnknownGap

__all__ = ["recording_comms"]  # the fixture, imported to record what widgets send

# Numbered lines, a few hundred a second, until killed.
COUNTER = shlex.join(
    [
        sys.executable,
        "-u",
        "-c",
        "import time\nfor i in range(10**7):\n    print(i, flush=True)\n    "
        "time.sleep(0.002)\n",  # sleep-ok: the child process's pace
    ]
)
MARKED = shlex.join(
    [
        sys.executable,
        "-u",
        "-c",
        "import time\nprint('begin', flush=True)\n"
        "for i in range(10**7):\n    print(i, flush=True)\n    "
        "time.sleep(0.002)\n",  # sleep-ok: the child process's pace
    ]
)


def numbered(lines: list[str]) -> list[str]:
    return [str(i) for i in range(len(lines))]


@pytest.fixture(autouse=True)
def no_cloud(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's E2B_API_KEY must never send these tests to E2B's cloud."""
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    monkeypatch.delenv("E2B_DEBUG", raising=False)


@pytest.fixture(scope="module")
def daemon(envd_daemon: DaemonServer) -> DaemonServer:
    return envd_daemon


@pytest.fixture
def home(daemon: DaemonServer) -> Iterator[Sandbox]:
    """The sandboxkit sandbox the E2B SDK reaches through the envd endpoint."""
    own = Sandbox.create(url=daemon.url, token=daemon.token)
    try:
        yield own
    finally:
        own.kill()


@pytest.fixture
def envd_url(daemon: DaemonServer, home: Sandbox) -> str:
    assert daemon.envd is not None
    return f"{daemon.envd.url}/sandboxes/{home.sandbox_id}/live"


@pytest.fixture
def sbx(envd_url: str) -> Iterator[Sandbox]:
    client = Sandbox.create(provider="e2b", url=envd_url)
    try:
        yield client
    finally:
        client.close()


# -- the provider itself ------------------------------------------------------------------


def test_importing_sandboxkit_does_not_import_e2b() -> None:
    code = (
        "import sys, sandboxkit, sandboxkit.client, sandboxkit.notebook, sandboxkit.providers\n"
        "from sandboxkit import Sandbox\n"
        "assert 'e2b' not in sys.modules, 'e2b imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_without_the_sdk_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "sandboxkit.providers.e2b", raising=False)
    monkeypatch.setitem(sys.modules, "e2b", None)  # as if it were not installed
    with pytest.raises(ProviderUnavailable, match=r"pip install 'sandboxkit\[e2b\]'"):
        Sandbox.create(provider="e2b", url="http://127.0.0.1:9")
    with pytest.raises(ProviderUnavailable, match="no provider 'nope'"):
        Sandbox.create(provider="nope")


def test_api_key_selects_the_cloud_and_debug_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandboxkit.providers.e2b.target import DEFAULT_ENVD_URL
    from sandboxkit.providers.e2b.target import Target as _Target

    assert _Target.resolve(None, None, {}).options == {
        "debug": True,
        "sandbox_url": DEFAULT_ENVD_URL,
    }
    monkeypatch.setenv("E2B_API_KEY", "e2b_test")
    cloud = _Target.resolve(None, None, {"template": "base"})
    assert not cloud.debug and cloud.options == {"template": "base"}
    assert not _Target.resolve(None, "e2b_other", {}).debug
    envd = _Target.resolve("http://127.0.0.1:1", None, {})  # an envd URL: debug mode
    assert envd.debug and envd.options["sandbox_url"] == "http://127.0.0.1:1"
    assert not _Target.resolve("https://api.example", None, {"debug": False}).debug
    monkeypatch.setenv("E2B_DEBUG", "1")
    assert _Target.resolve(None, None, {}).debug


def test_an_e2b_sandbox_is_the_client_class_holding_an_e2b_backend(sbx: Sandbox) -> None:
    from sandboxkit.providers.e2b import E2BSandbox

    # Composed, not subclassed: the one client class, constructed normally.
    assert type(sbx.async_sandbox) is AsyncSandbox
    assert isinstance(sbx.backend, E2BSandbox) and sbx.backend.debug
    assert (sbx.provider, sbx.metrics_scope) == ("e2b", "client")
    assert "(e2b debug)" in repr(sbx.async_sandbox)


def test_debug_mode_refuses_on_timeout_pause_and_auto_resume(envd_url: str) -> None:
    from sandboxkit.providers.e2b.target import DEBUG_SANDBOXES

    before = DEBUG_SANDBOXES.ids()
    for options, operation in (
        ({"on_timeout": "pause"}, "on_timeout"),
        ({"auto_resume": True}, "auto_resume"),
    ):
        with pytest.raises(ProviderUnsupported, match="no control plane") as caught:
            Sandbox.create(provider="e2b", url=envd_url, **options)  # type: ignore[arg-type]
        assert (caught.value.provider, caught.value.operation) == ("e2b", operation)
    assert DEBUG_SANDBOXES.ids() == before, "a refused create made a sandbox"


def test_run_and_reattach_from_the_cursor_replay_exactly(sbx: Sandbox) -> None:
    result = sbx.commands.run("echo hi; echo oops >&2")
    assert (result.stdout, result.stderr, result.exit_code) == ("hi\n", "oops\n", 0)
    lines: list[str] = []
    handle = sbx.commands.run(COUNTER, background=True, on_stdout=lines.append)
    wait_until(lambda: len(lines) >= 50, what="first lines")
    cursor = handle.disconnect()
    assert cursor is not None and cursor > 0
    count = len(lines)
    wait_until(lambda: sbx.commands.get(handle.pid).head > cursor + 200, what="more output")
    again = sbx.commands.connect(handle.pid, cursor, on_stdout=lines.append)
    wait_until(lambda: len(lines) >= count + 300, what="lines after the reattach")
    assert lines[: count + 300] == numbered(lines[: count + 300]), "lost or duplicated"
    assert sbx.commands.kill(handle.pid)
    with pytest.raises(CommandExitError, match="killed by SIGKILL"):
        again.wait(timeout=10)


def test_a_line_cut_by_a_disconnect_continues_whole(sbx: Sandbox) -> None:
    """A handle left between a line's start and its newline: the handle continued from
    its cursor gets that line once, whole (as from the daemon's own streams). Before, the
    line's start was lost: a CI run's reattach test read "" where "51" was."""
    first: list[str] = []
    handle = sbx.commands.run(
        "printf ab; read go; printf 'cd\\nnext\\n'; sleep 30",
        background=True,
        on_stdout=first.append,
    )
    wait_until(lambda: handle.cursor is not None and handle.cursor >= 2, what="ab")
    cursor = handle.disconnect()
    sbx.commands.send_stdin(handle.pid, "go\n")
    lines: list[str] = []
    again = sbx.commands.connect(handle.pid, cursor, on_stdout=lines.append)
    wait_until(lambda: "next" in lines, what="the rest")
    assert (first, lines) == ([], ["abcd", "next"])
    assert sbx.commands.kill(handle.pid)
    with pytest.raises(CommandExitError):
        again.wait(timeout=10)


def test_a_process_started_elsewhere_is_followed_behind_a_gap_of_unknown_size(
    sbx: Sandbox, home: Sandbox
) -> None:
    """No replay after nobody was attached: what the process printed before the provider
    attached is reported as missing, with no byte count."""
    # sleep-ok: the child's pace (a line before the attach, one after) and its lifetime
    info = home.commands.start(["sh", "-c", "echo early; sleep 0.3; echo late; sleep 30"])
    wait_until(lambda: home.commands.get(info.pid).head > 0, what="the early line")
    gaps: list[GapInfo | UnknownGap] = []
    handle = sbx.commands.connect(info.pid, on_gap=gaps.append)
    wait_until(lambda: "late" in handle.stdout, what="the late line")
    assert "early" not in handle.stdout
    assert len(gaps) == 1 and isinstance(gaps[0], UnknownGap)
    assert gaps[0].bytes_lost is None and "replays nothing" in gaps[0].reason
    marked = sbx.commands.connect(info.pid, cursor=0)  # default on_gap: a marker
    wait_until(lambda: "late" in marked.stdout, what="the marker reader")
    assert "[sandboxkit: an unknown amount of output missing here]" in marked.stdout
    events = sbx.events()
    gap_rows = events[events["kind"] == "consumer.gap"]
    assert len(gap_rows) == 2 and all(d["bytes_lost"] is None for d in gap_rows["data"])
    with pytest.raises(ResultUnavailable):
        sbx.commands.connect(999_999)
    assert sbx.commands.kill(info.pid)


def test_output_evicted_from_the_client_log_is_a_gap_with_its_true_size(envd_url: str) -> None:
    """What this client received and dropped it can count: a reader that starts before
    the oldest kept byte is told exactly how many bytes it missed, then gets the rest."""
    sbx = Sandbox.create(provider="e2b", url=envd_url, provider_options={"keep_bytes": 2048})
    try:
        # Four bursts (sleep-ok: the child's pace), so that the output reaches the client
        # as several chunks, however the daemon batches a pipe's reads.
        result = sbx.commands.run(
            "for i in $(seq 1000 1999); do echo $i; [ $((i % 250)) = 249 ] && sleep 0.05; done"
        )
        assert result.stdout.split() == [str(i) for i in range(1000, 2000)]  # read live
        gaps: list[GapInfo | UnknownGap] = []
        late = sbx.commands.connect(result.pid, cursor=0, on_gap=gaps.append).wait()
        assert len(gaps) == 1 and isinstance(gaps[0], GapInfo)
        kept = late.stdout.encode()
        # Exact count; what is kept is keep_bytes plus, at most, the newest chunk (kept
        # whole, so a live reader never loses it), however the daemon cut the output.
        assert gaps[0].bytes_lost == 5000 - len(kept) and 0 < len(kept) < 5000
        assert ("\n".join(str(i) for i in range(1000, 2000)) + "\n").endswith(late.stdout)
    finally:
        sbx.close()


def test_pty_runs_through_the_sdks_pty_api_with_raw_bytes(sbx: Sandbox) -> None:
    """``pty=True``: a terminal (``tty`` names one), its raw bytes (0xff is not UTF-8, and
    E2B's pty output is bytes), stdin through the terminal, the command's exit code — and
    none of the login shell's prompt or the typed line the provider drives it with."""
    handle = sbx.commands.run(
        "printf 'a\\377b\\n'; tty; read x; echo got $x; exit 3", pty=True, background=True
    )
    wait_until(lambda: b"/dev/" in handle.stream.stdout_bytes, what="the tty line")
    sbx.commands.send_stdin(handle.pid, "hello\n")
    with pytest.raises(CommandExitError, match="exit code 3"):
        handle.wait(timeout=10)
    out = handle.stream.stdout_bytes
    assert out.startswith(b"a\xffb\r\n/dev/pts/") and out.endswith(b"hello\r\ngot hello\r\n")
    assert b"printf" not in out and b"exec" not in out
    assert sbx.commands.get(handle.pid).exit_code == 3


def test_debug_mode_pause_is_a_typed_error_that_changes_nothing(sbx: Sandbox) -> None:
    with pytest.raises(ProviderUnsupported, match="debug mode has no control plane"):
        sbx.pause()
    assert sbx.info.state == "running"
    assert sbx.commands.run("echo still").stdout == "still\n"


def test_an_e2b_sandbox_says_its_output_reaches_this_client_only(sbx: Sandbox) -> None:
    assert sbx.info.fanout == "e2b"
    assert sbx.get_info().fanout == "e2b"  # refreshing its state keeps what it is


async def test_async_provider_restart_and_client_side_journal(envd_url: str) -> None:
    sbx = await AsyncSandbox.create(provider="e2b", url=envd_url)
    try:
        info = await sbx.commands.start("echo begin; sleep 30")  # sleep-ok: a live process
        new = await sbx.commands.restart(info.pid)
        assert new.pid != info.pid and new.restarted_from == info.pid
        old = await sbx.commands.get(info.pid)
        assert old.state == "exited" and old.restarted_to == new.pid
        kinds = [e["kind"] for e in await sbx.raw_events()]
        assert kinds.count("process.started") == 2 and "process.restarted" in kinds
        assert all(e["data"]["source"] == "client" for e in await sbx.raw_events())
        frame = await sbx.consumers()
        assert frame.attrs["scope"] == "client"
        await sbx.commands.kill(new.pid)
    finally:
        await sbx.close()


@pytest.mark.timeout(30)
async def test_a_foreground_run_is_complete_or_says_what_is_missing(envd_url: str) -> None:
    """``run()`` in the foreground through the provider: output beyond ``keep_output`` is
    an OutputIncomplete with its exact count; a gap E2B cannot size (recorded here as the
    tap records a stream it had to reopen) is one with ``bytes_lost=None``, unless
    ``on_gap`` takes it; ``on_end`` gets the handle; ``stdin_session`` is refused."""
    sbx = await AsyncSandbox.create(provider="e2b", url=envd_url)
    try:
        ended: list[AsyncCommandHandle] = []
        with pytest.raises(OutputIncomplete) as caught:
            await sbx.commands.run("printf 0123456789", keep_output=4, on_end=ended.append)
        assert caught.value.bytes_lost == 6 and "6 bytes of its output" in str(caught.value)
        assert caught.value.result is not None and caught.value.result.stdout == "6789"
        assert [(h.exit_code, h.error) for h in ended] == [(0, None)]
        argv = await sbx.commands.run(["printf", "%s|", "a b", "c"])  # an argv, quoted
        assert argv.stdout == "a b|c|" and (await sbx.commands.get(argv.pid)).argv is None

        async def run_across_a_cut(**options: object) -> object:
            first = asyncio.Event()
            run = asyncio.create_task(
                sbx.commands.run(  # type: ignore[call-overload]
                    "echo before; read x; echo after $x",
                    on_stdout=lambda line: first.set(),
                    **options,
                )
            )
            await asyncio.wait_for(first.wait(), 10)
            (pid,) = [p.pid for p in await sbx.commands.list() if p.state == "running"]
            logs = sbx.backend.session.logs  # type: ignore[attr-defined]
            logs[pid].unknown_gap("E2B replays nothing printed while its stream was cut")
            with pytest.raises(ProviderUnsupported):
                sbx.commands.stdin_session(pid)
            await sbx.commands.send_stdin(pid, "now\n")
            return await asyncio.wait_for(run, 10)

        with pytest.raises(OutputIncomplete, match="an unknown amount") as caught:
            await run_across_a_cut()
        assert caught.value.bytes_lost is None and caught.value.result is not None
        assert caught.value.result.stdout == (
            "before\n\n[sandboxkit: an unknown amount of output missing here]\nafter now\n"
        )
        gaps: list[GapInfo | UnknownGap] = []
        result = await run_across_a_cut(on_gap=gaps.append)
        assert getattr(result, "stdout", None) == "before\nafter now\n"
        assert [(type(g), g.bytes_lost, g.cursor) for g in gaps] == [(UnknownGap, None, 7)]
    finally:
        await sbx.close()


# -- the widgets on an E2B sandbox -------------------------------------------------------


@pytest.mark.timeout(30)
def test_panel_follows_reattaches_and_kill_restarts_an_e2b_process(sbx: Sandbox) -> None:
    old = sbx.commands.start(MARKED).pid
    panel = ProcessPanel(sbx, old)
    try:
        wait_until(lambda: panel.line_count >= 100, what="lines in the panel")
        assert panel.on_reattach() is None
        assert panel.state.attached and panel.state.error is None
        target = panel.line_count + 100
        wait_until(lambda: panel.line_count >= target, what="lines after the reattach")
        lines = panel.lines
        assert lines[0] == "begin" and lines[1:] == numbered(lines[1:]), "lost or duplicated"
        panel.poll_interval = 0.05
        wait_until(lambda: (panel.state.head or 0) > 0, what="the client-side head")

        assert panel.on_kill_restart() is None
        new = panel.pid
        assert new != old and sbx.commands.get(new).restarted_from == old
        wait_until(lambda: panel.line_count >= 50, what="the new process's lines")
        fresh = panel.lines
        assert fresh[0] == "begin" and fresh[1:] == numbered(fresh[1:])
        panel.flush()
        assert f"now following pid {new}" in screen(panel)
        assert last_status(panel).startswith(f"pid {new} ·")

        with pytest.raises(ProviderUnsupported):  # debug mode: no pause
            panel.on_pause_resume()
        panel.flush()
        assert "ProviderUnsupported" in last_status(panel)  # said in the status line
        assert panel.state.error is not None and "ProviderUnsupported" in panel.state.error
    finally:
        panel.close()
        sbx.commands.kill(panel.pid)
    assert panel.tasks == 0


@pytest.mark.timeout(30)
def test_panel_shows_a_gap_of_unknown_size_not_a_number(sbx: Sandbox, home: Sandbox) -> None:
    # sleep-ok: the child's pace (a line before the attach, one after) and its lifetime
    info = home.commands.start(["sh", "-c", "echo early; sleep 0.3; echo late; sleep 30"])
    wait_until(lambda: home.commands.get(info.pid).head > 0, what="the early line")
    panel = ProcessPanel(sbx, info.pid)
    try:

        def shows_late() -> bool:
            panel.flush()
            return "late" in screen(panel)

        wait_until(shows_late, what="the late line on screen")
        text = screen(panel)
        assert "output may be missing here, amount unknown" in text
        assert "bytes lost" not in text and "early" not in text
        # A view that renders only now (a page reload, a second display) sees it too.
        panel._on_frontend_message(panel.terminal, {"type": "hello", "view": "late"}, [])
        snapshot = [bufs for msg, bufs in custom(panel) if msg["type"] == "snapshot"]
        assert b"amount unknown" in b"".join(snapshot[-1])
        assert not any("amount unknown" in line for line in panel.lines)  # not output
    finally:
        panel.close()
        home.commands.kill(info.pid)


def test_panel_knows_the_process_state_as_soon_as_it_attaches(sbx: Sandbox) -> None:
    """Not "connecting" until the next poll: the provider's tap already knows the state."""
    pid = sbx.commands.start("sleep 30").pid  # sleep-ok: a live process with no output
    panel = ProcessPanel(sbx, pid)
    try:
        wait_until(lambda: panel.state.attached, what="the attach")
        panel.flush()
        assert panel.state.snapshot().shown_state == "running"
        assert last_status(panel).startswith(f"pid {pid} · running"), last_status(panel)
    finally:
        panel.close()
        sbx.commands.kill(pid)


@pytest.mark.timeout(30)
def test_reattach_before_any_output_shows_the_unknown_gap_once(sbx: Sandbox, home: Sandbox) -> None:
    info = home.commands.start(["sh", "-c", "read x; echo late $x; sleep 30"])  # sleep-ok
    panel = ProcessPanel(sbx, info.pid)
    try:

        def shows(text: str) -> bool:
            panel.flush()
            return text in screen(panel)

        wait_until(lambda: shows("amount unknown"), what="the gap marker")
        panel.on_reattach()  # nothing printed yet: the cursor is where the gap is
        home.commands.send_stdin(info.pid, "now\n")
        wait_until(lambda: shows("late now"), what="the line after the reattach")
        assert screen(panel).count("output may be missing here, amount unknown") == 1
    finally:
        panel.close()
        home.commands.kill(info.pid)


@pytest.mark.timeout(30)
def test_charts_and_dashboard_say_their_metrics_are_client_side(
    sbx: Sandbox, envd_url: str
) -> None:
    pid = sbx.commands.start(COUNTER).pid
    panel = ProcessPanel(sbx, pid)
    chart = BackpressureChart(sbx, panel)
    timeline = LifecycleTimeline(sbx)
    dashboard = SandboxDashboard(sbx, refresh_interval=None, provider="e2b", url=envd_url)
    try:
        wait_until(lambda: panel.line_count >= 20, what="lines")
        chart.refresh()
        assert "client-side only" in chart.view.title
        rows = [row for row in chart.data.tracks.values()]
        assert any(track.label.startswith("panel") for track in rows)
        timeline.refresh()
        assert "as seen by this client" in timeline.view.title
        kinds = {e["kind"] for e in timeline.events}
        assert {"sandbox.created", "process.started", "consumer.attached"} <= kinds
        dashboard.refresh()
        assert "client-side only" in dashboard.title.value
        frame = dashboard.processes_frame()
        assert pid in set(frame["pid"]) and sbx.sandbox_id in dashboard.selector.options
        custom(panel)  # the panel sent its deltas through the recording comm
    finally:
        dashboard.close()
        timeline.close()
        chart.close()
        panel.close()
        sbx.commands.kill(pid)


@pytest.mark.timeout(30)
async def test_a_process_this_client_started_stays_listed_while_its_end_is_on_its_way(
    envd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B stops listing a process as running a moment before its end reaches this
    client's tap; the list in between must still show it (it showed nothing, and a
    dashboard's `on_start` then could not find the process it had just started). The tap
    is held back here, so that moment lasts."""
    from sandboxkit.providers.e2b.tap import Tap

    gate = asyncio.Event()
    run = Tap.run

    async def held(self: Tap, first: object) -> None:
        await gate.wait()
        await run(self, first)

    monkeypatch.setattr(Tap, "run", held)
    sbx = await AsyncSandbox.create(provider="e2b", url=envd_url)
    try:
        pid = (await sbx.commands.start("true")).pid
        e2b = sbx._backend.session.sdk  # type: ignore[attr-defined]

        async def unlisted_by_e2b() -> bool:
            return all(p.pid != pid for p in await e2b.commands.list())

        async def ended() -> ProcessInfo | None:
            info = await sbx.commands.get(pid)
            return info if info.state != "running" else None

        await poll(unlisted_by_e2b, what="E2B to stop listing `true`")
        assert pid in {p.pid for p in await sbx.commands.list()}
        gate.set()
        info = await poll(ended, what="the tap to record the end")
        assert info.exit_code == 0
    finally:
        gate.set()
        await sbx.close()


def test_dashboard_creates_e2b_sandboxes_and_shows_pause_errors(envd_url: str) -> None:
    dashboard = SandboxDashboard(refresh_interval=None, provider="e2b", url=envd_url)
    try:
        created = dashboard.on_create()
        assert created.sandbox_id.startswith("e2b-debug-")
        assert dashboard.state.selected == created.sandbox_id
        info = dashboard.on_start("echo from-the-dashboard")
        assert info.pid in set(dashboard.processes_frame()["pid"])
        with pytest.raises(ProviderUnsupported):
            dashboard.on_pause()
        assert "ProviderUnsupported" in (dashboard.state.error or "")
        dashboard.on_kill()
        assert created.sandbox_id not in dashboard.selector.options
    finally:
        dashboard.close()


@pytest.mark.timeout(30)
async def test_async_panel_on_an_e2b_sandbox_sends_stdin_and_detaches(envd_url: str) -> None:
    """An AsyncSandbox from the provider lives on the kernel's loop, as the widgets need."""
    sbx = await AsyncSandbox.create(provider="e2b", url=envd_url)
    pid = (await sbx.commands.start("cat")).pid
    panel = ProcessPanel(sbx, pid)
    try:
        assert panel._starting is not None
        await panel._starting
        task = panel.on_send_stdin("hello through e2b")
        assert task is not None
        await task
        deadline = asyncio.get_running_loop().time() + 10
        while "hello through e2b" not in panel.lines:
            assert asyncio.get_running_loop().time() < deadline, panel.lines
            await asyncio.sleep(0.02)  # sleep-ok: polling with a deadline
        detached = panel.on_detach()
        assert detached is not None
        await detached
        assert not panel.state.attached
    finally:
        await panel.aclose()
        await sbx.commands.kill(pid)
        await sbx.close()
    assert panel.tasks == 0
