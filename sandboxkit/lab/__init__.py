"""The fault lab: reproduce the stalls of F1–F8 on purpose and measure them.

``reattach_cycles`` / ``compare`` run the experiment; ``stall_table`` and the plotting
helpers turn it into a bisect-style table and figures; the ghost makers and the stdio
JSON-RPC workload (``python -m sandboxkit.lab.stdio_server``) are the ingredients.

Names load on first use, so that the workload server starts without pandas or httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandboxkit.lab.experiment import (
        CYCLE_COLUMNS,
        POLICIES,
        REFRESH,
        compare,
        reattach_cycles,
    )
    from sandboxkit.lab.ghosts import GHOST_KINDS, FrozenClient, Ghost, LeakyClient, make_ghost
    from sandboxkit.lab.jsonrpc import JsonRpcClient
    from sandboxkit.lab.plots import plot_cycle_timeline, plot_stall_rates, save_figure
    from sandboxkit.lab.stats import format_stall_table, stall_table, wilson_interval

_WHERE = {
    "CYCLE_COLUMNS": "experiment",
    "POLICIES": "experiment",
    "REFRESH": "experiment",
    "compare": "experiment",
    "reattach_cycles": "experiment",
    "GHOST_KINDS": "ghosts",
    "FrozenClient": "ghosts",
    "Ghost": "ghosts",
    "LeakyClient": "ghosts",
    "make_ghost": "ghosts",
    "JsonRpcClient": "jsonrpc",
    "plot_cycle_timeline": "plots",
    "plot_stall_rates": "plots",
    "save_figure": "plots",
    "format_stall_table": "stats",
    "stall_table": "stats",
    "wilson_interval": "stats",
}

__all__ = [
    "CYCLE_COLUMNS",
    "GHOST_KINDS",
    "POLICIES",
    "REFRESH",
    "FrozenClient",
    "Ghost",
    "JsonRpcClient",
    "LeakyClient",
    "compare",
    "format_stall_table",
    "make_ghost",
    "plot_cycle_timeline",
    "plot_stall_rates",
    "reattach_cycles",
    "save_figure",
    "stall_table",
    "wilson_interval",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"sandboxkit.lab.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'sandboxkit.lab' has no attribute {name!r}")
