"""``SandboxDashboard`` and ``StallLab`` driven through their handlers, without a browser,
against the in-process daemon."""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import sys
from collections.abc import Iterator

import httpx
import pandas as pd
import pytest
from support import wait_until

from sandboxkit.client.sandbox import AsyncSandbox
from sandboxkit.client.sync import Sandbox
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import DaemonUnavailable, InvalidArgument, SandboxNotFound, SandboxPaused
from sandboxkit.lab_options import LabOptions
from sandboxkit.notebook.dashboard import SandboxDashboard
from sandboxkit.notebook.stall_lab import StallLab

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SLEEPER = [
    sys.executable,
    "-c",
    "import time; time.sleep(60)",  # sleep-ok: a process that just waits
]


@pytest.fixture
def dashboard(conn: dict[str, str | None]) -> Iterator[SandboxDashboard]:
    dash = SandboxDashboard(**conn)
    try:
        yield dash
    finally:
        for client in list(dash._clients.values()):
            with contextlib.suppress(SandboxNotFound):
                client.kill()
        dash.close()


def _state_of(conn: dict[str, str | None], sandbox_id: str) -> str:
    return next(s.state for s in Sandbox.list(**conn) if s.sandbox_id == sandbox_id)


# -- SandboxDashboard --------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_on_create_makes_a_sandbox_and_selects_it(
    dashboard: SandboxDashboard, conn: dict[str, str | None]
) -> None:
    assert dashboard.sbx is None
    assert "no sandbox selected" in dashboard.title.value

    sbx = dashboard.on_create()

    assert sbx is not None
    assert _state_of(conn, sbx.sandbox_id) == "running"
    assert dashboard.state.selected == sbx.sandbox_id
    assert dashboard.selector.value == sbx.sandbox_id
    assert sbx.sandbox_id in dashboard.title.value and "running" in dashboard.title.value
    assert sbx.sandbox_id in dashboard.sandbox_table.value


@pytest.mark.timeout(30)
def test_create_options_reach_the_daemon(conn: dict[str, str | None]) -> None:
    dash = SandboxDashboard(
        lab=LabOptions(fanout="blocking"), metadata={"who": "dashboard-test"}, **conn
    )
    try:
        sbx = dash.on_create()
        assert sbx is not None
        info = sbx.get_info()
        assert info.fanout == "blocking"
        assert info.lab is not None and info.lab.fanout == "blocking"
        assert info.metadata == {"who": "dashboard-test"}
        assert dash.sandboxes_frame().set_index("sandbox_id").loc[sbx.sandbox_id, "fanout"] == (
            "blocking"
        )
        sbx.kill()
    finally:
        dash.close()


@pytest.mark.timeout(30)
def test_on_start_runs_a_command_that_appears_in_the_table(
    dashboard: SandboxDashboard,
) -> None:
    sbx = dashboard.on_create()
    assert sbx is not None
    dashboard.command.value = "sleep 30  # from-the-text-box"

    info = dashboard.on_start()

    assert info is not None
    assert sbx.commands.get(info.pid).state == "running"
    frame = dashboard.processes_frame().set_index("pid")
    assert frame.loc[info.pid, "command"] == "sleep 30  # from-the-text-box"
    assert frame.loc[info.pid, "state"] == "running"
    assert "from-the-text-box" in dashboard.table.value
    assert str(info.pid) in dashboard.table.value
    assert dashboard.command.value == ""  # the box is cleared after a start


@pytest.mark.timeout(30)
def test_table_counts_consumers(dashboard: SandboxDashboard) -> None:
    sbx = dashboard.on_create()
    assert sbx is not None
    info = dashboard.on_start(SLEEPER)
    assert info is not None
    assert dashboard.processes_frame().set_index("pid").loc[info.pid, "consumers"] == 0
    handle = sbx.commands.connect(info.pid)
    try:
        wait_until(lambda: sbx.commands.get(info.pid).consumers == 1, what="a consumer")
        dashboard.refresh()
        assert dashboard.processes_frame().set_index("pid").loc[info.pid, "consumers"] == 1
    finally:
        handle.disconnect()


