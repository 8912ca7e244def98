"""A sandbox: a working directory, an environment and a process tree that pauses as one."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time
from collections import deque
from pathlib import Path
from typing import Any

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.events import EventJournal
from sandboxkit.daemon.fanout import CursorFanout, Fanout
from sandboxkit.daemon.faults.lab import FaultLab
from sandboxkit.daemon.fds import FdBudget
from sandboxkit.daemon.file_span import unisolated_ran, zero_copy_check
from sandboxkit.daemon.freezer import Freezer
from sandboxkit.daemon.isolation import NamespacePlan
from sandboxkit.daemon.lag_reserve import LAG_RESERVE, LagLoan
from sandboxkit.daemon.launcher_slot import LauncherSlot, slot_kind
from sandboxkit.daemon.limits import LimitEnforcer
from sandboxkit.daemon.off_loop import off_loop
from sandboxkit.daemon.output_log import OutputLog
from sandboxkit.daemon.process import ManagedProcess
from sandboxkit.daemon.process_spec import Launch, ProcessSpec, prepare
from sandboxkit.daemon.sandbox_paths import remove_directory
from sandboxkit.daemon.segment_store import remove_tree
from sandboxkit.daemon.standby import SCRIPT, Quiet, StandbySlot
from sandboxkit.errors import (
    InvalidArgument,
    ProcessNotFound,
    ResultUnavailable,
    SandboxkitError,
    WorkdirMissing,
)
from sandboxkit.lab_options import LabOptions
from sandboxkit.vocab import OnTimeout, SandboxState

__all__ = ["ManagedSandbox", "OnTimeout", "SandboxState", "check_timeout"]


SHELL_STANDBY = ("/bin/sh", "-c", SCRIPT, "sh")
"""A shell standby's argv (:mod:`~sandboxkit.daemon.standby`)."""


def check_timeout(timeout: float | None, on_timeout: str) -> None:
    """InvalidArgument for a timeout a sandbox cannot have."""
    if timeout is not None and timeout <= 0:
        raise InvalidArgument("timeout must be positive", field="timeout")
    if on_timeout not in ("pause", "kill"):
        raise InvalidArgument("on_timeout must be 'pause' or 'kill'", field="on_timeout")


