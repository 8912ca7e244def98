"""The widgets' small on-screen details, read from a real browser page.

Each widget's own front end (its ``_esm`` and ``_css``, and the vendored libraries' model it
references: exactly what a notebook gets) is rendered by Debian's chromium
(``/usr/bin/chromium``, driven by Playwright) into a bare page, with a stand-in for the
anywidget model (and its ``widget_manager``) that delivers the kernel's messages the test
writes. No JupyterLab, kernel or daemon: each test takes about
a second. What is asserted is what a person sees: a canvas's width on the page, the colour
of the pixels inside and outside the plot area, the rows of the terminal's viewport, where
a character is drawn.

``$SANDBOXKIT_SCREENSHOT_DIR`` set: every test saves a screenshot into
``<dir>/details/<test name>.png`` (for a person to look at).
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sandboxkit.notebook._frontend import FrontendLibraries, libraries
from sandboxkit.notebook.charts import ChartWidget
from sandboxkit.notebook.panel import PanelState, TerminalWidget
from sandboxkit.vocab import FINAL_CONSUMER_STATES, STATE_COLORS

if TYPE_CHECKING:
    from jupyter_harness import SharedLab
    from playwright.sync_api import Browser, Page

pytestmark = [pytest.mark.browser]

# Mounts a widget's module into #host (a div of the given width) with a stand-in model:
# `window.__emit(msg, text)` delivers a kernel message (text → the binary buffer);
# `window.__sent` holds what the view sent; a "hello" is answered by `window.__onHello`.
# The widget manager knows one other model: the libraries (`libraries`: its id, and its
# gzipped modules in base64, handed over as the DataViews ipywidgets makes of buffers).
_JS_MOUNT = """
async ({ esm, css, props, libraries, width }) => {
  const style = document.createElement("style");
  style.textContent = css;
  document.head.append(style);
  const url = URL.createObjectURL(new Blob([esm], { type: "text/javascript" }));
  const mod = (await import(url)).default;
  const handlers = [];
  window.__sent = [];
  window.__emit = (msg, text) => {
    const buffers = text == null ? [] : [new DataView(new TextEncoder().encode(text).buffer)];
    for (const fn of [...handlers]) fn(msg, buffers);
  };
  const model = {
    get: (k) => props[k],
    on: (ev, fn) => { if (ev === "msg:custom") handlers.push(fn); },
    off: (ev, fn) => { const i = handlers.indexOf(fn); if (i >= 0) handlers.splice(i, 1); },
    send: (msg) => { window.__sent.push(msg); if (window.__onHello) window.__onHello(msg); },
    widget_manager: {
      get_model: async (id) => {
        window.__asked = (window.__asked || 0) + 1;
        if (id !== libraries.id) throw new Error("widget model not found");
        const modules = Object.fromEntries(Object.entries(libraries.modules).map(([k, b64]) =>
          [k, new DataView(Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)).buffer)]));
        return { get: (k) => (k === "modules" ? modules : undefined) };
      },
    },
  };
  const host = document.createElement("div");
  host.id = "host";
  host.style.width = width + "px";
  host.style.padding = "8px";
  const el = document.createElement("div");
  host.append(el);
  document.body.append(host);
  window.__cleanup = await mod.render({ model, el });
}
"""


@pytest.fixture
def page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    p = context.new_page()
    p.set_content("<!doctype html><html><body style='margin:0'></body></html>")
    try:
        yield p
        root = os.environ.get("SANDBOXKIT_SCREENSHOT_DIR")
        if root:
            folder = Path(root) / "details"
            folder.mkdir(parents=True, exist_ok=True)
            p.screenshot(path=str(folder / (re.sub(r"[^\w.-]", "_", request.node.name) + ".png")))
    finally:
        context.close()


def mount(page: Page, widget: Any, props: dict[str, Any], width: int) -> None:
    shared = libraries()
    page.evaluate(
        _JS_MOUNT,
        {
            "esm": widget._esm,
            "css": str(FrontendLibraries._css) + "\n" + str(widget._css),
            "props": {**props, "_libraries": f"IPY_MODEL_{shared.model_id}"},
            "libraries": {
                "id": shared.model_id,
                "modules": {k: base64.b64encode(v).decode() for k, v in shared.modules.items()},
            },
            "width": width,
        },
    )


def hello_view(page: Page) -> str:
    page.wait_for_function("() => window.__sent.some((m) => m.type === 'hello')")
    return str(page.evaluate("() => window.__sent.find((m) => m.type === 'hello').view"))


def frames(page: Page, n: int = 3) -> None:
    """Let the page lay out and paint ``n`` frames (ResizeObserver callbacks included)."""
    page.evaluate(
        "(n) => new Promise((ok) => { const f = (k) => k ? requestAnimationFrame(() => f(k - 1))"
        " : ok(); f(n); })",
        n,
    )


# -- charts ------------------------------------------------------------------------------

PANEL_BLUE, GHOST_PURPLE = "#1f77b4", "#9467bd"


def chart_snapshot(view: str, tracks: dict[str, tuple[str, str, list[list[Any]]]]) -> dict:
    return {
        "type": "snapshot",
        "view": view,
        "pid": 42,
        "window": 120,
        "now": 20.0,
        "labels": {
            cid: {"label": label, "color": color} for cid, (label, color, _) in tracks.items()
        },
        "points": {cid: pts for cid, (_, _, pts) in tracks.items()},
        "restarts": [],
    }


def mount_chart(page: Page, width: int, kind: str = "backpressure") -> str:
    props = {
        "kind": kind,
        "title": "lag of process 42",
        "height": 220,
        # As the kernel sends them (sandboxkit/vocab.py).
        "state_colors": dict(STATE_COLORS),
        "final_states": sorted(FINAL_CONSUMER_STATES),
    }
    mount(page, ChartWidget, props, width)
    return hello_view(page)


_JS_CANVAS_WIDTH = """
() => {
  const c = document.querySelector("#host canvas");
  const host = document.querySelector("#host > div");
  return { canvas: c.getBoundingClientRect().width, box: host.getBoundingClientRect().width };
}
"""


@pytest.mark.parametrize("kind", ["backpressure", "timeline"])
def test_a_chart_first_drawn_while_hidden_fits_its_box_once_shown(page: Page, kind: str) -> None:
    page.evaluate("() => { window.__hidden = true; }")
    # Hidden like a background tab: the host is display:none while the view renders.
    page.add_style_tag(content="#host.hidden-tab { display: none; }")
    page.evaluate(
        "() => new MutationObserver(() => { const h = document.querySelector('#host');"
        " if (h) h.classList.add('hidden-tab'); }).observe(document.body, {childList: true})"
    )
    view = mount_chart(page, 900, kind)
    if kind == "backpressure":
        pts = [[t, 1000 * t, "streaming"] for t in range(1, 20)]
        page.evaluate(
            "(m) => window.__emit(m)", chart_snapshot(view, {"c1": ("panel", PANEL_BLUE, pts)})
        )
    frames(page)
    page.evaluate("() => document.querySelector('#host').classList.remove('hidden-tab')")
    frames(page)
    sizes = page.evaluate(_JS_CANVAS_WIDTH)
    assert abs(sizes["canvas"] - sizes["box"]) <= 2, sizes


def test_a_chart_rebuilt_while_hidden_fits_its_box_once_shown(page: Page) -> None:
    view = mount_chart(page, 900)
    pts = [[t, 1000 * t, "streaming"] for t in range(1, 20)]
    page.evaluate(
        "(m) => window.__emit(m)", chart_snapshot(view, {"c1": ("panel", PANEL_BLUE, pts)})
    )
    frames(page)
    assert abs(page.evaluate(_JS_CANVAS_WIDTH)["canvas"] - 900) <= 2
    page.evaluate("() => { document.querySelector('#host').style.display = 'none'; }")
    frames(page)
    # A new consumer while the tab is hidden: the plot is rebuilt with its new series.
    page.evaluate(
        "(m) => window.__emit(m)",
        {
            "type": "sample",
            "t": 20.5,
            "lags": {"c1": 2000, "c2": 10},
            "states": {"c1": "streaming", "c2": "streaming"},
            "labels": {"c2": {"label": "notebook handle", "color": GHOST_PURPLE}},
        },
    )
    frames(page)
    page.evaluate("() => { document.querySelector('#host').style.display = ''; }")
    frames(page)
    sizes = page.evaluate(_JS_CANVAS_WIDTH)
    assert abs(sizes["canvas"] - sizes["box"]) <= 2, sizes


# Pixels of the chart's canvas near a colour, inside and outside the plot area (uPlot's
# `.u-over` lies exactly over the plot area).
_JS_INK = """
([hex, tol]) => {
  const c = document.querySelector("#host canvas");
  const over = document.querySelector("#host .u-over").getBoundingClientRect();
  const rect = c.getBoundingClientRect();
  const sx = c.width / rect.width, sy = c.height / rect.height;
  const x0 = (over.left - rect.left) * sx, x1 = (over.right - rect.left) * sx;
  const y0 = (over.top - rect.top) * sy, y1 = (over.bottom - rect.top) * sy;
  const want = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let inside = 0, outside = 0, outsideX = 0;
  for (let y = 0; y < c.height; y++) for (let x = 0; x < c.width; x++) {
    const i = (y * c.width + x) * 4;
    if (px[i + 3] < 250) continue;
    if (Math.abs(px[i] - want[0]) > tol || Math.abs(px[i + 1] - want[1]) > tol
        || Math.abs(px[i + 2] - want[2]) > tol) continue;
    const inX = x >= x0 && x < x1, inY = y >= y0 && y < y1;
    if (inX && inY) inside++; else outside++;
    if (!inX) outsideX++;
  }
  return { inside, outside, outsideX };
}
"""


def test_state_strips_are_drawn_outside_the_plot_area(page: Page) -> None:
    view = mount_chart(page, 900)
    pts = [[t, 5000 + 200 * t, "blocked" if t > 5 else "streaming"] for t in range(1, 20)]
    page.evaluate(
        "(m) => window.__emit(m)", chart_snapshot(view, {"c1": ("panel", PANEL_BLUE, pts)})
    )
    frames(page)
    blocked = page.evaluate(_JS_INK, ["#ff7f0e", 4])  # the "blocked" state's colour
    assert blocked["outside"] > 200, f"no state strip on screen: {blocked}"
    assert blocked["inside"] == 0, f"a state strip is drawn among the lag values: {blocked}"
    assert blocked["outsideX"] == 0, f"a state strip runs beyond the time axis: {blocked}"


def test_lines_on_top_of_each_other_both_show(page: Page) -> None:
    view = mount_chart(page, 900)
    pts = [[t, 4000 + 300 * (t % 5), "streaming"] for t in range(1, 20)]
    tracks = {"c1": ("panel", PANEL_BLUE, pts), "c2": ("ghost", GHOST_PURPLE, pts)}
    page.evaluate("(m) => window.__emit(m)", chart_snapshot(view, tracks))
    frames(page)
    panel = page.evaluate(_JS_INK, [PANEL_BLUE, 10])["inside"]
    ghost = page.evaluate(_JS_INK, [GHOST_PURPLE, 10])["inside"]
    # Each line keeps a good share of its own colour where they coincide.
    assert panel > 0.3 * ghost and ghost > 0.3 * panel, {"panel": panel, "ghost": ghost}


# -- the terminal --------------------------------------------------------------------------

_JS_ROWS = """
() => [...document.querySelectorAll("#host .xterm-rows > div")]
  .map((r) => r.textContent.replace(/\\u00a0/g, " "))
