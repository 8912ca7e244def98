"""The fault lab's options and vocabulary, shared by the client and the daemon.

A sandbox created with ``lab=LabOptions(...)`` runs the lab's fault machinery (the shipped
fan-out designs behind F1/F2, pause-snapshot ghosts); one created without it is a
production sandbox: ``cursor`` fan-out and no ghosts. The client sends the options as the
``lab`` object of ``POST /sandboxes``; the daemon validates them with this same model and
applies them behind :mod:`sandboxkit.daemon.faults`, the one place that knows about them.

This module sits at the bottom of the package (it imports only msgspec), so that both
sides can use it without the client importing the daemon or the other way round.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from msgspec import Meta, Struct

__all__ = [
    "FANOUT_POLICIES",
    "GHOST_BUFFER",
    "GHOST_KINDS",
    "QUEUE_POLICIES",
    "FanoutPolicy",
    "GhostKind",
    "LabCursorIgnored",
    "LabOptions",
]

FanoutPolicy = Literal["blocking", "kick", "cursor"]
"""How a process's output reaches its consumers: ``cursor`` is sandboxkit's contract (each
consumer reads the log through its own cursor); ``blocking`` and ``kick`` are the shipped
designs the lab reproduces (one shared loop feeding per-consumer queues)."""

FANOUT_POLICIES: tuple[str, ...] = get_args(FanoutPolicy)
"""Every fan-out policy, in the order the lab shows them: the shipped designs first."""

QUEUE_POLICIES: tuple[str, ...] = ("blocking", "kick")
"""The policies that feed consumers from a shared loop: they deliver new output only."""

GhostKind = Literal["pause-snapshot", "leaky", "frozen", "none"]
"""How the lab makes a consumer that stops reading: the daemon's own pause-snapshot ghost
(``pause_ghosts``), a client that never reads again (``leaky``), a SIGSTOPped reader
process (``frozen``), or none."""

GHOST_KINDS: tuple[str, ...] = get_args(GhostKind)
"""Every ghost kind, in the order the lab shows them."""

GHOST_BUFFER = 4096
"""A ghost's socket buffer by default (bytes): small, like a socket restored from a
snapshot, so a ghost wedges after a response or two, as in the public reports."""


class LabOptions(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The fault lab's settings for one sandbox (``lab=`` of ``Sandbox.create``).

    Unset fields (``None``) take the daemon's defaults; the sandbox's description reports
    the values in force.
    """

    fanout: FanoutPolicy = "cursor"
    """The fan-out policy of every process of the sandbox."""
    kick_grace: Annotated[float, Meta(ge=0, le=3600)] | None = None
    """``kick``: how long the shared loop waits on a full queue before kicking (s)."""
    queue: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    """``blocking``/``kick``: each consumer's queue length, in chunks."""
    pause_ghosts: bool = False
    """Streams open at a pause become ghosts on resume, as after a snapshot restore (F1)."""
    ghost_buffer: Annotated[int, Meta(ge=1, le=16 * 1024 * 1024)] | None = None
    """A pause-snapshot ghost's socket buffer (bytes)."""


class LabCursorIgnored(UserWarning):
    """A stream was attached with a cursor the sandbox's lab fan-out policy cannot honour:
    ``blocking`` and ``kick`` deliver new output only, as the designs they reproduce did.
    The stream started where the policy put it (its start frame's ``cursor``).

    No longer raised: the daemon now sends such a stream a gap of the exact size it
    skipped (reason ``not_replayed``), which every reader handles as any gap — a marker in
    the panel, ``on_gap``, or an :class:`~sandboxkit.errors.OutputGapWarning`. Kept so
    that code which filters it still imports."""
