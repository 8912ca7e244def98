"""What a person sees of a panel and a chart on an E2B sandbox, in a real browser.

A notebook in a throwaway JupyterLab (Debian's chromium, driven by Playwright) starts a
daemon with its envd endpoint (standing in for E2B's envd), a process there, and then
watches that process through the E2B provider: the official ``e2b`` SDK in debug mode.
The provider attached after the process printed its first line, which E2B cannot replay:
the terminal must say output may be missing, with no number, and the chart's title must
say its metrics are client-side only. A screenshot is saved for a person to look at.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

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
from test_browser_widgets import _shot, rows_of, status_of

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "e2b_panel.ipynb"

CELL = """\
import asyncio, atexit, sys, time
from IPython.display import display
from sandboxkit import Sandbox
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.notebook import BackpressureChart, ProcessPanel

daemon = DaemonServer(envd_port=0).start()  # stands in for E2B's envd
atexit.register(daemon.stop)  # the kernel's shutdown ends its processes
home = Sandbox.create(url=daemon.url, token=daemon.token)
# One line, then (once the panel is attached: the file "go") ten more, then quiet: all of
# it fits the terminal's rows, however late the view renders.
TICKER = '''
import os, time
print('printed before anyone attached', flush=True)
while not os.path.exists('go'):
    time.sleep(0.02)  # sleep-ok: the child polls for the file the cell writes once attached
for i in range(10):
    print(f'line {i}', flush=True)
time.sleep(120)  # sleep-ok: stays alive and quiet until the test ends the sandbox
'''
info = home.commands.start([sys.executable, "-u", "-c", TICKER])
while home.commands.get(info.pid).head == 0:
    time.sleep(0.02)  # sleep-ok: until the first line was printed, nobody attached
sbx = Sandbox.create(provider="e2b", url=f"{daemon.envd.url}/sandboxes/{home.sandbox_id}/live")
panel = ProcessPanel(sbx, info.pid)
chart = BackpressureChart(sbx, panel)
display(panel, chart)
while not panel.state.attached:  # the attach runs on this (the kernel's) loop
    await asyncio.sleep(0.02)  # sleep-ok: lets it run
_ = home.files.write("go", "")
"""


@contextlib.contextmanager
def lab_page(base: Path) -> Iterator[object]:
    """The notebook, run in JupyterLab and chromium; at the end everything they started
    is ended, and the test fails if anything is left running."""
    from playwright.sync_api import sync_playwright

    before = snapshot_pids()
    state_file = base / "sandboxkit" / "daemon.json"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    base.mkdir(parents=True, exist_ok=True)
    source = base / NOTEBOOK
    nbformat.write(nb, source)
    server = JupyterLab(
        base / "lab", [source], extra_env={"SANDBOXKIT_STATE_FILE": str(state_file)}
    )
    tracked = []
    try:
        server.start().wait_ready(timeout=90)
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                str(base / "chromium-profile"),
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1300, "height": 1350},
            )
            context.set_default_timeout(30_000)
            try:
                page = context.new_page()
                page.goto(server.lab_url(NOTEBOOK), wait_until="domcontentloaded")
                page.locator(".jp-Notebook .jp-Cell").first.wait_for(state="visible")
                kernel = deadline_poll(lambda: server.kernel_for(NOTEBOOK), 60, "the kernel")
                deadline_poll(lambda: server.kernel_state(str(kernel)) == "idle", 60, "idle")
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(
                    ".lm-Menu-item:not(.lm-mod-hidden) .lm-Menu-itemLabel",
                    has_text="Run All Cells",
                ).first.click()
                page.locator(".sandboxkit-panel .xterm-rows").first.wait_for(
                    state="attached", timeout=60_000
                )
                yield page
            finally:
                tracked += [p for p in descendants(os.getpid()) if p.pid != os.getpid()]
                server.shutdown_kernels()
                context.close()
    finally:
        tracked += descendants(server.proc.pid if server.proc else None)
        server.stop()
        if state_file.exists():
            tracked += descendants(daemon_pid(state_file))
            stop_daemon(state_file)
        left = still_alive(p for p in tracked if p.pid != os.getpid())
        left += suspects(str(base), before)
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.1)  # sleep-ok: a poll with a deadline
            left = still_alive(left)
        if left:
            names = describe(left)
            reap(left)
            pytest.fail(f"the browser test left processes running: {names}")


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """The suite's per-test check is replaced by ``lab_page``'s, which knows the kernel."""
    yield


@pytest.mark.timeout(240)
def test_an_e2b_panel_shows_an_unknown_gap_and_a_client_side_chart(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    _require_browser_stack("e2b")
    with lab_page(tmp_path / "e2b-browser") as page:
        deadline = time.monotonic() + 30
        rows: list[str] = []
        while time.monotonic() < deadline:
            rows = rows_of(page)  # type: ignore[arg-type]
            if "line 9" in rows:
                break
            page.wait_for_timeout(50)  # type: ignore[attr-defined]  # sleep-ok: a poll
        try:
            text = "\n".join(rows)
            assert "line 9" in rows, rows  # the output after the attach, all of it
            assert "output may be missing here, amount unknown" in text, rows
            assert "bytes lost" not in text, rows
            assert "printed before anyone attached" not in text, rows
            assert "pid " in status_of(page)  # type: ignore[arg-type]
            title = page.locator(".sandboxkit-backpressure").inner_text()  # type: ignore[attr-defined]
            assert "client-side only" in title, title
        except BaseException:
            _shot(page, request, "failure.png")  # type: ignore[arg-type]
            raise
        _shot(page, request, "passed.png")  # type: ignore[arg-type]