@pytest.mark.timeout(30)
def test_pause_resume_and_kill_change_the_state(
    dashboard: SandboxDashboard, conn: dict[str, str | None]
) -> None:
    sbx = dashboard.on_create()
    assert sbx is not None
    sandbox_id = sbx.sandbox_id
    assert dashboard.resume_button.disabled and not dashboard.pause_button.disabled

    dashboard.on_pause()
    assert _state_of(conn, sandbox_id) == "paused"
    assert "paused" in dashboard.title.value
    assert dashboard.pause_button.disabled and not dashboard.resume_button.disabled
    assert dashboard.start_button.disabled

    dashboard.on_resume()
    assert _state_of(conn, sandbox_id) == "running"
    assert "running" in dashboard.title.value

    dashboard.on_kill()
    assert _state_of(conn, sandbox_id) == "killed"
    assert dashboard.sbx is None
    assert sandbox_id not in dashboard.selector.options
    assert sandbox_id not in set(dashboard.sandboxes_frame()["sandbox_id"])
    dashboard.on_show_killed(True)  # killed ones only on request
    frame = dashboard.sandboxes_frame().set_index("sandbox_id")
    assert frame.loc[sandbox_id, "state"] == "killed"


@pytest.mark.timeout(30)
def test_kill_selects_the_next_live_sandbox(
    dashboard: SandboxDashboard, conn: dict[str, str | None]
) -> None:
    first = dashboard.on_create()
    second = dashboard.on_create()
    assert first is not None and second is not None
    assert dashboard.state.selected == second.sandbox_id

    dashboard.on_kill()

    assert _state_of(conn, second.sandbox_id) == "killed"
    assert dashboard.state.selected == first.sandbox_id
    assert _state_of(conn, first.sandbox_id) == "running"


@pytest.mark.timeout(30)
def test_selecting_in_the_dropdown_switches_the_sandbox(
    dashboard: SandboxDashboard,
) -> None:
    first = dashboard.on_create()
    assert first is not None
    pid = dashboard.on_start(SLEEPER)
    assert pid is not None
    second = dashboard.on_create()
    assert second is not None
    assert dashboard.processes_frame().empty

    dashboard.selector.value = first.sandbox_id  # what a click in the dropdown does

    assert dashboard.state.selected == first.sandbox_id
    assert list(dashboard.processes_frame()["pid"]) == [pid.pid]
    dashboard.on_pause()
    assert first.get_info().state == "paused"
    assert second.get_info().state == "running"


@pytest.mark.timeout(30)
def test_actions_without_a_sandbox_show_and_raise_a_typed_error(
    dashboard: SandboxDashboard,
) -> None:
    with pytest.raises(SandboxNotFound):
        dashboard.on_pause()
    assert dashboard.state.error is not None and "Create" in dashboard.state.error
    assert "Create" in dashboard.status.value
    with pytest.raises(SandboxNotFound):
        dashboard.on_start("true")
    sbx = dashboard.on_create()
    assert sbx is not None
    assert dashboard.state.error is None  # a successful action clears the error
    assert "Create" not in dashboard.status.value
    with pytest.raises(InvalidArgument):
        dashboard.on_start("   ")
    assert dashboard.state.error == "type a command first"
    assert dashboard.processes_frame().empty


@pytest.mark.timeout(30)
def test_wraps_a_given_sandbox_and_leaves_it_open(conn: dict[str, str | None]) -> None:
    with Sandbox.create(**conn) as sbx:
        dash = SandboxDashboard(sbx)
        assert dash.state.selected == sbx.sandbox_id
        info = dash.on_start("sleep 30")
        assert info is not None
        dash.close()
        # The dashboard did not close the caller's client: it still works.
        assert sbx.commands.get(info.pid).state == "running"


def _tree(widget: object) -> list[object]:
    out = [widget]
    for child in getattr(widget, "children", ()) or ():
        out += _tree(child)
    return out


