"""What a :class:`~sandboxkit.notebook.dashboard.SandboxDashboard` shows, as plain data:
:class:`DashboardState` — the sandboxes the daemon knows, which of them the toggles show,
the one selected (the one the buttons act on), its processes, the last outcome — and
:func:`said`, a lifecycle event of the journal in words.

The dashboard's handlers and its reads of the daemon change this state under a lock; its
flush renders it (:mod:`sandboxkit.notebook.dashboard_render`). Tests read it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sandboxkit.client.results import ProcessInfo, SandboxInfo

__all__ = ["SHOW_ALL", "SHOW_KILLED", "DashboardState", "said"]

SHOW_ALL = "all sandboxes"
"""The label of the toggle that shows every sandbox, not only this notebook's."""

SHOW_KILLED = "killed too"
"""The label of the toggle that shows killed sandboxes as well."""


@dataclass
class DashboardState:
    """Everything the dashboard shows, as plain data.

    ``version`` grows on every change, so a flush renders only when something changed.
    """

    selected: str | None = None
    """The sandbox the buttons act on (always one of :meth:`shown`, or ``None``)."""
    sandboxes: list[SandboxInfo] = field(default_factory=list)
    """Every sandbox the daemon knows (killed ones too, until the daemon forgets them)."""
    mine: frozenset[str] = frozenset()
    """This notebook's sandboxes: created or connected to in this kernel."""
    show_all: bool = False
    """Show every sandbox, not only this notebook's."""
    show_killed: bool = False
    """Show killed sandboxes too."""
    processes: list[ProcessInfo] = field(default_factory=list)
    """The processes of the selected sandbox."""
    message: str = ""
    """The outcome of the last action."""
    error: str | None = None
    """The error of the last action or refresh, if it failed."""
    version: int = 0

    @property
    def selected_info(self) -> SandboxInfo | None:
        """The selected sandbox as last read from the daemon."""
        return next((s for s in self.sandboxes if s.sandbox_id == self.selected), None)

    def visible(self, info: SandboxInfo) -> bool:
        """Whether the toggles show ``info`` (the selected one is always shown: the
        title says what became of it, killed included)."""
        if info.sandbox_id == self.selected:
            return True
        if info.state == "killed" and not self.show_killed:
            return False
        return self.show_all or info.sandbox_id in self.mine

    def shown(self) -> list[SandboxInfo]:
        """The sandboxes the table and the selector show, in the daemon's order."""
        return [s for s in self.sandboxes if self.visible(s)]

    def toggle(self, *, show_all: bool | None = None, show_killed: bool | None = None) -> None:
        """Set the toggles given. A selected sandbox they now hide is deselected: the
        buttons never act on a sandbox the dashboard does not show."""
        if show_all is not None:
            self.show_all = show_all
        if show_killed is not None:
            self.show_killed = show_killed
        selected = self.selected
        info = self.selected_info
        self.selected = None  # is it still shown without being selected?
        if selected is not None and (info is None or self.visible(info)):
            self.selected = selected
        self.version += 1

    def next_choice(self, leaving: str) -> str | None:
        """The sandbox to select once ``leaving`` is gone: a live one shown, or none —
        never one the dashboard does not show."""
        return next(
            (s.sandbox_id for s in self.shown() if s.sandbox_id != leaving and s.state != "killed"),
            None,
        )


def said(events: list[dict[str, Any]], selected: str | None) -> str | None:
    """The newest lifecycle change of the ``selected`` sandbox among ``events``, in
    words (``sandbox sbx-… paused (timeout)``), or ``None``."""
    for event in reversed(events):
        kind = str(event.get("kind", ""))
        if event.get("sandbox_id") != selected or not kind.startswith("sandbox."):
            continue
        if kind == "sandbox.created":
            continue
        reason = event.get("reason")
        why = f" ({reason})" if reason not in (None, "user") else ""
        return f"sandbox {selected} {kind.removeprefix('sandbox.')}{why}"
    return None
