"""One kill's SIGTERMs to a launch (see :mod:`~sandboxkit.daemon.freezer.base`): each of
its processes gets one, also a process born after the first look. An isolated command is
born 2-3 ms after its launch is spawned (bubblewrap makes its namespaces first), and one
killed in between ran on, unsignalled, until the SIGKILL at the end of the grace. A PID
namespace's init, which no SIGTERM from outside its namespace reaches, gets SIGKILL once
nothing is left under it and its monitor is gone (bubblewrap's, killed before its
namespace was set up, waits forever for its monitor, which that SIGTERM ended, holding the
command's pipes; one whose monitor lives is passing on how its command ended)."""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Final

from sandboxkit.daemon.freezer.base import Freezer
from sandboxkit.daemon.freezer.proc import Ident

__all__ = ["FIRST_LOOK", "LAST_LOOK", "Termination"]

FIRST_LOOK: Final = 0.005
LAST_LOOK: Final = 0.25
"""Seconds between looks for processes born since the SIGTERM: from the first, doubling
up to the last."""


class Termination:
    """The SIGTERMs of one kill of ``launch``: :meth:`send` at each look (nothing without
    a ``freezer``: the launch was never started)."""

    def __init__(self, freezer: Freezer | None, launch: str, *, contained: bool) -> None:
        self._freezer = freezer
        self._launch = launch
        self._contained = contained
        self._termed: set[Ident] = set()

    def send(self) -> None:
        """SIGTERM, then SIGCONT (a stopped process hears it then), each process of the
        launch that has not had them; SIGKILL a namespace's init with nothing under it."""
        if self._freezer is None:
            return
        fresh = set(self._termed)
        self._freezer.signal_launch(self._launch, signal.SIGTERM, fresh)
        self._freezer.signal_launch(self._launch, signal.SIGCONT, set(self._termed))
        self._termed |= fresh
        if self._contained:
            self._freezer.end_empty_inits(self._launch)

    def missed(self, pids: Iterable[int]) -> bool:
        """Whether any of ``pids`` had no SIGTERM of this kill's."""
        return not set(pids) <= {ident.pid for ident in self._termed}
