"""What a person sees of the live widgets, in a real browser.

One notebook for the module on the run's JupyterLab (the ``jupyter`` fixture: on
127.0.0.1, everything under one temporary directory) and Debian's chromium
(``/usr/bin/chromium``; never ``playwright install``) driven by Playwright. A generated
notebook starts a sandbox with a ticking process (``line N t=<time printed>``, 20 lines a
second), a ``ProcessPanel`` and a ``BackpressureChart`` on it, and a second panel on a
``tqdm`` loop. The tests read the terminal's visible rows from the DOM (xterm.js's
``.xterm-rows``), the status text and the chart's canvas pixels — never an internal
counter — in JupyterLab's default notebook windowing mode and in ``none``.

Each test saves a screenshot when it fails, into ``browser-shots/<test name>/`` under
pytest's temporary directory (or ``$SANDBOXKIT_SCREENSHOT_DIR/<test name>/``).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from jupyter_harness import (
    PANEL,
    ROWS,
    rows_of,
    screenshot_on_failure,
    status_of,
    wait_rows,
    wait_status,
)

if TYPE_CHECKING:
    from jupyter_harness import Notebook, SharedLab
    from playwright.sync_api import Browser, BrowserContext, Page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "widgets_live.ipynb"

SETUP = '''\
import sys
from IPython.display import display
from sandboxkit import Sandbox
from sandboxkit.notebook import BackpressureChart, LifecycleTimeline, ProcessPanel

sbx = Sandbox.create(timeout=600)  # ends by itself if this test forgets it
TICKER = """
import time
for i in range(10**6):
    print(f"line {i} t={time.time():.3f}", flush=True)
    time.sleep(0.05)  # sleep-ok: the child process's pace
"""
ticker = sbx.commands.run([sys.executable, "-u", "-c", TICKER], background=True)
ticker.disconnect()
panel = ProcessPanel(sbx, ticker.pid)
chart = BackpressureChart(sbx, panel)
timeline = LifecycleTimeline(sbx)
display(panel, chart, timeline)
'''

TQDM = '''\
BAR = """
import time
from tqdm import tqdm
for _ in tqdm(range(150), mininterval=0.02, ncols=70, ascii=True):
    time.sleep(0.01)  # sleep-ok: the child process's pace
