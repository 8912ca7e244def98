"""The fault lab's daemon side, fenced off from the production path.

Everything the daemon does only to reproduce the public failures lives here: the shipped
fan-out designs behind F1/F2 (:mod:`.fanout`: ``blocking``, ``kick``) and pause-snapshot
ghosts (:mod:`.ghost`), driven per sandbox by one :class:`~.lab.FaultLab` built from the
sandbox's one :class:`~sandboxkit.lab_options.LabOptions` (the ``lab`` object of
``POST /sandboxes``). A sandbox created without it never touches this package.
"""

from sandboxkit.daemon.faults.fanout import BlockingFanout, KickFanout
from sandboxkit.daemon.faults.ghost import GhostSink, Relay
from sandboxkit.daemon.faults.lab import FaultLab
from sandboxkit.lab_options import FANOUT_POLICIES, LabOptions

__all__ = [
    "FANOUT_POLICIES",
    "BlockingFanout",
    "FaultLab",
    "GhostSink",
    "KickFanout",
    "LabOptions",
    "Relay",
]