class ManagedSandbox:
    """Processes that share a directory, an environment and a lifecycle: the daemon's side
    of a sandbox (the client's are :class:`sandboxkit.AsyncSandbox` and
    :class:`sandboxkit.Sandbox`), as :class:`~sandboxkit.daemon.process.ManagedProcess` is
    of a process."""

    def __init__(
        self,
        sandbox_id: str,
        workdir: Path,
        tree: Freezer,
        config: DaemonConfig,
        journal: EventJournal,
        *,
        runtime_dir: Path,
        envs: dict[str, str] | None = None,
        timeout: float | None = None,
        on_timeout: OnTimeout = "pause",
        auto_resume: bool = False,
        metadata: dict[str, str] | None = None,
        lab: LabOptions | None = None,
        plan: NamespacePlan | None = None,
        tmpdir: Path | None = None,
        limits: LimitEnforcer | None = None,
        isolation_reason: str = "",
        quiet: Quiet | None = None,
    ) -> None:
        check_timeout(timeout, on_timeout)
        self.sandbox_id = sandbox_id
        self.workdir = workdir
        self.tree = tree
        self.config = config
        self.journal = journal
        self.envs = dict(envs or {})
        self.timeout = timeout
        self.on_timeout: OnTimeout = on_timeout
        self.auto_resume = auto_resume
        self.metadata = dict(metadata or {})
        self.lab = None if lab is None else FaultLab(sandbox_id, lab, config.lab, journal)
        """The fault lab's machinery, for a sandbox created with lab options (else None:
        ``cursor`` fan-out, no ghosts)."""
        self.state: SandboxState = "running"
        self.state_seq = 0
        """Counts lifecycle transitions: a view orders what it hears by it."""
        self.created_at = time.time()
        self.killed_at: float | None = None
        self.last_activity = time.monotonic()
        self.processes: dict[int, ManagedProcess] = {}
        self.evicted: deque[int] = deque(maxlen=10_000)
        # What housekeeping looks at, every tick, instead of each process kept: a
        # notebook's loop of commands leaves thousands for their result TTL, and looking
        # at each held the event loop (5,000: ~10 ms every 50 ms).
        self._read: dict[int, ManagedProcess] = {}
        """Its processes a stream was opened on, until none of theirs is open."""
        self._evict_at = -math.inf
        """No result expires before this (wall clock): :meth:`evict_expired`."""
        self.plan = plan
        """How its processes are isolated (``None``: they are not, ``isolation="none"``)."""
        self.isolation_reason = isolation_reason
        """Why ``isolation`` is ``none``, when it is."""
        self.limits = limits
        """Its resource limits and how each holds (``None``: none were asked for)."""
        self.runtime_dir = runtime_dir
        """The daemon's files for this sandbox: its processes' output logs, in the host's
        own directory, out of the sandboxes' root (which a sandbox names as ``..``).
        Removed by :meth:`release`."""
        self.tmpdir = tmpdir or workdir.with_name(workdir.name + ".tmp")
        """The sandbox's private temporary directory, what its processes and the files
        APIs see as ``/tmp`` (:mod:`~sandboxkit.daemon.sandbox_paths`): made with the
        sandbox (mode 0700) by the host, removed with the working directory."""
        self._logs = 0
        self._lock = asyncio.Lock()
        self.standby: StandbySlot | LauncherSlot | None = None
        """Its launcher (:mod:`~sandboxkit.daemon.launcher`; where none was built, its
        next launch started ahead: :mod:`~sandboxkit.daemon.standby`), where a launch is
        more than one exec (a cgroup or limits to join, namespaces to make)."""
        if config.standby != "off" and (plan or limits or tree.launch_prefix()):
            slot = LauncherSlot if slot_kind(config.standby) == "launcher" else StandbySlot
            self.standby = slot(
                self._prepare_standby,
                tree,
                contained=plan is not None,
                check_fds=FdBudget.current(config.fd_reserve).check_spawn,
                quiet=quiet,
            )

    def adopt(
        self,
        journal: EventJournal,
        *,
        isolation_reason: str,
        envs: dict[str, str] | None,
        timeout: float | None,
        on_timeout: OnTimeout,
        auto_resume: bool,
        metadata: dict[str, str] | None,
    ) -> None:
        """Make a sandbox just made, or the spare made earlier
        (:mod:`~sandboxkit.daemon.spare`), the one a ``create()`` asked for: its
        settings, why it is not isolated (where it is not), its creation time, the
        host's journal (the spare's was its own). Nothing of these is held by its
        launcher or namespaces: a command's environment is sent with it. The caller
        checked the timeout (:func:`check_timeout`)."""
        self.journal = journal
        self.isolation_reason = isolation_reason
        self.envs = dict(envs or {})
        self.timeout = timeout
        self.on_timeout = on_timeout
        self.auto_resume = auto_resume
        self.metadata = dict(metadata or {})
        self.created_at = time.time()
        self.last_activity = time.monotonic()

    def warm(self) -> None:
        """Start its standby soon (once it is the host's: a command may take it)."""
        if self.standby is not None:
            self.standby.soon()

    def _prepare_standby(self, launch: str, fds: tuple[int, ...] = ()) -> Launch:
        """A standby's launch, or with ``fds`` (its program's, its socket's) a
        launcher's."""
        argv = (f"/proc/self/fd/{fds[0]}", str(fds[1])) if fds else SHELL_STANDBY
        spec = ProcessSpec(argv=argv)
        prepared = prepare(
            spec, launch, self.tree, str(self.workdir), self.envs, self.plan, self.limits
        )
        return prepared._replace(pass_fds=(*prepared.pass_fds, *fds))

    def touch(self) -> None:
        """Note a request that names this sandbox (restarts the idle timeout)."""
        self.last_activity = time.monotonic()

    def idle_expired(self, now: float) -> bool:
        """True if the idle timeout has run out while running. A stream someone reads is
        activity too: a sandbox being watched is not forgotten (ghosts do not count)."""
        if self.state != "running" or self.timeout is None:
            return False
        if self._being_read():
            self.last_activity = now
            return False
        return now - self.last_activity >= self.timeout

    def reading(self, process: ManagedProcess) -> None:
        """A stream was opened on ``process``: activity while it is open."""
        self._read[process.pid] = process

    def _being_read(self) -> bool:
        """Whether a stream is open on any of its processes, looking only at those one
        was opened on (forgotten once none of theirs is open)."""
        lab = self.lab
        read = False
        for pid, process in list(self._read.items()):
            open_ = [c for c in process.consumers.values() if c.closed_at is None]
            if not open_:
                del self._read[pid]
            elif any(not (lab and lab.is_ghost(c)) for c in open_):
                read = True
        return read

    def set_timeout(self, timeout: float | None) -> None:
        """Change the idle timeout (``None``: never) and restart its clock."""
        if timeout is not None and timeout <= 0:
            raise InvalidArgument("timeout must be positive", field="timeout")
        self.timeout = timeout
        self.touch()

    # -- processes -------------------------------------------------------------------

    async def start_process(self, spec: ProcessSpec) -> ManagedProcess:
        """Start a process; it runs until it exits, is killed or hits its own deadline."""
        self.check_workdir()
        self._logs += 1
        process = ManagedProcess(
            self.sandbox_id,
            spec,
            self.config,
            self.journal,
            self._state,
            self._fanout,
            state_seq=self._state_seq,
            log_dir=self.runtime_dir / f"log-{self._logs}" if self.config.output_on_disk else None,
        )
        # Its log's files may be sent unchecked only while no sandboxed process can reach
        # them (sandboxkit/daemon/file_span.py), or where the operator says so.
        if self.plan is None:
            unisolated_ran()
        process.log.zero_copy = zero_copy_check(self.config.zero_copy, self.plan is not None)
        # Its slowest consumer at the cache's edge reads from memory (.lag_reserve).
        process.log.lag = LagLoan(LAG_RESERVE, process.consumers, process.log.zero_copy)
        await process.start(
            self.tree, str(self.workdir), self.envs, self.plan, self.limits, self.standby
        )
        self.processes[process.pid] = process
        self.journal.record(
            "process.started",
            sandbox_id=self.sandbox_id,
            pid=process.pid,
            reason="user",
            cmd=spec.cmd,
            argv=list(spec.argv) if spec.argv else None,
        )
        return process

    def check_workdir(self) -> None:
        """WorkdirMissing naming the working directory if it was removed from outside the
        daemon (journalled as ``sandbox.workdir_missing``)."""
        if self.workdir.is_dir():
            return
        self.journal.record(
            "sandbox.workdir_missing",
            sandbox_id=self.sandbox_id,
            reason="removed",
            workdir=str(self.workdir),
        )
        raise WorkdirMissing(
            f"the working directory {self.workdir} of sandbox {self.sandbox_id} was removed "
            "from outside the daemon; create a new sandbox",
            path=str(self.workdir),
            sandbox_id=self.sandbox_id,
        )

    def _fanout(self, log: OutputLog) -> Fanout:
        if self.lab is not None:
            return self.lab.fanout(log, self.config.stall_timeout)
        return CursorFanout(log, self.config.stall_timeout)

    @property
    def fanout(self) -> str:
        """The fan-out policy of this sandbox's processes (``cursor`` unless the lab's)."""
        return "cursor" if self.lab is None else self.lab.options.fanout

    def process(self, pid: int) -> ManagedProcess:
        """A known process (running or exited within the TTL), or ProcessNotFound."""
        try:
            return self.processes[pid]
        except KeyError:
            raise ProcessNotFound(
                f"no process {pid} in sandbox {self.sandbox_id}",
                sandbox_id=self.sandbox_id,
                pid=pid,
            ) from None

    def retained_process(self, pid: int) -> ManagedProcess:
        """A process whose output can still be read (running, or exited within the result
        TTL), or ResultUnavailable (410) saying whether it was evicted or never known."""
        process = self.processes.get(pid)
        if process is not None:
            return process
        reason = "evicted" if pid in self.evicted else "unknown"
        raise ResultUnavailable(
            f"process {pid} is {reason} in sandbox {self.sandbox_id}",
            sandbox_id=self.sandbox_id,
            pid=pid,
            reason=reason,
        )

    async def restart(self, pid: int) -> ManagedProcess:
        """Kill ``pid`` (if running) and start the same spec again, linking old → new."""
        old = self.process(pid)
        await old.kill(reason="restart")
        new = await self.start_process(old.spec)
        old.restarted_to = new.pid
        new.restarted_from = old.pid
        self.journal.record(
            "process.restarted",
            sandbox_id=self.sandbox_id,
            pid=new.pid,
            reason="user",
            old_pid=old.pid,
            new_pid=new.pid,
        )
        return new

    def evict_expired(self, now: float) -> None:
        """Forget exited processes whose result TTL has passed (``now``: wall clock).
        Looks at them only once one can have expired: at the earliest that those exited
        now expire, and a process that exits later expires after ``now`` + TTL."""
        if now < self._evict_at:
            return
        ttl = self.config.result_ttl
        next_at = now + ttl
        for pid, process in list(self.processes.items()):
            ended_at = process.log.ended_at
            if ended_at is None:
                continue
            if now - ended_at < ttl:
                next_at = min(next_at, ended_at + ttl)
            elif any(c.closed_at is None for c in process.consumers.values()):
                next_at = now  # read still: its reader may finish; looked at next tick
            else:
                del self.processes[pid]
                self._read.pop(pid, None)
                process.log.close()  # its segment files and cache
                self.evicted.append(pid)
                self.journal.record("process.evicted", sandbox_id=self.sandbox_id, pid=pid)
        self._evict_at = next_at

    # -- lifecycle -------------------------------------------------------------------

    async def pause(self, reason: str = "user") -> None:
        """Freeze every process of the sandbox (the whole tree)."""
        async with self._lock:
            if self.state != "running":
                return
            await self.tree.freeze()
            if self.lab is not None:
                self.lab.snapshot()
            self.state = "paused"
            self.state_seq += 1
            self.journal.record("sandbox.paused", sandbox_id=self.sandbox_id, reason=reason)
            self._announce()

    async def resume(self, reason: str = "user") -> None:
        """Thaw every process of the sandbox."""
        async with self._lock:
            if self.state != "paused":
                return
            await self.tree.thaw()
            if self.lab is not None:
                await self.lab.restore()
            self.state = "running"
            self.state_seq += 1
            self.touch()
            self.journal.record("sandbox.resumed", sandbox_id=self.sandbox_id, reason=reason)
            self._announce()

    def _announce(self) -> None:
        """Every stream attached to the sandbox hears of its new state now, not at its next
        keepalive (views follow events, within a second whoever acted)."""
        for process in self.processes.values():
            process.fanout.nudge()

    async def kill(self, reason: str = "user") -> None:
        """Kill every process (SIGTERM, then SIGKILL), release the tree and the workdir."""
        async with self._lock:
            if self.state == "killed":
                return
            if self.standby is not None:
                self.standby.closing()
            if self.state == "paused":
                await self.tree.thaw()
            running = [p for p in self.processes.values() if p.running]
            await asyncio.gather(*(p.kill(reason=f"sandbox_{reason}") for p in running))
            # Whatever escaped the per-process kill (double-forked daemons) goes now,
            # and the standby.
            self.tree.signal(signal.SIGKILL)
            if self.standby is not None:
                await self.standby.close()
            await asyncio.gather(*(p.close() for p in self.processes.values()))
            for process in self.processes.values():
                # Results stay readable (from disk) until released; memory goes now.
                process.log.drop_cache()
            self.tree.close()
            if self.limits is not None:
                await off_loop(self.limits.close)
            for directory in (self.workdir, self.tmpdir):
                # Off the loop: the process may have left a large or very deep tree.
                with contextlib.suppress(OSError, SandboxkitError):
                    await off_loop(remove_directory, directory)
            self.state = "killed"
            self.state_seq += 1
            self.killed_at = time.time()
            self.journal.record("sandbox.killed", sandbox_id=self.sandbox_id, reason=reason)

    async def release(self) -> None:
        """Delete what the daemon keeps for a sandbox it forgets: its processes' output
        logs (their files and memory) and its runtime directory (off the event loop)."""
        for process in self.processes.values():
            process.log.close()
        await remove_tree(self.runtime_dir)

    def _state(self) -> str:
        return self.state

    def _state_seq(self) -> int:
        return self.state_seq

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description."""
        return {
            "sandbox_id": self.sandbox_id,
            "state": self.state,
            "workdir": str(self.workdir),
            "envs": self.envs,
            "timeout": self.timeout,
            "on_timeout": self.on_timeout,
            "auto_resume": self.auto_resume,
            "metadata": self.metadata,
            "fanout": self.fanout,
            "lab": None if self.lab is None else self.lab.to_json(),
            "created_at": self.created_at,
            "killed_at": self.killed_at,
            "freezer": self.tree.backend,
            "isolation": "none" if self.plan is None else "namespaces",
            "isolation_reason": self.isolation_reason,
            "allow_internet_access": True if self.plan is None else self.plan.internet,
            "limits": {} if self.limits is None else self.limits.limits.given(),
            "limits_enforced": {} if self.limits is None else self.limits.enforced(),
            "processes": sum(1 for p in self.processes.values() if p.running),
            "state_seq": self.state_seq,
        }
