"""Matplotlib figures for the static plots (``chart.figure()``, the stall lab's rates):
pyplot-free, so nothing is registered globally and no backend is switched."""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["figure_png", "new_figure"]


def new_figure(width: float = 7.0, height: float = 3.0) -> Figure:
    """A figure with an Agg canvas, safe to render from any thread that owns it."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    """Render ``fig`` to PNG bytes (for an ``ipywidgets.Image``)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    return buffer.getvalue()