@pytest.mark.timeout(30)
def test_close_closes_every_child_widget_and_tables_read_well(
    conn: dict[str, str | None],
) -> None:
    with Sandbox.create(**conn) as sbx:
        dash = SandboxDashboard(sbx)
        script = (
            "import time\nfor i in range(3):\n    "
            "time.sleep(10)\n"  # sleep-ok: the child process's pace
        )
        info = dash.on_start(f"{sys.executable} -c {shlex.quote(script)}")
        assert info is not None
        dash.flush()
        table = dash.table.value
        assert 'class="dataframe sandboxkit-table"' in table and "<style>" in table
        assert "\\n" not in table and "⏎" in table, "a multi-line command on one line"
        tree = _tree(dash.widget)
        assert len(tree) > 10
        dash.close()
        left = [w for w in tree if getattr(w, "comm", None) is not None]
        assert not left, f"close left {len(left)} child widgets open"


@pytest.mark.timeout(30)
def test_flush_renders_only_on_change(dashboard: SandboxDashboard) -> None:
    dashboard.flush()
    assert dashboard.flush() is False
    dashboard.refresh()  # nothing changed on the daemon
    assert dashboard.flush() is False
    dashboard.on_create()
    dashboard.state.version += 1
    assert dashboard.flush() is True


@pytest.mark.timeout(30)
async def test_on_the_running_loop_handlers_are_tasks_and_the_table_refreshes_itself(
    conn: dict[str, str | None],
) -> None:
    """Inside a running loop (a kernel) handlers return owned tasks instead of blocking,
    the dashboard re-reads the daemon by itself, and aclose() ends every task."""
    async with await AsyncSandbox.create(**conn) as sbx:
        dash = SandboxDashboard(sbx, refresh_interval=0.05)
        try:
            await dash._starting
            assert dash.state.selected == sbx.sandbox_id
            task = dash.on_start("sleep 30")
            assert isinstance(task, asyncio.Task)
            info = await task
            assert str(info.pid) in dash.table.value
            # A process started behind the dashboard's back shows up by itself.
            other = await sbx.commands.start("sleep 31")
            deadline = asyncio.get_running_loop().time() + 10
            while "sleep 31" not in dash.table.value:  # what a person sees
                assert asyncio.get_running_loop().time() < deadline, "no auto refresh"
                await asyncio.sleep(0.01)  # sleep-ok: poll interval
            assert other.pid in set(dash.processes_frame()["pid"])
            await sbx.pause()  # behind the dashboard's back: starting fails now
            failing = dash.on_start("true")
            assert isinstance(failing, asyncio.Task)
            with pytest.raises(SandboxPaused):
                await failing
            assert dash.state.error is not None and "SandboxPaused" in dash.status.value
            await sbx.resume()
        finally:
            await dash.aclose()
        assert dash._runtime.tasks == 0
        # The dashboard's own client is closed; the caller's sandbox is still there.
        assert (await sbx.get_info()).state == "running"


# -- StallLab ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_stall_lab_run_fills_result_progress_table_and_plot(
    conn: dict[str, str | None],
) -> None:
    lab = StallLab(policies=("blocking", "cursor"), cycles=1, deadline=1.0, **conn)
    try:
        assert lab.result is None
        assert lab.progress.value == 0
        assert lab.plot.layout.display == "none", "no broken-image icon before a run"
        result = lab.on_run()  # no running loop: runs to the end

        assert isinstance(result, pd.DataFrame)
        assert lab.result is result
        assert list(result["policy"]) == ["blocking", "cursor"]
        assert list(result["ghost"]) == ["pause-snapshot", "pause-snapshot"]
        # The F1 wedge under blocking, none under cursor.
        assert list(result["stalled"]) == [True, False]
        assert lab.progress.max == 2
        assert lab.progress.value == lab.progress.max
        assert lab.state.done == 2 and lab.state.stalled_cycles == 1
        assert "blocking" in lab.table.value and "cursor" in lab.table.value
        assert "1/1" in lab.table.value and "0/1" in lab.table.value
        assert bytes(lab.plot.value).startswith(PNG_MAGIC)
        assert lab.plot.layout.display == "" and lab.plot.layout.max_height == "420px"
        assert "2/2 cycles, 1 stalled" in lab.status.value
        assert not lab.run_button.disabled
    finally:
        lab.close()


