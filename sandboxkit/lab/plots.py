"""Matplotlib figures for the fault lab's stall statistics.

Every function builds a :class:`matplotlib.figure.Figure` directly, without pyplot: no
backend is selected or switched, no figure is registered with pyplot's global figure
manager (so nothing leaks between notebook cells or tests), and nothing is shown. In a
notebook, a returned figure displays itself as the cell's value; elsewhere, write it with
:func:`save_figure`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, NullLocator, PercentFormatter

from sandboxkit.lab.stats import (
    STALL_TABLE_COLUMNS,
    STALL_TABLE_REQUIRED,
    as_float,
    format_duration,
    policy_rank,
    require_columns,
    stall_table,
)

__all__ = [
    "POLICY_COLORS",
    "STALL_SPAN_GID",
    "TIMELINE_COLUMNS",
    "TIMELINE_MARKERS",
    "plot_cycle_timeline",
    "plot_stall_rates",
    "policy_color",
    "save_figure",
]

#: Fixed colours for the known fan-out policies (the shipped failures warm, the fix green).
POLICY_COLORS: dict[str, str] = {
    "blocking": "#d62728",
    "kick": "#ff7f0e",
    "cursor": "#2ca02c",
}
_EXTRA_COLORS = ("#1f77b4", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")

#: Timeline events drawn as markers: (column, legend label, marker, colour).
TIMELINE_MARKERS: tuple[tuple[str, str, str, str], ...] = (
    ("t_pause", "pause", "|", "#555555"),
    ("t_resume", "resume", "^", "#1f77b4"),
    ("t_reattach", "reattach", "o", "#9467bd"),
    ("t_first_byte", "first byte", "s", "#17becf"),
    ("t_complete", "complete", "*", "#2ca02c"),
    ("t_kick", "kick", "X", "#ff7f0e"),
)

#: The per-cycle columns :func:`plot_cycle_timeline` reads.
TIMELINE_COLUMNS: tuple[str, ...] = (
    "policy",
    "ghost",
    "cycle",
    "stalled",
    "deadline",
    *(column for column, _, _, _ in TIMELINE_MARKERS),
)

#: ``gid`` of the red "stalled" spans, so callers and tests can find them among patches.
STALL_SPAN_GID = "stall-span"

_STALL_COLOR = "#d62728"
# Drawn hollow so that coinciding events (reattach, first byte, resume) stay visible.
_HOLLOW_MARKERS = frozenset({"t_reattach", "t_first_byte"})


def policy_color(policy: object, extra_index: int = 0) -> str:
    """The colour of ``policy``: fixed for known policies, else the ``extra_index``-th spare."""
    if isinstance(policy, str) and policy in POLICY_COLORS:
        return POLICY_COLORS[policy]
    return _EXTRA_COLORS[extra_index % len(_EXTRA_COLORS)]


def _color_map(policies: list[Hashable]) -> dict[Hashable, str]:
    colors: dict[Hashable, str] = {}
    extra = 0
    for policy in policies:
        if policy in colors:
            continue
        if isinstance(policy, str) and policy in POLICY_COLORS:
            colors[policy] = POLICY_COLORS[policy]
        else:
            colors[policy] = policy_color(policy, extra)
            extra += 1
    return colors


def _empty_message(fig: Figure, message: str) -> None:
    ax = fig.add_subplot()
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def plot_stall_rates(
    table_or_df: pd.DataFrame,
    *,
    confidence: float = 0.95,
    title: str | None = None,
) -> Figure:
    """Bar chart of the stall rate of each (policy, ghost) configuration.

    Each bar is one configuration, coloured by policy, with asymmetric error bars from the
    Wilson interval and labelled ``"k/n"`` (stalled/cycles) above its interval. The y axis
    shows 0–100 %.

    Args:
        table_or_df: either a :func:`~sandboxkit.lab.stats.stall_table` result or the raw
            per-cycle frame, told apart by their columns (a raw frame is folded with
            ``stall_table(df, confidence)``).
        confidence: confidence level used when folding a raw frame; a table keeps its own.
        title: figure title; a default naming the confidence level is used if ``None``.

    Returns:
        A new figure with one axes; one bar patch per configuration (an empty frame gives a
        figure with a "no cycles" note and no bars).

    Raises:
        ValueError: if the frame is neither a stall table nor a per-cycle frame.
    """
    columns = {str(c) for c in table_or_df.columns}
    if set(STALL_TABLE_COLUMNS) <= columns:
        table = table_or_df
        confidence = float(table.attrs.get("confidence", confidence))
    elif set(STALL_TABLE_REQUIRED) <= columns or (len(columns) == 0 and len(table_or_df) == 0):
        table = stall_table(table_or_df, confidence)
    else:
        missing = sorted(set(STALL_TABLE_REQUIRED) - columns)
        raise ValueError(
            "expected a stall table or a per-cycle frame; missing per-cycle column(s): "
            + ", ".join(missing)
        )

    fig = Figure(figsize=(max(5.0, 1.1 * len(table) + 2.0), 4.2), layout="constrained")
    if title is None:
        title = f"Stall rate per configuration ({confidence * 100:g}% Wilson interval)"
    fig.suptitle(title)
    if len(table) == 0:
        _empty_message(fig, "no cycles")
        return fig

    ax = fig.add_subplot()
    records: list[dict[Hashable, Any]] = table.to_dict("records")
    rates = [as_float(r["stall_rate"]) for r in records]
    lows = [as_float(r["ci_low"]) for r in records]
    highs = [as_float(r["ci_high"]) for r in records]
    colors_by_policy = _color_map([r["policy"] for r in records])
    colors = [colors_by_policy[r["policy"]] for r in records]
    x = list(range(len(records)))
    yerr = [
        [max(0.0, rate - low) for rate, low in zip(rates, lows, strict=True)],
        [max(0.0, high - rate) for rate, high in zip(rates, highs, strict=True)],
    ]
    ax.bar(
        x,
        rates,
        color=colors,
        edgecolor="black",
        linewidth=0.6,
        yerr=yerr,
        capsize=4,
        error_kw={"ecolor": "black", "elinewidth": 1.0},
    )
    for xi, high, record in zip(x, highs, records, strict=True):
        ax.text(
            xi,
            (high if not math.isnan(high) else 0.0) + 0.02,
            str(record["stalls"]),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_xticks(x, [f"{r['policy']}\n{r['ghost']}" for r in records])
    ax.set_ylim(0.0, 1.12)  # headroom for the "k/n" labels above a 100 % interval
    ax.set_yticks([0.0, 0.25, 0.5, 0.75, 1.0])
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=0))
    ax.set_ylabel("cycles stalled")
    ax.set_xlabel("fan-out policy / ghost")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if len(colors_by_policy) > 1:
        ax.legend(
            handles=[
                Patch(facecolor=c, edgecolor="black", label=str(p))
                for p, c in colors_by_policy.items()
            ],
            title="policy",
            loc="upper right",
            fontsize=8,
        )
    return fig


def _ordered_cycles(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` sorted by policy (known order first), ghost (first appearance), cycle."""
    policy_ranks = policy_rank(df["policy"])
    ghost_ranks = {g: i for i, g in enumerate(dict.fromkeys(df["ghost"]))}
    keyed = df.assign(
        _policy_rank=df["policy"].map(policy_ranks),
        _ghost_rank=df["ghost"].map(ghost_ranks),
    )
    keyed = keyed.sort_values(["_policy_rank", "_ghost_rank", "cycle"], kind="stable")
    ordered: pd.DataFrame = keyed.drop(columns=["_policy_rank", "_ghost_rank"]).reset_index(
        drop=True
    )
    return ordered


