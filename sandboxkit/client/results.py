"""Plain result types returned by the client (:class:`CommandResult` is defined in
:mod:`sandboxkit.results`, below the errors that carry one, and re-exported here)."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

from sandboxkit.errors import SandboxkitError
from sandboxkit.lab_options import LabOptions
from sandboxkit.results import CommandResult

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
class ProcessInfo:
    """A process as the daemon describes it."""

    pid: int
    sandbox_id: str
    cmd: str | None
    argv: list[str] | None
    state: str
    exit_code: int | None
    started_at: float
    ended_at: float | None
    head: int
    total_bytes: int
    consumers: int
    restarted_from: int | None
    restarted_to: int | None
    kill_reason: str | None = None
    """Why sandboxkit killed it (``timeout``, ``kill``, ``sandbox_killed`` …), else ``None``."""
    timeout: float | None = None
    """The deadline it was started with (``None``: none, F10)."""
    tag: str | None = None
    log_storage: str | None = None
    """Where the daemon keeps this process's output: ``disk``, or ``memory`` once the disk
    refused a write (the ``process.log_degraded`` event says why); ``None`` where the
    backend does not say."""
    log_retention_bytes: int | None = None
    """The output retention in force (smaller once the log fell back to memory)."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The daemon's JSON as received."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessInfo:
        """Build from the daemon's JSON."""
        spec = data.get("spec", {})
        return cls(
            pid=data["pid"],
            sandbox_id=data["sandbox_id"],
            cmd=spec.get("cmd"),
            argv=spec.get("argv"),
            state=data["state"],
            exit_code=data.get("exit_code"),
            started_at=data["started_at"],
            ended_at=data.get("ended_at"),
            head=data.get("head", 0),
            total_bytes=data.get("total_bytes", 0),
            consumers=data.get("consumers", 0),
            restarted_from=data.get("restarted_from"),
            restarted_to=data.get("restarted_to"),
            kill_reason=data.get("kill_reason"),
            timeout=spec.get("timeout"),
            tag=spec.get("tag"),
            log_storage=data.get("log_storage"),
            log_retention_bytes=data.get("log_retention_bytes"),
            raw=data,
        )


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the daemon describes it."""

    sandbox_id: str
    state: str
    timeout: float | None
    on_timeout: str
    auto_resume: bool
    created_at: float
    processes: int
    metadata: dict[str, str]
    workdir: str | None = None
    """The sandbox's own working directory on the daemon's machine."""
    freezer: str | None = None
    """How the daemon freezes its processes: ``cgroup`` or ``signals``."""
    fanout: str = "cursor"
    """How output reaches its consumers: ``cursor`` unless ``lab`` chose another."""
    lab: LabOptions | None = None
    """The fault-lab options in force (every field set), or ``None``: a production
    sandbox."""
    killed_at: float | None = None
    isolation: str = "none"
    """What holds for its processes: ``namespaces`` or ``none`` (``docs/isolation.md``)."""
    isolation_reason: str = ""
    """What the host lacks, when ``isolation="auto"`` gave ``none`` (empty otherwise)."""
    allow_internet_access: bool = True
    limits: dict[str, float] = field(default_factory=dict)
    """The limits asked for (sizes in bytes)."""
    limits_enforced: dict[str, str] = field(default_factory=dict)
    """How each limit holds: ``cgroup``, ``cgroup-v1``, ``rlimit`` or ``none``."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The daemon's JSON as received."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxInfo:
        """Build from the daemon's JSON."""
        return cls(
            sandbox_id=data["sandbox_id"],
            state=data["state"],
            timeout=data.get("timeout"),
            on_timeout=data.get("on_timeout", "pause"),
            auto_resume=bool(data.get("auto_resume")),
            created_at=data["created_at"],
            processes=data.get("processes", 0),
            metadata=data.get("metadata", {}),
            workdir=data.get("workdir"),
            freezer=data.get("freezer"),
            fanout=data.get("fanout") or "cursor",
            lab=None if data.get("lab") is None else msgspec.convert(data["lab"], LabOptions),
            killed_at=data.get("killed_at"),
            isolation=data.get("isolation", "none"),
            isolation_reason=data.get("isolation_reason", ""),
            allow_internet_access=data.get("allow_internet_access", True),
            limits=dict(data.get("limits") or {}),
            limits_enforced=dict(data.get("limits_enforced") or {}),
            raw=data,
        )


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
