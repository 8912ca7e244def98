"""The fault lab: reproduce the stalls of F1–F8 on purpose and measure them.

``reattach_cycles`` / ``compare`` run the experiment; ``stall_table`` and the plotting
helpers turn it into a bisect-style table and figures; the ghost makers and the stdio
JSON-RPC workload (``python -m sandboxkit.lab.stdio_server``) are the ingredients.

Names load on first use, so that the workload server starts without pandas or httpx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandboxkit._lazy import lazy_exports
from sandboxkit.lab_options import FANOUT_POLICIES, GHOST_KINDS, LabOptions

if TYPE_CHECKING:
    from sandboxkit.lab.experiment import CYCLE_COLUMNS, compare, lab_options, reattach_cycles
    from sandboxkit.lab.ghosts import FrozenClient, Ghost, LeakyClient, make_ghost
    from sandboxkit.lab.jsonrpc import REFRESH_METHODS, JsonRpcClient
    from sandboxkit.lab.plots import plot_cycle_timeline, plot_stall_rates, save_figure
    from sandboxkit.lab.stats import format_stall_table, stall_table, wilson_interval

_WHERE = {
    "CYCLE_COLUMNS": "experiment",
    "compare": "experiment",
    "lab_options": "experiment",
    "reattach_cycles": "experiment",
    "FrozenClient": "ghosts",
    "Ghost": "ghosts",
    "LeakyClient": "ghosts",
    "make_ghost": "ghosts",
    "JsonRpcClient": "jsonrpc",
    "REFRESH_METHODS": "jsonrpc",
    "plot_cycle_timeline": "plots",
    "plot_stall_rates": "plots",
    "save_figure": "plots",
    "format_stall_table": "stats",
    "stall_table": "stats",
    "wilson_interval": "stats",
}

__all__ = [
    "CYCLE_COLUMNS",
    "FANOUT_POLICIES",
    "GHOST_KINDS",
    "REFRESH_METHODS",
    "FrozenClient",
    "Ghost",
    "JsonRpcClient",
    "LabOptions",
    "LeakyClient",
    "compare",
    "format_stall_table",
    "lab_options",
    "make_ghost",
    "plot_cycle_timeline",
    "plot_stall_rates",
    "reattach_cycles",
    "save_figure",
    "stall_table",
    "wilson_interval",
]

__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
