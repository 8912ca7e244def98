"""The freezer: all processes of a sandbox, paused, resumed and killed as one.

A sandbox runs many processes: the leaders the daemon starts, their children, and
daemons that double-fork away and call ``setsid()``. "Pause" must stop all of them,
"resume" continue all of them, "kill" reach every one — and a daemon's death must not
leave them running unnoticed. Two backends do it:

``cgroup`` (:mod:`.cgroup`)
    one cgroup v2 per sandbox; nothing escapes it. Used when a writable cgroup2
    hierarchy offers the freezer (:mod:`.cgroupfs`); the daemon's own cgroup and what a
    dead daemon left are handled by :mod:`.daemon_cgroup`.
``signals`` (:mod:`.signals`)
    ``SIGSTOP``/``SIGCONT`` to each member found in ``/proc`` (:mod:`.proc`) by
    parentage, session and the owner mark every process carries (:mod:`.marks`).

What every freezer does, including which processes one launch started, is
:class:`~.base.Freezer`. :func:`make_freezer` picks the backend, as
``DaemonConfig.freezer``, ``SANDBOXKIT_FREEZER`` and ``sandboxkit serve --freezer`` name it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

from sandboxkit.daemon.freezer.base import DEFAULT_FREEZE_TIMEOUT, Freezer
from sandboxkit.daemon.freezer.cgroup import CgroupFreezer
from sandboxkit.daemon.freezer.cgroupfs import cgroup_v2_available
from sandboxkit.daemon.freezer.daemon_cgroup import (
    daemon_cgroup_path,
    reap_cgroup,
    release_daemon_cgroup,
)
from sandboxkit.daemon.freezer.marks import MARK_VAR, reap_marked_orphans
from sandboxkit.daemon.freezer.signals import SignalFreezer

__all__ = [
    "FREEZERS",
    "FREEZER_ENV_VAR",
    "MARK_VAR",
    "CgroupFreezer",
    "Freezer",
    "SignalFreezer",
    "cgroup_v2_available",
    "daemon_cgroup_for",
    "make_freezer",
    "reap_cgroup",
    "reap_marked_orphans",
    "release_daemon_cgroup",
]

logger = logging.getLogger(__name__)

FREEZER_ENV_VAR: Final = "SANDBOXKIT_FREEZER"
"""Read by :func:`make_freezer` when asked for ``"auto"``: forces either backend."""

FREEZERS: Final = ("auto", "cgroup", "signals")


def daemon_cgroup_for(backend: str = "auto") -> Path | None:
    """Where this daemon's cgroup is (made on its first cgroup sandbox) if ``backend``
    (as :func:`make_freezer` takes it) may use one; None if it cannot."""
    if backend == "auto":
        backend = os.environ.get(FREEZER_ENV_VAR, "").strip().lower() or "auto"
    return None if backend == "signals" else daemon_cgroup_path()


def make_freezer(
    sandbox_id: str, backend: str = "auto", *, freeze_timeout: float = DEFAULT_FREEZE_TIMEOUT
) -> Freezer:
    """The freezer of a new sandbox.

    ``backend`` is ``"auto"`` (cgroup if available, else signals, unless
    ``SANDBOXKIT_FREEZER`` names one), ``"cgroup"`` (RuntimeError if unavailable) or
    ``"signals"``. ValueError for any other name.
    """
    if backend not in FREEZERS:
        raise ValueError(f"unknown freezer backend {backend!r}; use {FREEZERS}")
    forced = backend != "auto"
    if backend == "auto":
        env = os.environ.get(FREEZER_ENV_VAR, "").strip().lower() or "auto"
        if env not in FREEZERS:
            raise ValueError(f"invalid {FREEZER_ENV_VAR}={env!r}; use {FREEZERS}")
        backend, forced = env, env != "auto"
    if backend == "signals":
        return SignalFreezer(sandbox_id, freeze_timeout)
    if backend == "cgroup" or cgroup_v2_available():
        try:
            return CgroupFreezer(sandbox_id, freeze_timeout)
        except RuntimeError:
            if forced:
                raise
            logger.warning("cgroup freezer unusable; falling back to signals")
    return SignalFreezer(sandbox_id, freeze_timeout)