def _time_axis(ax: Any, x_min: float, x_max: float, events: list[float]) -> None:
    """The timeline's x axis. Linear, unless every event lies in the first tenth of it
    (a cycle's steps take milliseconds, its deadline seconds: on a linear axis its markers
    would pile up at x≈0): then linear up to the first event's decade and logarithmic
    beyond, so each step gets its own place and the deadline still shows."""
    positive = [t for t in events if t > 0]
    if positive and x_min >= 0 and max(positive) < 0.1 * x_max:
        linthresh = 10.0 ** math.floor(math.log10(min(positive)))
        ax.set_xscale("symlog", linthresh=linthresh, linscale=0.5)
        ax.set_xlim(0.0, x_max * 1.25)
        ax.xaxis.set_major_formatter(
            FuncFormatter(lambda v, _pos: "0" if v == 0 else format_duration(v))
        )
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(f"time since cycle start (logarithmic above {format_duration(linthresh)})")
        return
    span = x_max - x_min if x_max > x_min else 1.0
    ax.set_xlim(x_min - 0.02 * span, x_max + 0.04 * span)
    ax.set_xlabel("time since cycle start (s)")


def plot_cycle_timeline(
    df: pd.DataFrame,
    policy: str | None = None,
    ghost: str | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """Per-cycle timeline: one horizontal row per cycle, grouped and coloured by policy.

    Each row runs from the cycle start (0 s) to its deadline (a thin line in the policy's
    colour, ending in a ``|``). Markers show the pause, resume, reattach, first byte,
    completion and first kick of the cycle (a marker is omitted where its time is NaN).
    A stalled cycle gets a translucent red span from the reattach to the deadline (from
    the resume, or the cycle start, when no reattach time was recorded); the spans are
    patches with ``gid`` :data:`STALL_SPAN_GID`.

    Rows are ordered by policy (``blocking``, ``kick``, ``cursor``, then others), ghost
    (first appearance) and cycle, top to bottom, and labelled ``"policy/ghost #cycle"``.

    Args:
        df: the experiment's per-cycle frame (columns :data:`TIMELINE_COLUMNS`).
        policy: plot only this policy's cycles, if given.
        ghost: plot only cycles with this ghost kind, if given.
        title: figure title; a default naming the selection is used if ``None``.

    Returns:
        A new figure with one axes and one y tick per plotted cycle (a selection with no
        cycles gives a figure with a "no cycles" note).

    Raises:
        ValueError: if required columns are missing (all of them are named).
    """
    require_columns(df, TIMELINE_COLUMNS, "per-cycle frame")
    selected = df
    if policy is not None:
        selected = selected[selected["policy"] == policy]
    if ghost is not None:
        selected = selected[selected["ghost"] == ghost]
    if title is None:
        scope = ", ".join(
            part
            for part in (
                f"policy={policy}" if policy is not None else "",
                f"ghost={ghost}" if ghost is not None else "",
            )
            if part
        )
        title = "Reattach cycle timeline" + (f" ({scope})" if scope else "")

    rows = _ordered_cycles(selected) if len(selected) else selected
    n = len(rows)
    fig = Figure(figsize=(9.0, min(40.0, max(2.8, 0.28 * n + 1.8))), layout="constrained")
    fig.suptitle(title)
    if n == 0:
        _empty_message(fig, "no cycles")
        return fig

    ax = fig.add_subplot()
    records: list[dict[Hashable, Any]] = rows.to_dict("records")
    colors_by_policy = _color_map([r["policy"] for r in records])
    ys = list(range(n - 1, -1, -1))  # first row at the top

    x_max = 0.0
    x_min = 0.0
    events: list[float] = []  # every marker's time
    for y, record in zip(ys, records, strict=True):
        color = colors_by_policy[record["policy"]]
        deadline = as_float(record["deadline"])
        times = [as_float(record[column]) for column, _, _, _ in TIMELINE_MARKERS]
        events.extend(t for t in times if not math.isnan(t))
        finite = [t for t in [deadline, *times] if not math.isnan(t)]
        if finite:
            x_max = max(x_max, *finite)
            x_min = min(x_min, *finite)
        if not math.isnan(deadline):
            ax.plot([0.0, deadline], [y, y], color=color, linewidth=1.2, alpha=0.6, zorder=1)
            ax.plot([deadline], [y], marker="|", markersize=10, color="black", zorder=2)
        if bool(record["stalled"]) and not math.isnan(deadline):
            start = next(
                (
                    t
                    for t in (as_float(record["t_reattach"]), as_float(record["t_resume"]))
                    if not math.isnan(t)
                ),
                0.0,
            )
            if deadline > start:
                ax.barh(
                    y,
                    deadline - start,
                    left=start,
                    height=0.6,
                    color=_STALL_COLOR,
                    alpha=0.25,
                    linewidth=0,
                    zorder=0,
                    gid=STALL_SPAN_GID,
                )

    for column, _label, marker, color in TIMELINE_MARKERS:
        points = [
            (as_float(r[column]), y)
            for y, r in zip(ys, records, strict=True)
            if not math.isnan(as_float(r[column]))
        ]
        if points:
            xs = [p[0] for p in points]
            ys_points = [p[1] for p in points]
            if column in _HOLLOW_MARKERS:
                ax.scatter(
                    xs,
                    ys_points,
                    marker=marker,
                    facecolors="none",
                    edgecolors=color,
                    linewidths=1.4,
                    s=70,
                    zorder=3,
                )
            else:
                big = marker in ("*", "X")
                ax.scatter(xs, ys_points, marker=marker, color=color, s=70 if big else 40, zorder=3)

    # Separators between (policy, ghost) groups.
    for i in range(1, n):
        previous, current = records[i - 1], records[i]
        if (previous["policy"], previous["ghost"]) != (current["policy"], current["ghost"]):
            ax.axhline(ys[i] + 0.5, color="#999999", linewidth=0.6, linestyle="--")

    ax.set_yticks(ys, [f"{r['policy']}/{r['ghost']} #{r['cycle']}" for r in records])
    for tick, record in zip(ax.get_yticklabels(), records, strict=True):
        tick.set_color(colors_by_policy[record["policy"]])
    ax.tick_params(axis="y", labelsize=8)
    ax.set_ylim(-0.7, n - 0.3)
    _time_axis(ax, x_min, x_max, events)
    ax.grid(axis="x", alpha=0.3)

    handles: list[Any] = [
        Line2D(
            [],
            [],
            linestyle="none",
            marker=marker,
            color=color,
            markerfacecolor="none" if column in _HOLLOW_MARKERS else color,
            label=label,
        )
        for column, label, marker, color in TIMELINE_MARKERS
    ]
    handles.append(
        Line2D([], [], linestyle="none", marker="|", markersize=10, color="black", label="deadline")
    )
    handles.append(Patch(facecolor=_STALL_COLOR, alpha=0.25, label="stalled (reattach → deadline)"))
    handles.extend(
        Line2D([], [], color=c, linewidth=2, label=f"policy: {p}")
        for p, c in colors_by_policy.items()
    )
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
    )
    return fig


def save_figure(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` as a PNG (dpi 120, tight bounding box) and return the path.

    The format is always PNG, whatever the suffix of ``path``; missing parent directories
    are created.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="png", dpi=120, bbox_inches="tight", facecolor="white")
    return target
