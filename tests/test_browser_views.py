"""Every view follows what anyone does, in a real browser (issue 20).

A notebook shows a ``ProcessPanel`` on a ticking process and a ``SandboxDashboard`` on the
same sandbox. The sandbox is paused and resumed from the dashboard (a click in the page),
from code (another Python client) and from the command line (``sandboxkit pause ID`` /
``resume``); each time the panel's status text, as the page shows it, and the dashboard's
title say the new state within 1 s of the action's end.

A lab notebook (the ``blocking`` policy of notebooks 02/04) detaches and reattaches its
panel: the output it skipped shows as a marker of its size in the panel's own terminal,
and no warning box lands under another cell; a flood under a rate cap shows its skip
marker in the status line's cursor unit.

Screenshots go to ``browser-shots/<test name>/`` under pytest's temporary directory (or
``$SANDBOXKIT_SCREENSHOT_DIR``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from jupyter_harness import shot

from sandboxkit import Sandbox
from sandboxkit.statefile import read_state

if TYPE_CHECKING:
    from jupyter_harness import SharedLab
    from playwright.sync_api import Browser, Page

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


LAB = '''\
import sys
from sandboxkit import Sandbox
from sandboxkit.lab_options import LabOptions
from sandboxkit.notebook import ProcessPanel

# Notebooks 02/04: the blocking policy, which (as E2B) delivers new output only.
lab = Sandbox.create(timeout=600, lab=LabOptions(fanout="blocking"))
COUNTER = """
import time
for i in range(10**6):
    print(f"line {i}", flush=True)
    time.sleep(0.02)  # sleep-ok: the child process's pace
