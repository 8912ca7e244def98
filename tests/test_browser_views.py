"""Every view follows what anyone does, in a real browser (issue 20).

A notebook shows a ``ProcessPanel`` on a ticking process and a ``SandboxDashboard`` on the
same sandbox. The sandbox is paused and resumed from the dashboard (a click in the page),
from code (another Python client) and from the command line (``sandboxkit pause ID`` /
``resume``); each time the panel's status text, as the page shows it, and the dashboard's
title say the new state within 1 s of the action's end. Screenshots of each step go to
``browser-shots/<test name>/`` under pytest's temporary directory (or
``$SANDBOXKIT_SCREENSHOT_DIR``).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import nbformat
import pytest
from jupyter_harness import (
    CHROMIUM,
    CHROMIUM_ARGS,
    JupyterLab,
    daemon_pid,
    deadline_poll,
    descendants,
    describe,
    reap,
    snapshot_pids,
    still_alive,
    stop_daemon,
    suspects,
)
from test_browser import _require_browser_stack

from sandboxkit import Sandbox
from sandboxkit.statefile import read_state

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "views_follow.ipynb"
PANEL = ".sandboxkit-panel"
STATUS = ".sandboxkit-status"
DASHBOARD = ".sandboxkit-dashboard"
REPO = Path(__file__).resolve().parent.parent

SETUP = '''\
import sys
from IPython.display import display
from sandboxkit import Sandbox
from sandboxkit.notebook import ProcessPanel, SandboxDashboard

sbx = Sandbox.create(timeout=600)  # ends by itself if this test forgets it
TICKER = """
import time
for i in range(10**6):
    print(f"line {i}", flush=True)
    time.sleep(0.05)  # sleep-ok: the child process's pace
"""
ticker = sbx.commands.run([sys.executable, "-u", "-c", TICKER], background=True)
ticker.disconnect()
panel = ProcessPanel(sbx, ticker.pid, rows=8)
dashboard = SandboxDashboard(sbx)
display(panel, dashboard.widget)
'''


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """The module's server, kernel and browser are checked for leftovers by ``page``."""
    yield


@dataclass
class Notebook:
    page: Page
    state_file: Path
    """The notebook kernel's daemon's state file."""


@pytest.fixture
def notebook(tmp_path: Path) -> Iterator[Notebook]:
    """The notebook, run, in chromium; at the end everything it started is ended and the
    test fails if anything is left running."""
    _require_browser_stack()
    from playwright.sync_api import sync_playwright

    before = snapshot_pids()
    state_file = tmp_path / "sandboxkit" / "daemon.json"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SETUP)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(nb, tmp_path / NOTEBOOK)
    server = JupyterLab(
        tmp_path / "lab",
        [tmp_path / NOTEBOOK],
        extra_env={"SANDBOXKIT_STATE_FILE": str(state_file)},
        windowing_mode="none",
    )
    tracked = []
    try:
        server.start().wait_ready(timeout=90)
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"),
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1300, "height": 1000},
            )
            context.set_default_timeout(30_000)
            try:
                page = context.new_page()
                page.goto(server.lab_url(NOTEBOOK), wait_until="domcontentloaded")
                page.locator(".jp-Notebook .jp-Cell").first.wait_for(
                    state="visible", timeout=60_000
                )
                kernel = deadline_poll(lambda: server.kernel_for(NOTEBOOK), 60, "the kernel")
                deadline_poll(lambda: server.kernel_state(str(kernel)) == "idle", 60, "idle")
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(
                    ".lm-Menu-item:not(.lm-mod-hidden) .lm-Menu-itemLabel",
                    has_text="Run All Cells",
                ).first.click()
                page.locator(f"{DASHBOARD} button", has_text="Pause").wait_for(timeout=60_000)
                yield Notebook(page, state_file)
            finally:
                tracked += [p for p in descendants(os.getpid()) if p.pid != os.getpid()]
                context.close()
    finally:
        tracked += descendants(server.proc.pid if server.proc else None)
        tracked += descendants(daemon_pid(state_file))
        server.stop()
        if state_file.exists():
            stop_daemon(state_file)
        left = still_alive(p for p in tracked if p.pid != os.getpid())
        left += suspects(str(tmp_path), before)
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.1)  # sleep-ok: a poll with a deadline
            left = still_alive(left)
        if left:
            names = describe(left)
            reap(left)
            pytest.fail(f"the browser test left processes running: {names}")