"""


def _line_numbers(rows: list[str]) -> list[int]:
    return [int(m.group(1)) for r in rows if (m := re.search(r"line +(\d+)", r))]


def mount_panel(page: Page, text: str, rows: int = 10) -> None:
    mount(page, TerminalWidget, {"rows": rows, "scrollback": 5000}, 800)
    view = hello_view(page)
    page.wait_for_selector("#host .xterm-rows")
    status = {"text": "pid 7 · running · cursor 0", "stalled": False, "age": 0}
    page.evaluate(
        "([m, t]) => window.__emit(m, t)",
        [{"type": "snapshot", "view": view, "status": status}, text],
    )


def test_the_follow_toggle_pauses_following_while_output_flows(page: Page) -> None:
    mount_panel(page, "".join(f"line {i}\n" for i in range(60)))
    page.wait_for_function(
        "() => [...document.querySelectorAll('#host .xterm-rows > div')]"
        ".some((r) => r.textContent.includes('line 59'))"
    )
    # Output flows: a new line every 20 ms.
    page.evaluate(
        "() => { let i = 60; window.__flow = setInterval(() => window.__emit("
        "{type: 'delta'}, `line ${i++}\\n`), 20); }"
    )
    page.wait_for_timeout(300)  # sleep-ok: lines flow meanwhile
    follow = page.locator("#host .sandboxkit-follow")
    assert "following" in follow.inner_text()
    follow.click()
    page.wait_for_timeout(100)  # sleep-ok: lines already written land
    frozen = page.evaluate(_JS_ROWS)
    page.wait_for_timeout(800)  # sleep-ok: 40 more lines flow meanwhile
    assert page.evaluate(_JS_ROWS) == frozen, "the view kept following after the toggle"
    assert "paused" in follow.inner_text()
    follow.click()
    page.wait_for_timeout(300)  # sleep-ok: lines flow meanwhile
    page.evaluate("() => clearInterval(window.__flow)")
    frames(page)
    newest = max(_line_numbers(page.evaluate(_JS_ROWS)))
    shown = max(_line_numbers(frozen))
    assert newest > shown + 20, "following did not resume with the newest lines"
    assert "following" in follow.inner_text()


def test_the_follow_toggle_pauses_before_the_screen_is_full(page: Page) -> None:
    mount_panel(page, "line 0\nline 1\nline 2\n")
    page.wait_for_function(
        "() => document.querySelector('#host .xterm-rows').textContent.includes('line 2')"
    )
    follow = page.locator("#host .sandboxkit-follow")
    follow.click()  # nothing to scroll back to yet
    frozen = page.evaluate(_JS_ROWS)
    page.evaluate(
        "() => { for (let i = 3; i < 60; i++) window.__emit({type: 'delta'}, `line ${i}\\n`); }"
    )
    page.wait_for_timeout(300)  # sleep-ok: the lines are written meanwhile
    rows = page.evaluate(_JS_ROWS)
    assert _line_numbers(rows)[0] == 0, f"the view moved on while paused: {rows}"
    assert rows[: len(_line_numbers(frozen))] == frozen[: len(_line_numbers(frozen))]
    assert "paused" in follow.inner_text()
    follow.click()
    page.wait_for_function(
        "() => document.querySelector('#host .xterm-rows').textContent.includes('line 59')"
    )
    assert "following" in follow.inner_text()


def test_a_skip_marker_says_on_screen_how_many_bytes_are_not_shown(page: Page) -> None:
    # The kernel side as it runs: more output between two sends than it keeps pending.
    state = PanelState(7, max_pending=1024)
    # Lines of 90 bytes: the 1 KiB kept after the skip fits the 16 rows on screen.
    lines = [f"line {i:3d} {'x' * 80}\n" for i in range(400)]
    for text in lines[:20]:
        state.feed_stdout(text)
    mount_panel(page, state.take_output().decode(), rows=16)
    for text in lines[20:]:
        state.feed_stdout(text)
    page.evaluate("(t) => window.__emit({type: 'delta'}, t)", state.take_output().decode())
    page.wait_for_function(
        "() => document.querySelector('#host .xterm-rows').textContent.includes('line 399')"
    )
    rows = [r.rstrip() for r in page.evaluate(_JS_ROWS)]
    marker = next(i for i, r in enumerate(rows) if "skipped" in r)
    said = int(re.search(r"(\d+) bytes skipped", rows[marker]).group(1))  # type: ignore[union-attr]
    after = _line_numbers(rows[marker + 1 :])
    # Whole lines follow the marker, in order, to the newest.
    assert after == list(range(after[0], 400)), rows
    assert re.fullmatch(r"line +\d+ x{80}", rows[marker + 1]), rows
    # What the marker says is missing is exactly the bytes between line 19 and the first
    # line shown after it.
    assert said == sum(len(t) for t in lines[20 : after[0]]), (said, after[0])


def test_widgets_on_one_page_fetch_each_library_once(page: Page) -> None:
    """Three terminals and two charts: the libraries' model is asked once per library
    (xterm.js, two addons, uPlot); the page evaluates each library once."""
    for _ in range(3):
        mount(page, TerminalWidget, {"rows": 5, "scrollback": 100}, 400)
    for _ in range(2):
        mount(page, ChartWidget, {"kind": "backpressure", "title": "t", "height": 120}, 400)
    assert page.evaluate("() => document.querySelectorAll('.xterm-rows').length") == 3
    assert page.evaluate("() => document.querySelectorAll('.sandboxkit-chart-root').length") == 2
    assert page.evaluate("() => window.__asked") == 4


def test_an_emoji_takes_two_cells_and_overlaps_nothing(page: Page) -> None:
    mount_panel(page, "ab\nA😀B✅C\n")
    page.wait_for_function(
        "() => document.querySelector('#host .xterm-rows > div').textContent.includes('ab')"
    )
    frames(page)
    seen = page.evaluate(
        """() => {
      const rows = [...document.querySelectorAll("#host .xterm-rows > div")];
      const at = (row, ch) => {
        const w = document.createTreeWalker(row, NodeFilter.SHOW_TEXT);
        for (let n = w.nextNode(); n; n = w.nextNode()) {
          const i = n.data.indexOf(ch);
          if (i < 0) continue;
          const r = document.createRange();
          r.setStart(n, i); r.setEnd(n, i + ch.length);
          const b = r.getBoundingClientRect();
          return [b.left - row.getBoundingClientRect().left, b.width];
        }
        return null;
      };
      return { a: at(rows[0], "a"), b: at(rows[0], "b"), A: at(rows[1], "A"),
               smile: at(rows[1], "\\u{1F600}"), B: at(rows[1], "B"),
               check: at(rows[1], "\\u2705"), C: at(rows[1], "C") };
    }"""
    )
    cell = seen["b"][0] - seen["a"][0]
    assert cell > 3, seen
    cells = {k: round(v[0] / cell, 1) for k, v in seen.items()}
    # A, then each emoji two cells wide: B at column 3, C at column 6.
    assert cells["A"] == 0 and cells["smile"] == 1, cells
    assert cells["B"] == 3, cells
    assert cells["check"] == 4 and cells["C"] == 6, cells
    # The emoji's glyph ends before the next character starts.
    assert seen["smile"][0] + seen["smile"][1] <= seen["B"][0] + 1, seen


# -- tables in JupyterLab ------------------------------------------------------------------

_STALL_NOTEBOOK = "stall_tables.ipynb"

NOTEBOOK_03 = Path(__file__).resolve().parents[1] / "notebooks" / "03_stall_statistics.ipynb"

# A per-cycle frame like notebook 03's run makes: blocking always stalls, kick from its
# 4th cycle on, cursor never.
_CYCLES = """\
import math
import pandas as pd
from sandboxkit.lab.experiment import CYCLE_COLUMNS

