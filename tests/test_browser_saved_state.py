"""A notebook saved by JupyterLab with ten terminals and ten charts stays small.

JupyterLab (with "Save Jupyter widget state in notebooks" on) writes the state of every
live widget model into the notebook's metadata. The vendored libraries travel in one model
that every widget references (``sandboxkit/notebook/_frontend.py``), so they are in the
file once: the widget state stays under the bound ``tests/test_notebook_frontend.py``
holds for the same widgets without a browser. With the libraries inlined per widget this
file was ~4.8 MB. Debian's chromium (``/usr/bin/chromium``) drives the lab; no daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import TYPE_CHECKING

import pytest
from jupyter_harness import deadline_poll
from test_notebook_frontend import SAVED_STATE_BOUND

if TYPE_CHECKING:
    from jupyter_harness import SharedLab
    from playwright.sync_api import Browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "ten_widgets.ipynb"
CELL = """\
from IPython.display import display
from sandboxkit.notebook.charts import ChartWidget
from sandboxkit.notebook.panel import TerminalWidget

display(*[TerminalWidget(rows=5) for _ in range(10)], *[ChartWidget() for _ in range(10)])
"""
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


@pytest.mark.timeout(180)
def test_a_notebook_saved_with_ten_terminals_and_ten_charts_stays_small(
    jupyter: SharedLab, browser: Browser
) -> None:
    context = browser.new_context(viewport={"width": 1300, "height": 1100})
    context.set_default_timeout(60_000)
    with (
        jupyter.settings("@jupyter-widgets/jupyterlab-manager:plugin", {"saveState": True}),
        jupyter.notebook([CELL], NOTEBOOK) as nb,
        contextlib.closing(context),
    ):
        page = nb.open(context)
        # Every widget rendered: its library was imported from the one libraries model.
        page.locator(".xterm-rows").nth(9).wait_for(state="attached")
        page.locator(".sandboxkit-chart-root").nth(9).wait_for(state="attached")
        nb.menu(page, "File", "Save Notebook")
        deadline_poll(lambda: WIDGET_STATE in nb.file.read_text(), 30, "the saved state")
    saved = json.loads(nb.file.read_text())
    state = saved["metadata"]["widgets"][WIDGET_STATE]["state"]
    size = len(json.dumps(state))
    file_size = os.path.getsize(nb.file)
    print(f"\nwidget state: {len(state)} models, {size} bytes; the file {file_size} bytes")
    names = [m["state"].get("_anywidget_id", "") for m in state.values()]
    assert names.count("sandboxkit.notebook.panel.TerminalWidget") == 10, names
    assert names.count("sandboxkit.notebook.charts.ChartWidget") == 10, names
    assert size < SAVED_STATE_BOUND, size