print("tqdm done", flush=True)
"""
bar = sbx.commands.run([sys.executable, "-u", "-c", BAR], background=True)
bar.disconnect()
bar_panel = ProcessPanel(sbx, bar.pid, rows=6)
bar_panel
'''

# Record, for every "line N t=T" row, when it first showed in the viewport (page clock).
_JS_WATCH = """
([n]) => {
  const rows = document.querySelectorAll(".sandboxkit-panel")[n].querySelector(".xterm-rows");
  const seen = new Map();
  const scan = () => {
    const now = Date.now() / 1000;
    for (const r of rows.children) {
      const m = r.textContent.match(/line (\\d+) t=([\\d.]+)/);
      if (m && !seen.has(+m[1])) seen.set(+m[1], [parseFloat(m[2]), now]);
    }
  };
  scan();
  const first = new Set(seen.keys());
  const obs = new MutationObserver(scan);
  obs.observe(rows, { subtree: true, childList: true, characterData: true });
  window.__sbxWatch = () => {
    obs.disconnect();
    return [...seen.entries()].filter(([k]) => !first.has(k)).map(([k, [t, s]]) => [k, t, s]);
  };
}
"""


def _line_numbers(rows: list[str]) -> list[int]:
    return [int(m.group(1)) for r in rows if (m := re.search(r"line (\d+) t=", r))]


class Lab:
    """The module's notebook on the run's JupyterLab, and its browser context."""

    def __init__(self, notebook: Notebook, context: BrowserContext) -> None:
        self.notebook = notebook
        self.server = notebook.server
        self.state_file = notebook.state_file
        self.context = context
        self.page: Page | None = None
        self.mode: str | None = "unset"

    def open(self, mode: str | None) -> Page:
        """The notebook, run, in windowing ``mode`` (reused while the mode is the same)."""
        if self.page is not None and mode == self.mode:
            return self.page
        if self.page is not None:
            self.page.close()
            self.server.shutdown_sessions(self.notebook.path)
        self.mode = mode
        page = self.notebook.open(self.context, windowing_mode=mode)
        page.locator(f"{PANEL} {ROWS}").nth(1).wait_for(state="attached", timeout=60_000)
        self.page = page
        return page


@contextlib.contextmanager
def running(jupyter: SharedLab, browser: Browser) -> Iterator[Lab]:
    """The module's notebook and a browser context; at the end, everything they started
    is ended and the test fails if anything is left running (``SharedLab.notebook``)."""
    context = browser.new_context(viewport={"width": 1300, "height": 1100})
    context.set_default_timeout(30_000)
    with contextlib.closing(context), jupyter.notebook([SETUP, TQDM], NOTEBOOK) as nb:
        yield Lab(nb, context)


@pytest.fixture(scope="module")
def lab(jupyter: SharedLab, browser: Browser) -> Iterator[Lab]:
    with running(jupyter, browser) as session:
        yield session


MODES = [pytest.param(None, id="default-windowing"), pytest.param("none", id="windowing-none")]


def assert_new_lines_show_within_a_second(page: Page, seconds: float, at_least: int) -> None:
    """Watch the terminal for ``seconds``: at least ``at_least`` new ticker lines show, none
    is skipped, each within 1 s of the time it was printed, and the newest is in view."""
    wait_rows(page, lambda r: len(_line_numbers(r)) >= 5, 30, "ticker lines on screen")
    page.evaluate(_JS_WATCH, [0])
    page.wait_for_timeout(seconds * 1000)  # sleep-ok: the observation window
    seen = page.evaluate("() => window.__sbxWatch()")
    assert len(seen) >= at_least, f"only {len(seen)} new lines showed in {seconds} s"
    numbers = sorted(n for n, _, _ in seen)
    assert numbers == list(range(numbers[0], numbers[-1] + 1)), "a line never showed"
    late = [(n, round(shown - printed, 3)) for n, printed, shown in seen]
    worst = max(d for _, d in late)
    assert worst <= 1.0, f"lines showed up to {worst:.2f}s after printing: {late}"
    assert _line_numbers(rows_of(page))[-1] >= numbers[-1], "the newest line is in view"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", MODES)
def test_newest_line_is_in_view_within_a_second(
    lab: Lab, mode: str | None, request: pytest.FixtureRequest
) -> None:
    page = lab.open(mode)
    with screenshot_on_failure(page, request):
        page.locator(PANEL).first.scroll_into_view_if_needed()
        assert_new_lines_show_within_a_second(page, seconds=4, at_least=40)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_scrolling_up_stops_following_and_the_toggle_resumes(
    lab: Lab, mode: str | None, request: pytest.FixtureRequest
) -> None:
    page = lab.open(mode)
    with screenshot_on_failure(page, request):
        panel = page.locator(PANEL).first
        panel.scroll_into_view_if_needed()
        wait_rows(
            page,
            lambda r: len(_line_numbers(r)) >= 15 and _line_numbers(r)[-1] >= 80,
            30,
            "a scrollback to scroll into",
        )
        box = panel.locator(".sandboxkit-term").bounding_box()
        assert box is not None
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.wheel(0, -400)
        follow = panel.locator(".sandboxkit-follow")
        page.wait_for_function(
            "() => document.querySelector('.sandboxkit-term-root').dataset.following === '0'",
            timeout=2000,
        )
        assert "paused" in follow.inner_text()
        frozen = _line_numbers(rows_of(page))
        page.wait_for_timeout(1500)  # sleep-ok: output flows meanwhile (20 lines/s)
        assert _line_numbers(rows_of(page)) == frozen, "the view moved while not following"
        follow.click()
        rows = wait_rows(
            page,
            lambda r: _line_numbers(r) and _line_numbers(r)[-1] > frozen[-1] + 25,
            1.0,
            "the newest line after the toggle",
        )
        assert "following" in follow.inner_text()
        newest = re.search(r"t=([\d.]+)", [r for r in rows if "line " in r][-1])
        assert newest and time.time() - float(newest.group(1)) < 1.5


@pytest.mark.timeout(120)
def test_tqdm_leaves_one_line(lab: Lab, request: pytest.FixtureRequest) -> None:
    page = lab.open("none")
    with screenshot_on_failure(page, request):
        page.locator(PANEL).nth(1).scroll_into_view_if_needed()
        rows = wait_rows(page, lambda r: any("tqdm done" in x for x in r), 30, "tqdm", n=1)
        bars = [r for r in rows if "it/s" in r or "%|" in r]
        assert len(bars) == 1, rows
        assert "150/150" in bars[0] and "100%" in bars[0], bars


@pytest.mark.timeout(120)
def test_buttons_change_the_status_and_the_chart_follows(
    lab: Lab, request: pytest.FixtureRequest
) -> None:
    page = lab.open("none")
    with screenshot_on_failure(page, request):
        panel = page.locator(PANEL).first
        panel.scroll_into_view_if_needed()
        text = wait_status(page, r" · running · ", 30, "running")
        pid = int(re.search(r"pid (\d+)", text).group(1))  # type: ignore[union-attr]

        panel.get_by_role("button", name="Pause").click()
        try:
            wait_status(page, r" · paused · ", 1.0, "paused within 1 s of Pause")
            page.wait_for_timeout(300)  # sleep-ok: lines already in flight land
            frozen = _line_numbers(rows_of(page))
            page.wait_for_timeout(800)  # sleep-ok: a paused process prints nothing
            assert _line_numbers(rows_of(page)) == frozen, "output went on while paused"
        except BaseException:
            panel.get_by_role("button", name="Resume").click()  # leave it running
            raise
        panel.get_by_role("button", name="Resume").click()
        wait_status(page, r" · running · ", 1.0, "running within 1 s of Resume")
        wait_rows(page, lambda r: _line_numbers(r)[-1] > frozen[-1] + 5, 3, "output again")

        panel.get_by_role("button", name="Kill-restart").click()
        text = wait_status(page, rf"pid (?!{pid}\b)\d+ · running", 5, "the new pid")
        new = int(re.search(r"pid (\d+)", text).group(1))  # type: ignore[union-attr]
        wait_rows(
            page, lambda r: any(f"now following pid {new}" in x for x in r), 3, "restart mark"
        )
        wait_rows(page, lambda r: "line 5 " in " ".join(r), 5, "the new process's lines")
        title = page.locator(".sandboxkit-chart-title").first
        page.wait_for_function(
            "([el, pid]) => el.textContent.includes('process ' + pid)",
            arg=[title.element_handle(), new],
            timeout=3000,
        )


_JS_CANVAS = """
(sel) => {
  const c = document.querySelector(sel + " canvas");
  if (!c || !c.width) return null;
  const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let ink = 0;
  for (let i = 3; i < px.length; i += 4) if (px[i] > 0) ink++;
  return { ink, url: c.toDataURL(), width: c.width, css: c.clientWidth };
}
"""


@pytest.mark.timeout(120)
def test_chart_canvas_is_drawn_crisp_and_moves_while_output_flows(
    lab: Lab, request: pytest.FixtureRequest
) -> None:
    page = lab.open("none")
    with screenshot_on_failure(page, request):
        page.locator(".sandboxkit-backpressure").first.scroll_into_view_if_needed()
        chart = ".sandboxkit-backpressure"
        first = page.evaluate(_JS_CANVAS, chart)
        deadline = time.monotonic() + 10
        while not (first and first["ink"] > 1000):
            assert time.monotonic() < deadline, f"the chart's canvas stays empty: {first}"
            page.wait_for_timeout(100)  # sleep-ok: a poll of the page with a deadline
            first = page.evaluate(_JS_CANVAS, chart)
        timeline = page.evaluate(_JS_CANVAS, ".sandboxkit-timeline")
        assert timeline and timeline["ink"] > 1000, "the timeline's canvas is empty"
        # Drawn at the device's pixel ratio, to the width it is shown at (not stretched).
        ratio = page.evaluate("() => window.devicePixelRatio")
        assert abs(first["width"] - first["css"] * ratio) <= 2, first
        page.wait_for_timeout(2000)  # sleep-ok: output flows meanwhile
        second = page.evaluate(_JS_CANVAS, chart)
        assert second["url"] != first["url"], "the chart did not move while output flowed"
        # No new events meanwhile, yet the timeline's time axis moved on.
        later = page.evaluate(_JS_CANVAS, ".sandboxkit-timeline")
        assert later["url"] != timeline["url"], "the timeline's axis froze between events"
        page.locator(".sandboxkit-timeline").first.scroll_into_view_if_needed()
        legend = page.locator(".sandboxkit-backpressure .sandboxkit-chart-label").all_inner_texts()
        assert any(t.startswith("panel") for t in legend), legend


@pytest.mark.timeout(120)
def test_a_reloaded_page_gets_the_tail_then_the_new_output(
    lab: Lab, request: pytest.FixtureRequest
) -> None:
    page = lab.open("none")
    with screenshot_on_failure(page, request):
        before = _line_numbers(
            wait_rows(page, lambda r: len(_line_numbers(r)) >= 10, 30, "ticker lines")
        )
        # Save (outputs hold the widget views' model ids), then reload the page.
        page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
        page.keyboard.press("Control+s")
        page.locator(".jp-mod-dirty").first.wait_for(state="detached", timeout=15_000)
        page.reload(wait_until="domcontentloaded")
        # The views render again from the kernel's widgets: a snapshot of the byte tail
        # first (the lines from before the reload), then the deltas.
        page.locator(f"{PANEL} {ROWS}").first.wait_for(state="attached", timeout=60_000)
        page.locator(PANEL).first.scroll_into_view_if_needed()
        rows = wait_rows(
            page,
            lambda r: len(_line_numbers(r)) >= 10 and _line_numbers(r)[-1] > before[-1] + 10,
            15,
            "the tail and new output after the reload",
        )
        shown = _line_numbers(rows)
        assert shown == list(range(shown[0], shown[-1] + 1)), "a gap or duplicate in view"
        page.evaluate("() => document.querySelector('.sandboxkit-term').scrollIntoView()")
        text = status_of(page)
        assert re.search(r"pid \d+ · running · ", text), text