@pytest.mark.timeout(60)
def test_stall_lab_reads_its_settings_from_the_widgets(conn: dict[str, str | None]) -> None:
    lab = StallLab(**conn)
    try:
        lab.policies.value = ("cursor",)
        lab.ghost.value = "none"
        lab.cycles.value = 2
        lab.deadline.value = 1.5
        result = lab.on_run()
        assert isinstance(result, pd.DataFrame)
        assert list(result["policy"]) == ["cursor", "cursor"]
        assert set(result["ghost"]) == {"none"}
        assert set(result["deadline"]) == {1.5}
        assert lab.progress.value == lab.progress.max == 2
    finally:
        lab.close()


@pytest.mark.timeout(30)
def test_stall_lab_without_policies_reports_instead_of_running(
    conn: dict[str, str | None],
) -> None:
    lab = StallLab(**conn)
    try:
        lab.policies.value = ()
        with pytest.raises(InvalidArgument):
            lab.on_run()
        assert lab.result is None
        assert lab.state.error == "choose at least one policy"
        assert "at least one policy" in lab.status.value
        assert Sandbox.list(**conn) == []  # nothing was started
    finally:
        lab.close()


@pytest.mark.timeout(30)
def test_stall_lab_shows_and_raises_a_failed_run() -> None:
    # Nobody listens on port 9 of loopback: the run fails with a typed error.
    lab = StallLab(cycles=1, deadline=0.5, url="http://127.0.0.1:9", token="x")
    try:
        with pytest.raises(DaemonUnavailable):
            lab.on_run()
        assert lab.result is None
        assert lab.state.error is not None
        assert "DaemonUnavailable" in lab.status.value
        assert lab.progress.bar_style == "danger"
        assert not lab.running
    finally:
        lab.close()


@pytest.mark.timeout(60)
async def test_stall_lab_on_the_running_loop_counts_cycles_as_they_finish(
    conn: dict[str, str | None],
) -> None:
    """Inside a running loop on_run returns at once with an owned task; the bar moves per
    cycle while the run goes, and the result lands when the task ends."""
    # A cycle takes a few tens of milliseconds here: flush often enough to render each one.
    lab = StallLab(
        policies=("cursor",), ghost="none", cycles=6, deadline=1.0, flush_hz=200.0, **conn
    )
    try:
        seen: list[int] = []  # every value the bar was given, as the front end would get it
        lab.progress.observe(lambda change: seen.append(change["new"]), names="value")
        task = lab.on_run()
        assert isinstance(task, asyncio.Task)
        assert lab.on_run() is task  # a second press does not start a second run
        assert lab.running and lab.run_button.disabled
        result = await task
        assert result is not None and len(result) == 6
        assert lab.result is result
        assert lab.progress.value == 6
        # Intermediate values were rendered while the run went (not only at the end).
        assert set(seen) & {1, 2, 3, 4, 5}, seen
        assert bytes(lab.plot.value).startswith(PNG_MAGIC)
    finally:
        await lab.aclose()


@pytest.mark.timeout(30)
async def test_stall_lab_on_the_running_loop_raises_a_failed_run_from_the_task() -> None:
    lab = StallLab(cycles=1, deadline=0.5, url="http://127.0.0.1:9", token="x")
    try:
        task = lab.on_run()
        assert isinstance(task, asyncio.Task)
        with pytest.raises(DaemonUnavailable):
            await task
        assert lab.result is None and not lab.running
        assert "DaemonUnavailable" in lab.status.value
        assert not lab.run_button.disabled
    finally:
        await lab.aclose()


@pytest.mark.timeout(60)
async def test_stall_lab_close_cancels_a_run_and_kills_its_sandbox(
    conn: dict[str, str | None],
) -> None:
    lab = StallLab(policies=("cursor",), ghost="none", cycles=30, deadline=1.0, **conn)
    task = lab.on_run()
    assert task is not None
    deadline = asyncio.get_running_loop().time() + 20
    while lab.state.done < 1:
        assert asyncio.get_running_loop().time() < deadline, "no cycle finished"
        await asyncio.sleep(0.01)  # sleep-ok: poll interval
    await lab.aclose()
    assert task.done() and task.cancelled()
    sandboxes = await asyncio.to_thread(Sandbox.list, **conn)
    assert sandboxes and all(s.state == "killed" for s in sandboxes)
    assert lab.result is None and not lab.running


