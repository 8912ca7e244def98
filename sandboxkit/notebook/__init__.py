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

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"sandboxkit.notebook.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sandboxkit.notebook' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
