"""Plain result types returned by the client. :class:`CommandResult` is defined in
:mod:`sandboxkit.results`, below the errors that carry one; :class:`SandboxInfo` and
:class:`ProcessInfo` in :mod:`sandboxkit.vocab`, the structs the daemon describes them
with (the client decodes its answers into them). All are re-exported here."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sandboxkit.errors import SandboxkitError
from sandboxkit.results import CommandResult
from sandboxkit.vocab import ProcessInfo, SandboxInfo

__all__ = [
    "CommandResult",
    "Failed",
    "Ok",
    "Outcome",
    "ProcessInfo",
    "SandboxInfo",
    "attempt",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Ok(Generic[T]):
    """A call that succeeded, for harnesses that branch on outcomes (``try_*``)."""

    value: T
    ok: bool = True


@dataclass(frozen=True)
class Failed:
    """A call that failed with a typed sandboxkit error."""

    error: SandboxkitError
    ok: bool = False

    @property
    def code(self) -> str:
        """The error's wire code, e.g. ``result_unavailable``."""
        return self.error.code


Outcome = Ok[T] | Failed


async def attempt(aw: Awaitable[T]) -> Ok[T] | Failed:
    """Await ``aw``; a typed sandboxkit error becomes :class:`Failed` instead of raising."""
    try:
        return Ok(await aw)
    except SandboxkitError as exc:
        return Failed(exc)
