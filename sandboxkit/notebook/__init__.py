"""Notebook widgets (ipywidgets 8 + anywidget) over the sandboxkit client.

Thin layer: state and throttling live in plain Python classes that tests drive without a
browser; the widgets only render. The terminal (xterm.js) and the charts (uPlot) are
drawn in the browser by each widget's own ``.js`` module beside it, with the libraries
vendored under ``static/`` (see ``_frontend.py``). Every name is imported on first use, so
that importing :mod:`sandboxkit.notebook` stays cheap::

    from sandboxkit.notebook import ProcessPanel, BackpressureChart, LifecycleTimeline
    from sandboxkit.notebook import SandboxDashboard, StallLab
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandboxkit._lazy import lazy_exports

if TYPE_CHECKING:
    from sandboxkit.notebook.charts import BackpressureChart, LifecycleTimeline
    from sandboxkit.notebook.dashboard import SandboxDashboard
    from sandboxkit.notebook.panel import PanelState, ProcessPanel
    from sandboxkit.notebook.stall_lab import StallLab

_WHERE = {
    "BackpressureChart": "charts",
    "LifecycleTimeline": "charts",
    "PanelState": "panel",
    "ProcessPanel": "panel",
    "SandboxDashboard": "dashboard",
    "StallLab": "stall_lab",
}

__all__ = [
    "BackpressureChart",
    "LifecycleTimeline",
    "PanelState",
    "ProcessPanel",
    "SandboxDashboard",
    "StallLab",
]

__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