"""
# Its own handle may miss its first line to the policy (a loaded machine starts it before
# the stream attaches): not what is looked at here, and it lets go at once.
counter = lab.commands.run(
    [sys.executable, "-u", "-c", COUNTER], background=True, on_gap=lambda _gap: None
)
counter.disconnect()
lab_panel = ProcessPanel(lab, counter.pid, rows=8)
lab_panel
'''

FLOOD = """\
# Lines of ~110 bytes: the last flush's ~1 kB (the cap's share) and its marker fit in view.
# (Its first second lets the panel attach first: blocking delivers new output only.)
FLOOD = (
    "import time; time.sleep(1)\\n"  # sleep-ok: see above
    "for i in range(100000): print(f'flood {i:06d} ' + 'x' * 96)"
)
flood = lab.commands.run([sys.executable, "-c", FLOOD], background=True)
flood.disconnect()
flood_panel = ProcessPanel(lab, flood.pid, rows=12, rate_cap=10 * 1024)
flood_panel
"""

UNRELATED = 'print("an unrelated cell")'


@dataclass
class Notebook:
    page: Page
    state_file: Path
    """The notebook kernel's daemon's state file."""


@pytest.fixture
def notebook(jupyter: SharedLab, browser: Browser) -> Iterator[Notebook]:
    """The notebook of the pause/resume test, run, in chromium."""
    yield from _notebook(jupyter, browser, [SETUP], f"{DASHBOARD} button")


@pytest.fixture
def lab_notebook(jupyter: SharedLab, browser: Browser) -> Iterator[Notebook]:
    """A lab notebook: the blocking policy's panel, a flood under a rate cap, and an
    unrelated cell after them."""
    yield from _notebook(jupyter, browser, [LAB, FLOOD, UNRELATED], f"{PANEL} .xterm-rows")


def _notebook(
    jupyter: SharedLab, browser: Browser, cells: list[str], ready: str
) -> Iterator[Notebook]:
    """``cells``, run, in chromium, once ``ready`` shows (a notebook, kernel and daemon
    of its own: see ``SharedLab.notebook``)."""
    context = browser.new_context(viewport={"width": 1300, "height": 1000})
    context.set_default_timeout(30_000)
    try:
        with jupyter.notebook(cells, NOTEBOOK) as nb:
            page = nb.open(context, ready=ready, windowing_mode="none")
            yield Notebook(page, nb.state_file)
    finally:
        context.close()


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
            shot(page, request, f"{len(took)}-{actor}-{shown}.png")
            if shown == "running":  # output flows again, and the status still says so
                count = panel_status(page)
                page.wait_for_timeout(1500)  # sleep-ok: watch the status while output flows
                assert " · running · " in panel_status(page), (count, panel_status(page))
    except BaseException:
        shot(page, request, "failure.png")
        raise
    finally:
        code.close()
    print(f"\nseconds from each action to the page showing it: {took}")


def rows_of(page: Page, n: int) -> list[str]:
    rows = page.locator(PANEL).nth(n).locator(".xterm-rows > div").all_inner_texts()
    return [r.replace("\u00a0", " ") for r in rows]


def wait_rows(page: Page, n: int, pattern: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        rows = rows_of(page, n)
        if any(re.search(pattern, r) for r in rows):
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"no row matches {pattern!r} within {seconds:g} s: {rows}")
        page.wait_for_timeout(50)  # sleep-ok: a poll of the page with a deadline


def panel_status_n(page: Page, n: int) -> str:
    return str(page.locator(f"{PANEL} {STATUS}").nth(n).inner_text())


def wait_status_text(page: Page, n: int, text: str, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while True:
        status = panel_status_n(page, n)
        if text in status:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in the status within {seconds:g} s: {status!r}")
        page.wait_for_timeout(20)  # sleep-ok: a poll of the page with a deadline


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, (pattern, text)
    return int(match.group(1))


@pytest.mark.timeout(240)
def test_lab_loss_is_a_marker_in_the_panel_in_the_status_lines_units(
    lab_notebook: Notebook, request: pytest.FixtureRequest
) -> None:
    """Notebooks 02/04: a Reattach under the blocking policy skips output; the panel says
    so with a marker of the exact size in its own terminal, and no warning box lands
    under another cell. The rate cap's skip marker counts cursors as the status line
    does (chunk numbers), not byte offsets."""
    page, state_file = lab_notebook.page, lab_notebook.state_file
    state = read_state(state_file)
    assert state is not None
    try:
        wait_rows(page, 0, r"line \d+", 30)
        panel = page.locator(PANEL).first
        panel.locator("button", has_text="Detach").click()
        wait_status_text(page, 0, "detached", 10)
        (sbx_info,) = Sandbox.list(url=state.url, token=state.token)
        lab = Sandbox.connect(sbx_info.sandbox_id, url=state.url, token=state.token)
        try:
            pid = _number(r"pid (\d+)", panel_status_n(page, 0))
            head = lab.commands.get(pid).head
            deadline = time.monotonic() + 10
            while lab.commands.get(pid).head < head + 20:  # output the panel does not read
                assert time.monotonic() < deadline, "no output while detached"
                page.wait_for_timeout(50)  # sleep-ok: a poll of the daemon with a deadline
            # The counter ends here, so that its next lines cannot scroll the marker out
            # of the panel's 8 rows before it is read (50 lines a second). Not a pause:
            # under ``blocking`` a pause-snapshot ghost would wedge the flood below (F1).
            lab.commands.kill(pid)
            poll_until = time.monotonic() + 10
            while lab.commands.get(pid).state != "exited":
                assert time.monotonic() < poll_until, "the counter did not exit"
                page.wait_for_timeout(50)  # sleep-ok: a poll of the daemon with a deadline
            panel.locator("button", has_text="Reattach").click()
            rows = wait_rows(page, 0, r"bytes lost: not replayed", 10)
        finally:
            lab.close()
        marker = next(r for r in rows if "bytes lost" in r)
        assert re.search(r"… \d+ bytes lost: not replayed: .* \(cursor \d+–\d+\)", marker), marker
        boxes = page.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        assert boxes.count() == 0, boxes.all_inner_texts()
        # The flood's skip marker: cursor numbers no larger than the status line's cursor.
        wait_rows(page, 1, r"bytes skipped \(cursor \d+–\d+\)", 60)
        # Compared once the flood ended: the status line then says the last cursor.
        wait_status_text(page, 1, "exited", 60)
        rows = wait_rows(page, 1, r"bytes skipped \(cursor \d+–\d+\)", 10)
        status = panel_status_n(page, 1)
        cursor = _number(r"cursor (\d+)", status)
        for row in rows:
            if (m := re.search(r"bytes skipped \(cursor (\d+)–(\d+)\)", row)) is not None:
                a, b = int(m.group(1)), int(m.group(2))
                assert a < b <= cursor, (row, status)
        print(f"\nlab marker: {marker!r}; flood status: {status!r}")
        panel.scroll_into_view_if_needed()
        shot(page, request, "lab-markers.png")
    except BaseException:
        shot(page, request, "failure.png")
        raise
