"""What a finished command produced: :class:`CommandResult`.

It lives below both the error vocabulary and the client, because errors carry one
(``CommandExitError.result``, ``OutputIncomplete.result``) and the client returns one;
it imports nothing of sandboxkit. Import it from :mod:`sandboxkit`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CommandResult"]


@dataclass
class CommandResult:
    """What a finished command produced."""

    stdout: str
    stderr: str
    exit_code: int | None
    pid: int | None = None
    error: str | None = None
    bytes_lost: int = 0
    """Output bytes missing from ``stdout``/``stderr`` (lost to gaps or beyond
    ``keep_output``)."""
    reason: str | None = None
    """Why it ended: ``exit``, or what ended it — ``oom`` (the sandbox's memory limit),
    ``timeout``, ``user``, ``restart``, ``sandbox_…``; ``None`` when not known."""