rows = []
for policy in ("blocking", "kick", "cursor"):
    for cycle in range(6):
        stalled = policy == "blocking" or (policy == "kick" and cycle >= 3)
        t_reattach = 0.012 + 0.001 * cycle
        done = math.nan if stalled else t_reattach + 0.004 + 0.0005 * cycle
        kicked = policy == "kick" and not stalled
        rows.append({
            "policy": policy, "ghost": "pause-snapshot", "cycle": cycle,
            "responses_expected": 3, "responses_complete": 0 if stalled else 3,
            "bytes_received": 0 if stalled else 1843, "time_to_first_byte": done,
            "time_to_complete": done, "stalled": stalled, "kicks": int(kicked), "gaps": 0,
            "t_pause": 0.002, "t_resume": 0.009, "t_reattach": t_reattach,
            "t_first_byte": done, "t_complete": done,
            "t_kick": t_reattach + 0.002 if kicked else math.nan, "deadline": 1.0,
        })
cycles = pd.DataFrame(rows, columns=CYCLE_COLUMNS)
"""

_LAB = """\
from sandboxkit.notebook.stall_lab import stall_table_html

lab = StallLab(policies=("blocking", "kick", "cursor"))
lab.table.value = stall_table_html(cycles)  # what a finished run shows
lab
"""


def _notebook_03_cells() -> list[str]:
    """Notebook 03's own import cell and stall-table cell (its run replaced by
    ``_CYCLES``), then its StallLab showing a finished run's table."""
    import nbformat

    cells = [c.source for c in nbformat.read(NOTEBOOK_03, as_version=4).cells]
    imports = next(c for c in cells if "import StallLab" in c)
    table = next(c for c in cells if c.startswith("table = stall_table(cycles)"))
    return [imports, _CYCLES, table, _LAB]


