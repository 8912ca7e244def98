"""What a :class:`~sandboxkit.notebook.dashboard.SandboxDashboard` renders, as plain
functions of its state: the two tables (rows as DataFrames, and as HTML), the title and
the status line. No widget here: the dashboard's flush sets these values into its widgets,
and tests read the same values without a browser.
"""

from __future__ import annotations

import html
import shlex

import pandas as pd

from sandboxkit.client.results import ProcessInfo, SandboxInfo

__all__ = [
    "PROCESS_COLUMNS",
    "SANDBOX_COLUMNS",
    "TABLE_STYLE",
    "command_line",
    "processes_frame",
    "processes_html",
    "sandboxes_frame",
    "sandboxes_html",
    "status_html",
    "title_html",
]

PROCESS_COLUMNS = ["pid", "command", "state", "consumers", "exit_code"]
"""Columns of :meth:`SandboxDashboard.processes_frame` (the process table)."""

SANDBOX_COLUMNS = ["sandbox_id", "state", "processes", "isolation", "fanout", "selected"]
"""Columns of :meth:`SandboxDashboard.sandboxes_frame` (the sandbox table)."""


_COMMAND_WIDTH = 90

TABLE_STYLE = (
    "<style>"
    ".sandboxkit-table{border-collapse:collapse;font-size:12px;margin:4px 0}"
    ".sandboxkit-table th{background:#f2f2f2;text-align:left;padding:3px 10px;"
    "border-bottom:1px solid #ccc;font-weight:600}"
    ".sandboxkit-table td{padding:3px 10px;border-bottom:1px solid #eee;"
    "font-family:ui-monospace,monospace;white-space:pre}"
    ".sandboxkit-table tr:hover td{background:#fafafa}"
    "</style>"
)
"""Scoped styles of the dashboard's tables (class ``sandboxkit-table``)."""


def command_line(info: ProcessInfo) -> str:
    """The command as a person reads it: one line (a multi-line ``-c`` script shows its
    lines joined with ``⏎``, never ``\\n`` escapes), cut to a readable width."""
    text = info.cmd if info.cmd is not None else shlex.join(info.argv or [])
    text = " ⏎ ".join(line.strip() for line in text.splitlines() if line.strip())
    return text if len(text) <= _COMMAND_WIDTH else text[: _COMMAND_WIDTH - 1] + "…"


def processes_frame(processes: list[ProcessInfo]) -> pd.DataFrame:
    """The process table (columns :data:`PROCESS_COLUMNS`)."""
    rows = [
        {
            "pid": p.pid,
            "command": command_line(p),
            "state": p.state,
            "consumers": p.consumers,
            "exit_code": p.exit_code,
        }
        for p in processes
    ]
    frame: pd.DataFrame = pd.DataFrame(rows, columns=PROCESS_COLUMNS)
    frame["exit_code"] = frame["exit_code"].astype("Int64")
    return frame


def sandboxes_frame(sandboxes: list[SandboxInfo], selected: str | None) -> pd.DataFrame:
    """The sandbox table (columns :data:`SANDBOX_COLUMNS`); ``selected`` is marked."""
    rows = [
        {
            "sandbox_id": s.sandbox_id,
            "state": s.state,
            "processes": s.processes,
            "isolation": s.isolation,
            "fanout": s.fanout,
            "selected": s.sandbox_id == selected,
        }
        for s in sandboxes
    ]
    frame: pd.DataFrame = pd.DataFrame(rows, columns=SANDBOX_COLUMNS)
    return frame


def sandboxes_html(frame: pd.DataFrame, show_all: bool) -> str:
    """The sandbox table as HTML, or what an empty one means under the toggles."""
    if len(frame):
        table: str = frame.to_html(index=False, escape=True, border=0, classes="sandboxkit-table")
        return TABLE_STYLE + table
    if not show_all:
        return "<i>no sandboxes of this notebook (tick “all sandboxes” to see the others)</i>"
    return "<i>no sandboxes</i>"


def processes_html(frame: pd.DataFrame) -> str:
    """The process table as HTML (an unknown exit code left blank)."""
    if not len(frame):
        return "<i>no processes</i>"
    table: str = frame.to_html(
        index=False, escape=True, border=0, na_rep="", classes="sandboxkit-table"
    )
    return TABLE_STYLE + table


def title_html(selected: str | None, info: SandboxInfo | None, provider: str | None) -> str:
    """The title: the selected sandbox and its state, what a ``provider``'s sandboxes
    cannot measure, and a sandbox that asked for isolation and did not get it."""
    state = info.state if info is not None else ("—" if selected is None else "?")
    title = "<b>sandboxkit</b> — " + (
        f"sandbox <code>{html.escape(selected)}</code> is <b>{state}</b>"
        if selected is not None
        else "no sandbox selected"
    )
    if provider is not None:  # what it cannot measure, said where people look
        title += (
            f" · on {html.escape(provider.upper())}: consumers are client-side "
            "only (this kernel's readers)"
        )
    if info is not None and info.isolation == "none" and info.isolation_reason:
        # Never pretend: a sandbox that asked for isolation and did not get it says so.
        title += (
            " · <span style='color:#d62728'>not isolated: "
            f"{html.escape(info.isolation_reason)}</span>"
        )
    return title


def status_html(message: str, error: str | None) -> str:
    """The status line: the last action's error in red, else its outcome."""
    if error:
        return f"<span style='color:#d62728'>{html.escape(error)}</span>"
    return html.escape(message)