def _shot(page: Page, request: pytest.FixtureRequest, name: str) -> Path:
    root = os.environ.get("SANDBOXKIT_SCREENSHOT_DIR")
    base = Path(root) if root else request.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    folder = base / "browser-shots" / re.sub(r"[^\w.-]", "_", request.node.name)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with contextlib.suppress(Exception):
        page.screenshot(path=str(path))
    return path


def panel_status(page: Page) -> str:
    """The panel's status line as the page shows it."""
    return str(page.locator(f"{PANEL} {STATUS}").first.inner_text())


def dashboard_title(page: Page) -> str:
    return str(page.locator(DASHBOARD).first.inner_text()).split("\n", 1)[0]


def shows_within(page: Page, state: str, seconds: float) -> float:
    """Seconds until both the panel's status and the dashboard's title say ``state``;
    fails after ``seconds``."""
    started = time.monotonic()
    while True:
        status, title = panel_status(page), dashboard_title(page)
        if f" · {state} · " in status and f" is {state}" in title:
            return time.monotonic() - started
        if time.monotonic() - started > seconds:
            raise AssertionError(
                f"not {state} within {seconds:g} s: panel {status!r}, dashboard {title!r}"
            )
        page.wait_for_timeout(20)  # sleep-ok: a poll of the page with a deadline


@pytest.mark.timeout(240)
def test_pause_and_resume_from_anywhere_show_in_the_panel_within_1s(
    notebook: Notebook, request: pytest.FixtureRequest
) -> None:
    page, state_file = notebook.page, notebook.state_file
    state = read_state(state_file)
    assert state is not None
    (info,) = [s for s in Sandbox.list(url=state.url, token=state.token) if s.state != "killed"]
    sandbox_id = info.sandbox_id
    code = Sandbox.connect(sandbox_id, url=state.url, token=state.token)
    env = {**os.environ, "SANDBOXKIT_STATE_FILE": str(state_file)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))

    def click(label: str) -> Callable[[], None]:
        def act() -> None:
            page.locator(f"{DASHBOARD} button", has_text=label).first.click()

        return act

    def cli(action: str) -> Callable[[], None]:
        def act() -> None:
            subprocess.run(
                [sys.executable, "-m", "sandboxkit", action, sandbox_id],
                env=env,
                check=True,
                capture_output=True,
                timeout=60,
            )

        return act

    steps = [
        ("dashboard", click("Pause"), "paused"),
        ("dashboard", click("Resume"), "running"),
        ("code", code.pause, "paused"),
        ("code", code.resume, "running"),
        ("cli", cli("pause"), "paused"),
        ("cli", cli("resume"), "running"),
    ]
    took: list[tuple[str, str, float]] = []
    try:
        shows_within(page, "running", 30)
        for actor, act, shown in steps:
            act()
            took.append((actor, shown, round(shows_within(page, shown, 1.0), 3)))
            _shot(page, request, f"{len(took)}-{actor}-{shown}.png")
            if shown == "running":  # output flows again, and the status still says so
                count = panel_status(page)
                page.wait_for_timeout(1500)  # sleep-ok: watch the status while output flows
                assert " · running · " in panel_status(page), (count, panel_status(page))
    except BaseException:
        _shot(page, request, "failure.png")
        raise
    finally:
        code.close()
    print(f"\nseconds from each action to the page showing it: {took}")
