"""The owner object of one E2B sandbox client: the SDK sandbox, the process logs and their
taps, the journal, the state as this client knows it. The sandbox, commands and files
backends, the taps and the readers all share it — through its public members, never each
other's private ones."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from e2b import NotFoundException

from sandboxkit.client.results import ProcessInfo, SandboxInfo
from sandboxkit.client.tasks import TaskOwner
from sandboxkit.errors import ProviderUnsupported, ResultUnavailable
from sandboxkit.providers.e2b.journal import Journal
from sandboxkit.providers.e2b.log import ProcessLog
from sandboxkit.providers.e2b.tap import Tap
from sandboxkit.providers.e2b.target import DEFAULT_LOG_BYTES, Target
from sandboxkit.vocab import ProcessSpecInfo, SandboxState

__all__ = ["E2BSession", "spec_of"]


def spec_of(info: Any) -> dict[str, Any]:
    """A running process's command as the SDK lists it (``/bin/bash -l -c <cmd>``)."""
    args = list(info.args)
    cmd = (
        args[2] if info.cmd == "/bin/bash" and args[:2] == ["-l", "-c"] and len(args) > 2 else None
    )
    return {
        "cmd": cmd,
        "argv": None if cmd is not None else [info.cmd, *args],
        "envs": dict(info.envs),
        "cwd": info.cwd,
    }


class E2BSession:
    """What one client of one E2B sandbox knows and owns (see the package docstring)."""

    def __init__(
        self,
        sdk: Any,
        sandbox_id: str,
        target: Target,
        *,
        timeout: float | None,
        metadata: dict[str, str] | None,
        keep_bytes: int = DEFAULT_LOG_BYTES,
    ) -> None:
        self.sdk = sdk
        """The SDK's ``e2b.AsyncSandbox``."""
        self.sandbox_id = sandbox_id
        self.target = target
        self.debug = target.debug
        self.owner = TaskOwner(sandbox_id)
        """Every tap and reader of this client is its task, cancelled on close."""
        self.keep_bytes = keep_bytes
        self.info = SandboxInfo(
            sandbox_id=sandbox_id,
            state="running",
            timeout=timeout,
            on_timeout="kill",
            auto_resume=False,
            created_at=time.time(),
            processes=0,
            metadata=dict(metadata or {}),
            fanout="e2b",
        )
        self.logs: dict[int, ProcessLog] = {}
        self.journal = Journal(sandbox_id)
        self.resumed = asyncio.Event()
        """Set while the sandbox runs; a tap cut by a pause waits on it to reopen."""
        self.resumed.set()

    # -- processes -------------------------------------------------------------------

    def new_log(self, pid: int, spec: dict[str, Any]) -> ProcessLog:
        """The log of ``pid`` (made now if there is none)."""
        plog = self.logs.get(pid)
        if plog is None:
            plog = self.logs[pid] = ProcessLog(pid, spec, self.keep_bytes)
        return plog

    def tap(self, plog: ProcessLog, handle: Any | None) -> None:
        """Follow ``plog``'s process through the SDK ``handle`` just opened (or one the
        tap opens), for as long as this client lives."""
        tap = plog.tap = Tap(self, plog)
        self.owner.spawn(tap.run(handle), name=f"sandboxkit-e2b-tap-{plog.pid}")

    async def ensure_tap(self, pid: int) -> None:
        """A process this client does not tap yet is tapped from now: what it printed
        before is an unknown-size gap. An unknown pid raises ResultUnavailable."""
        plog = self.logs.get(pid)
        if plog is not None and (plog.tap is not None or plog.ended):
            return
        tap_log = plog or ProcessLog(pid, {"cmd": None, "argv": None, "envs": {}, "cwd": None}, 0)
        tap_log.keep_bytes = self.keep_bytes
        probe = Tap(self, tap_log)
        try:
            handle = await probe.open()
        except NotFoundException as exc:
            raise ResultUnavailable(
                f"E2B knows no running process {pid} in sandbox {self.sandbox_id}",
                pid=pid,
                reason="unknown_pid",
            ) from exc
        if plog is None:
            self.logs[pid] = tap_log
            with contextlib.suppress(Exception):
                for proc in await self.sdk.commands.list():
                    if proc.pid == pid:
                        tap_log.spec = spec_of(proc)
        # Followed from now: what it printed before this client attached is unknown.
        tap_log.unknown_gap("E2B replays nothing printed before this attach")
        tap_log.tap = probe
        self.owner.spawn(probe.run(handle), name=f"sandboxkit-e2b-tap-{pid}")

    def process_info(self, plog: ProcessLog) -> ProcessInfo:
        spec = plog.spec
        readers = sum(1 for r in plog.readers if r.closed_at is None)
        return ProcessInfo(
            pid=plog.pid,
            sandbox_id=self.sandbox_id,
            spec=ProcessSpecInfo(cmd=spec.get("cmd"), argv=spec.get("argv")),
            state=plog.state(),
            exit_code=plog.exit_code,
            started_at=plog.started_at,
            ended_at=plog.ended_at,
            head=plog.head,
            total_bytes=plog.head,
            consumers=readers,
            restarted_from=plog.restarted_from,
            restarted_to=plog.restarted_to,
        )

    # -- the sandbox's state ---------------------------------------------------------

    def set_state(self, state: SandboxState) -> None:
        alive = sum(1 for p in self.logs.values() if not p.ended)
        self.info = SandboxInfo(
            sandbox_id=self.sandbox_id,
            state=state,
            timeout=self.info.timeout,
            on_timeout=self.info.on_timeout,
            auto_resume=self.info.auto_resume,
            created_at=self.info.created_at,
            processes=alive,
            metadata=self.info.metadata,
            fanout="e2b",
        )

    def cloud_only(self, operation: str) -> None:
        """ProviderUnsupported in debug mode, which has no control plane."""
        if self.debug:
            raise no_control_plane(operation)


def no_control_plane(operation: str) -> ProviderUnsupported:
    """What asking debug mode for ``operation`` raises: it has no control plane."""
    return ProviderUnsupported(
        f"E2B's debug mode has no control plane, so no {operation}: it needs E2B's "
        "cloud (set E2B_API_KEY) or a sandboxkit daemon's control plane "
        "(sandboxkit serve --envd; see docs/e2b.md)",
        provider="e2b",
        operation=operation,
    )