def test_stall_lab_close_closes_every_child_widget() -> None:
    lab = StallLab()
    tree = _tree(lab.widget)
    assert len(tree) > 8
    lab.close()
    assert not [w for w in tree if getattr(w, "comm", None) is not None]


# -- whose sandboxes (issue 20) ------------------------------------------------------------


def _made_elsewhere(conn: dict[str, str | None]) -> str:
    """A sandbox an earlier notebook made: created over plain HTTP, never by a client of
    this process."""
    headers = {"authorization": f"Bearer {conn['token']}"}
    with httpx.Client(base_url=str(conn["url"]), headers=headers) as http:
        response = http.post("/sandboxes", json={"timeout": 60})
        response.raise_for_status()
        return str(response.json()["sandbox_id"])


@pytest.mark.timeout(30)
def test_create_then_kill_never_selects_a_sandbox_of_another_notebook(
    dashboard: SandboxDashboard, conn: dict[str, str | None]
) -> None:
    """Issue 20: Create, then Kill selected a sandbox an earlier notebook made, and the
    next Kill or Pause acted on it."""
    other = _made_elsewhere(conn)
    try:
        dashboard.refresh()
        assert other not in set(dashboard.sandboxes_frame()["sandbox_id"])
        assert other not in dashboard.selector.options
        sbx = dashboard.on_create()
        assert sbx is not None
        dashboard.on_kill()
        assert dashboard.state.selected is None and dashboard.sbx is None
        assert "no sandbox selected" in dashboard.title.value
        assert dashboard.kill_button.disabled and dashboard.pause_button.disabled
        with pytest.raises(SandboxNotFound):
            dashboard.on_pause()
        assert _state_of(conn, other) == "running"
        # Killed ones only on request; the other notebook's only with the toggle.
        assert sbx.sandbox_id not in set(dashboard.sandboxes_frame()["sandbox_id"])
        dashboard.show_killed_toggle.value = True  # what a click does
        frame = dashboard.sandboxes_frame().set_index("sandbox_id")
        assert frame.loc[sbx.sandbox_id, "state"] == "killed" and other not in frame.index
        dashboard.show_all_toggle.value = True
        assert other in set(dashboard.sandboxes_frame()["sandbox_id"])
        assert other in dashboard.selector.options
        assert dashboard.state.selected is None  # showing it selects nothing
    finally:
        Sandbox.connect(other, **conn).kill()


@pytest.mark.timeout(30)
def test_hiding_the_selected_sandbox_deselects_it(
    dashboard: SandboxDashboard, conn: dict[str, str | None]
) -> None:
    other = _made_elsewhere(conn)
    try:
        dashboard.on_show_all(True)
        dashboard.refresh()
        dashboard.selector.value = other
        assert dashboard.state.selected == other
        dashboard.on_show_all(False)  # selecting it made it this notebook's: still shown
        assert dashboard.state.selected == other
        mine = dashboard.on_create()
        assert mine is not None
        dashboard.on_kill()
        assert dashboard.state.selected == other  # shown, live: a valid next choice
    finally:
        Sandbox.connect(other, **conn).kill()


@pytest.mark.timeout(30)
def test_a_sandbox_that_did_not_get_isolation_says_so_on_the_dashboard(
    dashboard: SandboxDashboard, daemon: DaemonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandboxkit.daemon import isolation

    monkeypatch.setattr(daemon.host.config, "isolation", "auto")  # the shipped default
    missing = isolation.Probe(False, "user namespaces are disabled (test)")
    monkeypatch.setattr("sandboxkit.daemon.host.probe", lambda: missing)
    monkeypatch.setattr("sandboxkit.daemon.host.resolve_mode", lambda asked: "none")
    monkeypatch.setattr("sandboxkit.client.sandbox._warned_unisolated", True)
    sbx = dashboard.on_create()
    assert sbx is not None and sbx.get_info().isolation == "none"
    dashboard.flush()
    assert "not isolated: user namespaces are disabled (test)" in dashboard.title.value
    assert dashboard.sandboxes_frame().isolation.tolist() == ["none"]