# Every table against the output it sits in (a table past the output's right edge is cut
# off there), and where the text of each header and of each cell of its column is drawn.
_JS_TABLES = """
() => [...document.querySelectorAll(".jp-OutputArea-output table")].map((t) => {
  const output = t.closest(".jp-OutputArea-output");
  // What of the page the table can show in: its output, narrowed by every ancestor in
  // it that hides its overflow (one that scrolls shows the rest only by scrolling).
  let clip = output.getBoundingClientRect().right;
  for (let e = t.parentElement; e && e !== output; e = e.parentElement) {
    if (getComputedStyle(e).overflowX !== "visible") {
      clip = Math.min(clip, e.getBoundingClientRect().right);
    }
  }
  const text = (cell) => {
    const r = document.createRange();
    r.selectNodeContents(cell);
    const b = r.getBoundingClientRect();
    return [b.left, b.right];
  };
  const heads = [...t.querySelectorAll("thead th")];
  const body = [...t.querySelectorAll("tbody tr")].map((tr) => [...tr.children]);
  const all = [...t.querySelectorAll("th, td")];
  return {
    widget: !!t.closest(".sandboxkit-stall-table"),
    clip,
    right: Math.max(t.getBoundingClientRect().right, ...all.map((c) => text(c)[1])),
    headers: heads.map((h) => h.textContent.trim()),
    columns: heads.map((h, i) => ({
      head: text(h), cells: body.map((r) => r[i] ? text(r[i]) : null).filter(Boolean),
    })),
  };
})
"""


