"""Stall statistics for the fault lab.

The lab's experiment yields one row per reattach cycle (columns:
``sandboxkit.lab.experiment.CYCLE_COLUMNS``). This module folds those rows into one row per
configuration (fan-out policy × ghost kind) with the stall count in the bisect style of the
public incident reports ("6/6 reattach cycles stalled"), the stall rate with a Wilson score
interval, completion times, and the totals of kicks and gaps, and renders that table as
plain text for the CLI.

Only the standard library and pandas are used; the normal quantile comes from
:class:`statistics.NormalDist`, so there is no scipy dependency.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from statistics import NormalDist
from typing import Any

import pandas as pd

from sandboxkit.lab_options import FANOUT_POLICIES

__all__ = [
    "POLICY_ORDER",
    "STALL_TABLE_COLUMNS",
    "STALL_TABLE_REQUIRED",
    "as_float",
    "format_duration",
    "format_stall_table",
    "policy_rank",
    "require_columns",
    "stall_table",
    "wilson_interval",
]

#: Fan-out policies in presentation order: the two shipped failures first, the fix last.
POLICY_ORDER: tuple[str, ...] = FANOUT_POLICIES

#: The per-cycle columns :func:`stall_table` reads.
STALL_TABLE_REQUIRED: tuple[str, ...] = (
    "policy",
    "ghost",
    "stalled",
    "time_to_complete",
    "kicks",
    "gaps",
)

#: The columns of the table :func:`stall_table` returns, in order.
STALL_TABLE_COLUMNS: tuple[str, ...] = (
    "policy",
    "ghost",
    "cycles",
    "stalled_cycles",
    "stalls",
    "stall_rate",
    "ci_low",
    "ci_high",
    "median_time_to_complete",
    "max_time_to_complete",
    "kicks",
    "gaps",
)

_INT_COLUMNS = ("cycles", "stalled_cycles", "kicks", "gaps")
_FLOAT_COLUMNS = (
    "stall_rate",
    "ci_low",
    "ci_high",
    "median_time_to_complete",
    "max_time_to_complete",
)


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Return the Wilson score interval for ``k`` successes out of ``n`` trials.

    Unlike the normal ("Wald") interval, the Wilson interval stays inside ``[0, 1]`` and is
    informative at the extremes that matter here: 6 stalls in 6 cycles gives roughly
    ``(0.61, 1.0)`` at 95 %, 0 in 6 gives ``(0.0, 0.39)``.

    Args:
        k: number of successes (here: stalled cycles), ``0 <= k <= n``.
        n: number of trials (cycles), ``n >= 0``.
        confidence: two-sided confidence level, strictly between 0 and 1.

    Returns:
        ``(low, high)`` with ``0 <= low <= k/n <= high <= 1``. With ``n == 0`` nothing is
        known and the interval is ``(0.0, 1.0)``.

    Raises:
        ValueError: if ``n < 0``, ``k`` is outside ``[0, n]`` or ``confidence`` is not in
            ``(0, 1)``.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be strictly between 0 and 1, got {confidence!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0 <= k <= n:
        raise ValueError(f"k must be between 0 and n={n}, got {k}")
    if n == 0:
        return (0.0, 1.0)
    z = NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)
    z2 = z * z
    p = k / n
    denominator = 1.0 + z2 / n
    center = (p + z2 / (2.0 * n)) / denominator
    half_width = z * math.sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n)) / denominator
    # At the extremes the exact bound is 0 or 1; pin it so rounding cannot move it.
    low = 0.0 if k == 0 else max(0.0, center - half_width)
    high = 1.0 if k == n else min(1.0, center + half_width)
    return (low, high)


def require_columns(df: pd.DataFrame, columns: Iterable[str], what: str = "frame") -> None:
    """Raise :class:`ValueError` naming every column of ``columns`` missing from ``df``."""
    present = {str(c) for c in df.columns}
    missing = [c for c in columns if c not in present]
    if missing:
        raise ValueError(f"{what} is missing required column(s): {', '.join(missing)}")


def _empty_table(confidence: float) -> pd.DataFrame:
    """A stall table with no rows and the right columns and dtypes."""
    data: dict[str, pd.Series[Any]] = {}
    for column in STALL_TABLE_COLUMNS:
        if column in _INT_COLUMNS:
            data[column] = pd.Series([], dtype="int64")
        elif column in _FLOAT_COLUMNS:
            data[column] = pd.Series([], dtype="float64")
        else:
            data[column] = pd.Series([], dtype="object")
    table: pd.DataFrame = pd.DataFrame(data, columns=list(STALL_TABLE_COLUMNS))
    table.attrs["confidence"] = confidence
    return table


def policy_rank(policies: Iterable[Hashable]) -> dict[Hashable, int]:
    """Rank of each distinct policy in ``policies`` for presentation order.

    Known policies come first in :data:`POLICY_ORDER` (``blocking``, ``kick``, ``cursor``),
    any others after them in order of first appearance.
    """
    seen = list(_first_appearance(policies))
    rank: dict[Hashable, int] = {}
    for known in POLICY_ORDER:
        if known in seen:
            rank[known] = len(rank)
    for other in seen:
        if other not in rank:
            rank[other] = len(rank)
    return rank


def _first_appearance(values: Iterable[Hashable]) -> dict[Hashable, int]:
    """Rank of each distinct value by its first appearance."""
    rank: dict[Hashable, int] = {}
    for value in values:
        if value not in rank:
            rank[value] = len(rank)
    return rank


def as_float(value: object) -> float:
    """A pandas scalar as a float; missing (``None``, ``NA``, ``NaT``) or not a number: NaN.
    The one conversion the table and the plots (:mod:`sandboxkit.lab.plots`) share."""
    if value is None or value is pd.NA or value is pd.NaT:
        return math.nan
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def stall_table(df: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Fold the experiment's per-cycle frame into one row per (policy, ghost).

    Rows come in a stable order: policies ``blocking``, ``kick``, ``cursor`` first, any
    other policy after them in order of first appearance; within a policy, ghosts in order
    of first appearance in ``df``.

    Columns (see :data:`STALL_TABLE_COLUMNS`):

    - ``policy``, ``ghost``: the configuration.
    - ``cycles``: number of cycles ``n``; ``stalled_cycles``: number of stalled cycles
      ``k`` (the per-cycle frame's ``stalled`` is one cycle's bool).
    - ``stalls``: ``"k/n"``, as the incident reports state it (``"6/6"``).
    - ``stall_rate``: ``k / n``; ``ci_low``, ``ci_high``: its Wilson interval at
      ``confidence``.
    - ``median_time_to_complete``, ``max_time_to_complete``: over the cycles that completed
      (``time_to_complete`` not NaN), NaN if none did.
    - ``kicks``, ``gaps``: totals over the configuration's cycles (missing values count 0).

    The confidence level is recorded in ``table.attrs["confidence"]``.

    Args:
        df: per-cycle frame with at least the columns in :data:`STALL_TABLE_REQUIRED`.
        confidence: confidence level of the interval, strictly between 0 and 1.

    Returns:
        The table. An empty ``df`` (no rows) gives an empty table with the same columns;
        a frame with neither rows nor columns (``pd.DataFrame([])`` of zero cycles) is
        accepted as empty too.

    Raises:
        ValueError: if required columns are missing (all of them are named), if
            ``policy``, ``ghost`` or ``stalled`` has missing values, or if ``confidence``
            is out of range.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be strictly between 0 and 1, got {confidence!r}")
    if len(df.columns) == 0 and len(df) == 0:
        return _empty_table(confidence)
    require_columns(df, STALL_TABLE_REQUIRED, "per-cycle frame")
    if len(df) == 0:
        return _empty_table(confidence)
    for column in ("policy", "ghost", "stalled"):
        if bool(df[column].isna().any()):
            raise ValueError(f"column {column!r} has missing values")

    policy_ranks = policy_rank(df["policy"])
    ghost_ranks = _first_appearance(df["ghost"])

    rows: list[dict[str, object]] = []
    grouped = df.groupby(["policy", "ghost"], sort=False)
    for key, group in grouped:
        policy, ghost = key
        n = len(group)
        k = int(group["stalled"].astype(bool).sum())
        low, high = wilson_interval(k, n, confidence)
        times = pd.to_numeric(group["time_to_complete"], errors="coerce").dropna()
        rows.append(
            {
                "policy": policy,
                "ghost": ghost,
                "cycles": n,
                "stalled_cycles": k,
                "stalls": f"{k}/{n}",
                "stall_rate": k / n,
                "ci_low": low,
                "ci_high": high,
                "median_time_to_complete": as_float(times.median()) if len(times) else math.nan,
                "max_time_to_complete": as_float(times.max()) if len(times) else math.nan,
                "kicks": int(pd.to_numeric(group["kicks"], errors="coerce").fillna(0).sum()),
                "gaps": int(pd.to_numeric(group["gaps"], errors="coerce").fillna(0).sum()),
            }
        )
    rows.sort(key=lambda r: (policy_ranks[_key(r["policy"])], ghost_ranks[_key(r["ghost"])]))

    table: pd.DataFrame = pd.DataFrame(rows, columns=list(STALL_TABLE_COLUMNS))
    for column in _INT_COLUMNS:
        table[column] = table[column].astype("int64")
    for column in _FLOAT_COLUMNS:
        table[column] = table[column].astype("float64")
    table.attrs["confidence"] = confidence
    return table


def _key(value: object) -> Hashable:
    """``value`` as a dict key (groupby keys are hashable by construction)."""
    assert isinstance(value, Hashable)
    return value


def format_duration(seconds: float) -> str:
    """Render a duration for humans: ``"850 ms"`` below one second, ``"1.25 s"`` above,
    ``"—"`` for NaN."""
    if seconds is None or math.isnan(seconds):
        return "—"
    if abs(seconds) < 1.0:
        return f"{seconds * 1000.0:.0f} ms"
    if abs(seconds) < 100.0:
        return f"{seconds:.2f} s"
    return f"{seconds:.0f} s"


def _percent(value: float) -> str:
    return f"{value * 100.0:.0f}%"


def format_stall_table(table: pd.DataFrame) -> str:
    """Render a :func:`stall_table` result as aligned plain text for the CLI.

    Stall rates are shown as a percentage with their interval, e.g. ``100% [61%–100%]``;
    completion times in ms below a second, in s above.

    Raises:
        ValueError: if ``table`` lacks any of :data:`STALL_TABLE_COLUMNS`.
    """
    require_columns(table, STALL_TABLE_COLUMNS, "stall table")
    confidence = table.attrs.get("confidence", 0.95)
    rate_header = f"stall rate [{confidence * 100:g}% CI]"
    headers = ("policy", "ghost", "stalls", rate_header, "median done", "max done", "kicks", "gaps")
    right_aligned = {2, 3, 4, 5, 6, 7}
    if len(table) == 0:
        return "  ".join(headers) + "\n(no cycles)"

    body: list[tuple[str, ...]] = []
    for record in table.to_dict("records"):
        rate = (
            f"{_percent(as_float(record['stall_rate']))} "
            f"[{_percent(as_float(record['ci_low']))}–{_percent(as_float(record['ci_high']))}]"
        )
        body.append(
            (
                str(record["policy"]),
                str(record["ghost"]),
                str(record["stalls"]),
                rate,
                format_duration(as_float(record["median_time_to_complete"])),
                format_duration(as_float(record["max_time_to_complete"])),
                str(record["kicks"]),
                str(record["gaps"]),
            )
        )
    widths = [max(len(r[i]) for r in [headers, *body]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(widths[i]) if i in right_aligned else cell.ljust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in body)])
