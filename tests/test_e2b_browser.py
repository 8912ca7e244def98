"""What a person sees of a panel and a chart on an E2B sandbox, in a real browser.

A notebook in the run's JupyterLab (Debian's chromium, driven by Playwright) starts a
daemon with its envd endpoint (standing in for E2B's envd), a process there, and then
watches that process through the E2B provider: the official ``e2b`` SDK in debug mode.
The provider attached after the process printed its first line, which E2B cannot replay:
the terminal must say output may be missing, with no number, and the chart's title must
say its metrics are client-side only. A screenshot is saved for a person to look at.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import pytest
from jupyter_harness import require_browser_stack, rows_of, shot, status_of

if TYPE_CHECKING:
    from jupyter_harness import SharedLab
    from playwright.sync_api import Browser

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


@pytest.mark.timeout(240)
def test_an_e2b_panel_shows_an_unknown_gap_and_a_client_side_chart(
    jupyter: SharedLab, browser: Browser, request: pytest.FixtureRequest
) -> None:
    require_browser_stack("e2b")
    context = browser.new_context(viewport={"width": 1300, "height": 1350})
    context.set_default_timeout(30_000)
    with contextlib.closing(context), jupyter.notebook([CELL], NOTEBOOK) as nb:
        page = nb.open(context, ready=".sandboxkit-panel .xterm-rows")
        deadline = time.monotonic() + 30
        rows: list[str] = []
        while time.monotonic() < deadline:
            rows = rows_of(page)
            if "line 9" in rows:
                break
            page.wait_for_timeout(50)  # sleep-ok: a poll
        try:
            text = "\n".join(rows)
            assert "line 9" in rows, rows  # the output after the attach, all of it
            assert "output may be missing here, amount unknown" in text, rows
            assert "bytes lost" not in text, rows
            assert "printed before anyone attached" not in text, rows
            assert "pid " in status_of(page)
            title = page.locator(".sandboxkit-backpressure").inner_text()
            assert "client-side only" in title, title
        except BaseException:
            shot(page, request, "failure.png")
            raise
        shot(page, request, "passed.png")
