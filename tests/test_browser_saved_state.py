"""A notebook saved by JupyterLab with ten terminals and ten charts stays small.

JupyterLab (with "Save Jupyter widget state in notebooks" on) writes the state of every
live widget model into the notebook's metadata. The vendored libraries travel in one model
that every widget references (``sandboxkit/notebook/_frontend.py``), so they are in the
file once: the widget state stays under the bound ``tests/test_notebook_frontend.py``
holds for the same widgets without a browser. With the libraries inlined per widget this
file was ~4.8 MB. Debian's chromium (``/usr/bin/chromium``) drives the lab; no daemon.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jupyter_harness
import nbformat
import pytest
from jupyter_harness import (
    CHROMIUM,
    CHROMIUM_ARGS,
    JupyterLab,
    deadline_poll,
    describe,
    reap,
    snapshot_pids,
    still_alive,
    suspects,
)
from test_browser import _require_browser_stack
from test_notebook_frontend import SAVED_STATE_BOUND

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "ten_widgets.ipynb"
CELL = """\
from IPython.display import display
from sandboxkit.notebook.charts import ChartWidget
from sandboxkit.notebook.panel import TerminalWidget

display(*[TerminalWidget(rows=5) for _ in range(10)], *[ChartWidget() for _ in range(10)])
"""
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _run_and_save(server: JupyterLab, saved: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1100})
            page.set_default_timeout(60_000)
            page.goto(server.lab_url(NOTEBOOK), wait_until="domcontentloaded")
            kernel = deadline_poll(lambda: server.kernel_for(NOTEBOOK), 60, "the kernel")
            deadline_poll(lambda: server.kernel_state(str(kernel)) == "idle", 60, "idle")
            page.locator(
                ".jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator[data-status='idle']"
            ).wait_for(state="attached")
            menu = ".lm-Menu-item:not(.lm-mod-hidden) .lm-Menu-itemLabel"
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(menu, has_text="Run All Cells").first.click()
            # Every widget rendered: its library was imported from the one libraries model.
            page.locator(".xterm-rows").nth(9).wait_for(state="attached")
            page.locator(".sandboxkit-chart-root").nth(9).wait_for(state="attached")
            page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()
            page.locator(menu, has_text="Save Notebook").first.click()
            deadline_poll(lambda: WIDGET_STATE in saved.read_text(), 30, "the saved state")
        finally:
            browser.close()


@pytest.mark.timeout(180)
def test_a_notebook_saved_with_ten_terminals_and_ten_charts_stays_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _require_browser_stack()
    monkeypatch.setitem(
        jupyter_harness.LAB_SETTINGS,
        "@jupyter-widgets/jupyterlab-manager:plugin",
        {"saveState": True},
    )
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    source = tmp_path / NOTEBOOK
    nbformat.write(nb, source)
    before = snapshot_pids()
    server = JupyterLab(tmp_path / "lab", [source])
    try:
        server.start().wait_ready(timeout=90)
        _run_and_save(server, server.root / NOTEBOOK)
    finally:
        server.stop()
        left = suspects(str(tmp_path), before)
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.1)  # sleep-ok: a poll with a deadline
            left = still_alive(left)
        if left:
            names = describe(left)
            reap(left)
            pytest.fail(f"the test left processes running: {names}")
    saved = json.loads((server.root / NOTEBOOK).read_text())
    state = saved["metadata"]["widgets"][WIDGET_STATE]["state"]
    size = len(json.dumps(state))
    file_size = os.path.getsize(server.root / NOTEBOOK)
    print(f"\nwidget state: {len(state)} models, {size} bytes; the file {file_size} bytes")
    names = [m["state"].get("_anywidget_id", "") for m in state.values()]
    assert names.count("sandboxkit.notebook.panel.TerminalWidget") == 10, names
    assert names.count("sandboxkit.notebook.charts.ChartWidget") == 10, names
    assert size < SAVED_STATE_BOUND, size