@pytest.fixture(scope="module")
def stall_page(browser: Browser, jupyter: SharedLab) -> Iterator[Page]:
    """Notebook 03's two stall tables (its own cell's and StallLab's) from a synthetic
    run, in JupyterLab at a small laptop's width (1000 px, the file browser open)."""
    context = browser.new_context(viewport={"width": 1000, "height": 1000})
    context.set_default_timeout(60_000)
    with contextlib.closing(context), jupyter.notebook(_notebook_03_cells(), _STALL_NOTEBOOK) as nb:
        page = nb.open(context, ready=".sandboxkit-stall-table table")
        page.locator(".sandboxkit-stall-table table").wait_for(state="visible")
        page.locator(".jp-OutputArea-output table").nth(1).wait_for()
        yield page


def _tables(page: Page, shot: str) -> list[dict[str, Any]]:
    root = os.environ.get("SANDBOXKIT_SCREENSHOT_DIR")
    if root:
        folder = Path(root) / "details"
        folder.mkdir(parents=True, exist_ok=True)
        for i, output in enumerate(page.locator(".jp-OutputArea-output:has(table)").all()):
            output.scroll_into_view_if_needed()
            page.screenshot(path=str(folder / f"{shot}-{i}.png"))
    return list(page.evaluate(_JS_TABLES))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stall_tables_are_not_clipped_on_the_right(stall_page: Page) -> None:
    tables = _tables(stall_page, "clipped")
    assert len(tables) >= 2, tables
    for t in tables:
        assert t["right"] <= t["clip"] + 1, (
            f"table {t['headers']} ends at x={t['right']:.0f}, past x={t['clip']:.0f} "
            "where its output cuts it off"
        )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stall_lab_headers_line_up_with_their_columns(stall_page: Page) -> None:
    lab = next(t for t in _tables(stall_page, "headers") if t["widget"])
    for name, col in zip(lab["headers"], lab["columns"], strict=True):
        (hl, hr), cells = col["head"], col["cells"]
        left = all(abs(cl - hl) <= 2 for cl, _ in cells)
        right = all(abs(cr - hr) <= 2 for _, cr in cells)
        assert left or right, f"column {name!r}: header at {col['head']}, cells at {cells}"


_JS_CONTROLS = """
() => {
  const lab = document.querySelector(".sandboxkit-stall-lab");
  const right = lab.closest(".jp-OutputArea-output").getBoundingClientRect().right;
  return [...lab.querySelectorAll("input, select, button, .widget-readout, .widget-label")]
    .map((e) => [e.tagName + " " + (e.textContent || e.value || "").trim().slice(0, 20),
                 e.getBoundingClientRect().right, right])
    .filter(([, r, edge]) => r > edge + 1);
}
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stall_lab_controls_are_not_cut_off(stall_page: Page) -> None:
    stall_page.locator(".sandboxkit-stall-lab").scroll_into_view_if_needed()
    assert stall_page.evaluate(_JS_CONTROLS) == []
