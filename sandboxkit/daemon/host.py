"""The host: every sandbox of one daemon, the event journal, and housekeeping."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.consumers import Consumer, FrameSink, SendBudget, check_role
from sandboxkit.daemon.events import EventJournal
from sandboxkit.daemon.freezer import (
    CgroupFreezer,
    Freezer,
    daemon_cgroup_for,
    make_freezer,
    release_daemon_cgroup,
)
from sandboxkit.daemon.isolation import (
    SANDBOX_HOST_UID,
    NamespacePlan,
    drop_prefix,
    hidden_defaults,
    host_mounts,
    probe,
    resolve_mode,
    write_accounts,
)
from sandboxkit.daemon.launch import shell_ulimit
from sandboxkit.daemon.launcher_slot import slot_kind
from sandboxkit.daemon.limits import LimitEnforcer, release_v1_daemon_dirs, v1_daemon_dirs
from sandboxkit.daemon.off_loop import off_loop
from sandboxkit.daemon.process import ManagedProcess
from sandboxkit.daemon.recovery import ROOT_PREFIX, RootLock, claim_root, recover
from sandboxkit.daemon.sandbox import ManagedSandbox, OnTimeout, check_timeout
from sandboxkit.daemon.segment_store import remove_tree
from sandboxkit.daemon.spare import Spare
from sandboxkit.daemon.standby import Quiet
from sandboxkit.daemon.userns import DaemonUserns
from sandboxkit.errors import InvalidArgument, SandboxNotFound, SandboxPaused, WorkdirMissing
from sandboxkit.lab_options import LabOptions
from sandboxkit.limits import Limits

__all__ = ["Host"]


def _why_none(asked: str, mode: str) -> str:
    if mode != "none" or asked == "none":
        return ""
    return probe().reason


_CLOSED_CONSUMERS_KEPT = 64


def _prune_closed(process: ManagedProcess) -> None:
    """Keep the newest :data:`_CLOSED_CONSUMERS_KEPT` consumers of ``process`` that left."""
    closed = [c for c in process.consumers.values() if c.closed_at is not None]
    for old in closed[:-_CLOSED_CONSUMERS_KEPT]:
        del process.consumers[old.consumer_id]


class Host:
    """Owns sandboxes and their background work; plain asyncio, no HTTP."""

    def __init__(self, config: DaemonConfig | None = None) -> None:
        self.config = config or DaemonConfig()
        self.journal = EventJournal(self.config.journal_size)
        self.send_budget = SendBudget(self.config.send_budget)
        """What its consumers' sends may hold at once, shared out among them."""
        self.sandboxes: dict[str, ManagedSandbox] = {}
        self.started_at = time.time()
        self._own_root = self.config.root_dir is None
        self.root = Path(self.config.root_dir or tempfile.mkdtemp(prefix=ROOT_PREFIX))
        self.root.mkdir(parents=True, exist_ok=True)
        self._root_lock: RootLock | None = None
        if self._own_root:
            self._root_lock = claim_root(
                self.root, daemon_cgroup_for(self.config.freezer), v1_daemon_dirs()
            )
        self.root_missing = False
        """True once the root was found removed from outside (see :meth:`check_root`)."""
        # The daemon's own files for its sandboxes (their output logs), in a directory of
        # its own (0700), not under the root: a sandbox's ``..`` is the root, and nothing
        # it names from there may reach a file the daemon reads back. Marked like a root,
        # so that a successor removes it if this daemon dies.
        self.runtime_root = Path(tempfile.mkdtemp(prefix=ROOT_PREFIX + "run-"))
        self._runtime_lock = claim_root(self.runtime_root, None)
        self._housekeeper: asyncio.Task[None] | None = None
        self.ticks = 0
        """Housekeeping passes done (idle timeouts, results forgotten, sandboxes let go)."""
        self._streams: set[asyncio.Task[None]] = set()
        self.userns = DaemonUserns()
        self.quiet = Quiet()
        """When the daemon last made a sandbox or started a launch: its sandboxes' next
        launches are started ahead only once it is quiet (see
        :mod:`~sandboxkit.daemon.standby`)."""
        """The user namespace a root daemon's isolated launches join."""
        self.spare = (
            Spare(self._make_spare, self.quiet)
            if self.config.spare == "on" and slot_kind(self.config.standby) == "launcher"
            else None
        )
        """The sandbox made ahead for the next create() that asks for the defaults."""
        self.closing = False

    async def __aenter__(self) -> Host:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """End what dead daemons left behind (see :mod:`~sandboxkit.daemon.recovery`),
        then start housekeeping (idle timeouts, result TTLs)."""
        if self._housekeeper is None:
            # Tried once, off the loop: a create then never waits for bwrap (or the
            # shell's ulimit, see daemon/launch.py) to answer.
            await off_loop(probe)
            await off_loop(shell_ulimit)
            if probe().available:  # what every namespaced launch mounts (isolation.py)
                hide = hidden_defaults(self.root, self.runtime_root)
                await off_loop(host_mounts, hide, bool(drop_prefix()))
            try:
                reports = await off_loop(recover)
            except Exception as exc:  # best effort: never keep the daemon from serving
                self.journal.record("host.error", reason="recovery", error=repr(exc))
                reports = []
            for report in reports:
                self.journal.record("host.recovered", reason="dead_daemon", **report)
            self._housekeeper = asyncio.get_running_loop().create_task(self._housekeeping())
            if self.spare is not None:
                self.spare.soon()

    async def close(self) -> None:
        """Stop streams (bounded), kill every sandbox, stop housekeeping."""
        if self.closing:
            return
        self.closing = True
        self.journal.close()  # long polls answer now: they would hold the stop
        self.quiet.close()
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        streams = list(self._streams)
        for task in streams:
            task.cancel()
        if streams:
            await asyncio.wait(streams, timeout=self.config.shutdown_drain)
        # The spare beside the sandboxes, never before them: whatever its end raises
        # (gathered, as theirs) leaves no sandbox alive.
        await asyncio.gather(
            *(s.kill(reason="shutdown") for s in self.sandboxes.values()),
            *([self.spare.close()] if self.spare is not None else []),
            return_exceptions=True,
        )
        for sandbox in self.sandboxes.values():
            await sandbox.release()
        await off_loop(release_daemon_cgroup)  # deferred v1 cgroups too
        await off_loop(release_v1_daemon_dirs)
        await self.userns.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        if self._root_lock is not None:
            self._root_lock.close()
        self._runtime_lock.close()
        await remove_tree(self.runtime_root)

    # -- sandboxes -------------------------------------------------------------------

    async def create_sandbox(
        self,
        *,
        envs: dict[str, str] | None = None,
        timeout: float | None = None,
        on_timeout: OnTimeout = "pause",
        auto_resume: bool = False,
        metadata: dict[str, str] | None = None,
        lab: LabOptions | None = None,
        isolation: str | None = None,
        allow_internet_access: bool = True,
        limits: Limits | None = None,
    ) -> ManagedSandbox:
        """Create a sandbox with its own working directory and process tree; ``lab``
        makes it a fault-lab sandbox (see :mod:`sandboxkit.daemon.faults`).

        ``isolation`` (``auto``, ``namespaces``, ``none``; ``None``: the daemon's
        default) decides whether its processes run in namespaces (see
        :mod:`~sandboxkit.daemon.isolation`); ``allow_internet_access=False`` gives them a
        network namespace with loopback only. A request for the defaults gets the spare
        sandbox where one is made (:mod:`~sandboxkit.daemon.spare`)."""
        self.check_root()
        # A fault-lab sandbox runs the lab's own workloads (sandboxkit's modules, by this
        # environment's interpreter) to reproduce stream failures: unisolated unless asked.
        asked = isolation or ("none" if lab is not None else self.config.isolation)
        # Typed refusals (IsolationUnavailable, a bad mode) before anything is made.
        mode = resolve_mode(asked)
        check_timeout(timeout, on_timeout)  # before the spare is taken: it stays if refused
        defaults = (
            asked == self.config.isolation
            and allow_internet_access
            and lab is None
            and (limits is None or not limits.given())
        )
        spare = self.spare if defaults else None
        sandbox = None if spare is None else spare.take(isolated=mode == "namespaces")
        if sandbox is None:
            sandbox = await self._make_sandbox(
                asked,
                mode,
                self.journal,
                lab=lab,
                allow_internet_access=allow_internet_access,
                limits=limits,
            )
        sandbox.adopt(
            self.journal,
            isolation_reason=_why_none(asked, mode),
            envs=envs,
            timeout=timeout,
            on_timeout=on_timeout,
            auto_resume=auto_resume,
            metadata=metadata,
        )
        self.sandboxes[sandbox.sandbox_id] = sandbox
        sandbox.warm()
        self.journal.record(
            "sandbox.created", sandbox_id=sandbox.sandbox_id, reason="user", timeout=timeout
        )
        return sandbox

    async def _make_spare(self) -> ManagedSandbox:
        """A sandbox with the daemon's defaults, not the host's until a create takes it
        (its own journal until then: nothing of it is heard)."""
        self.check_root()
        asked = self.config.isolation
        return await self._make_sandbox(asked, resolve_mode(asked), EventJournal(maxlen=16))

    async def _make_sandbox(
        self,
        asked: str,
        mode: str,
        journal: EventJournal,
        *,
        lab: LabOptions | None = None,
        allow_internet_access: bool = True,
        limits: Limits | None = None,
    ) -> ManagedSandbox:
        """A new sandbox, not yet the host's, its settings the defaults (until
        :meth:`ManagedSandbox.adopt`)."""
        sandbox_id = "sbx-" + secrets.token_hex(4)
        workdir = self.root / sandbox_id
        tmpdir = workdir.with_name(sandbox_id + ".tmp")
        workdir.mkdir()
        tree: Freezer | None = None
        enforcer: LimitEnforcer | None = None
        try:
            tmpdir.mkdir(mode=0o700)
            plan = None
            if mode == "namespaces":
                userns = await self.userns.get()
                plan = self._plan(sandbox_id, workdir, tmpdir, allow_internet_access, userns)
            tree = make_freezer(sandbox_id, self.config.freezer)
            if limits is not None and limits.given():
                cgroup = tree.path if isinstance(tree, CgroupFreezer) else None
                enforcer = LimitEnforcer(sandbox_id, limits, cgroup)
            return ManagedSandbox(
                sandbox_id,
                workdir,
                tree,
                self.config,
                journal,
                runtime_dir=self.runtime_root / sandbox_id,
                lab=lab,
                plan=plan,
                tmpdir=tmpdir,
                limits=enforcer,
                quiet=self.quiet,
            )
        except BaseException:
            # A refused sandbox (e.g. a bad timeout) must not leak its directory or cgroup.
            if tree is not None:
                tree.close()
            if enforcer is not None:
                enforcer.close()
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise

    def _plan(
        self,
        sandbox_id: str,
        workdir: Path,
        tmpdir: Path,
        internet: bool,
        userns: int | None,
    ) -> NamespacePlan:
        """The namespaces of a new isolated sandbox. A root daemon's sandboxed processes
        run as :data:`SANDBOX_HOST_UID`: their two directories become that account's, and
        the root only lets it through to them (0711: no listing)."""
        etc = self.root / ".etc"
        if not (etc / "group").exists():
            write_accounts(etc)
        if os.geteuid() == 0:
            os.chmod(self.root, 0o711)
            for directory in (workdir, tmpdir):
                os.chown(directory, SANDBOX_HOST_UID, SANDBOX_HOST_UID)
        bwrap = probe().bwrap
        assert bwrap is not None  # resolve_mode said namespaces
        return NamespacePlan(
            home=workdir,
            tmp=tmpdir,
            etc=etc,
            hide=hidden_defaults(self.root, self.runtime_root),
            internet=internet,
            hostname=sandbox_id,
            bwrap=bwrap,
            prefix=drop_prefix(),
            userns=userns,
        )

    def spare_state(self) -> str:
        """``ready``, ``pending`` or ``off``: the spare sandbox (:class:`Spare`)."""
        if self.spare is None:
            return "off"
        return "pending" if self.spare.sandbox is None else "ready"

    def isolation_support(self) -> dict[str, Any]:
        """Whether namespaces can be had here, what is missing if not, and the default."""
        found = probe()
        return {
            "available": found.available,
            "reason": found.reason,
            "default": self.config.isolation,
        }

    def check_root(self) -> None:
        """WorkdirMissing naming the root if it was removed from outside the daemon
        (journalled once as ``host.root_missing``): nothing can be created without it."""
        if self.root.is_dir():
            return
        if not self.root_missing:
            self.root_missing = True
            self.journal.record("host.root_missing", reason="removed", root=str(self.root))
        raise WorkdirMissing(
            f"the daemon's root directory {self.root} was removed from outside the daemon; "
            "restart the daemon (sandboxkit stop)",
            path=str(self.root),
        )

    def get(self, sandbox_id: str) -> ManagedSandbox:
        """The sandbox, or SandboxNotFound."""
        try:
            return self.sandboxes[sandbox_id]
        except KeyError:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id) from None

    async def access(self, sandbox_id: str, *, needs_running: bool = False) -> ManagedSandbox:
        """Look up a sandbox for a request that is activity (a command, stdin, a file
        write, an attached stream; not a read — those use :meth:`get`): restart its idle
        timer and, if it is paused, auto-resume it or (for requests that need it running)
        refuse with SandboxPaused."""
        sandbox = self.get(sandbox_id)
        sandbox.touch()
        if sandbox.state == "paused":
            if sandbox.auto_resume:
                await sandbox.resume(reason="auto")
            elif needs_running:
                raise SandboxPaused(f"sandbox {sandbox_id} is paused", sandbox_id=sandbox_id)
        elif sandbox.state == "killed" and needs_running:
            raise SandboxNotFound(f"sandbox {sandbox_id} was killed", sandbox_id=sandbox_id)
        return sandbox

    # -- streams ---------------------------------------------------------------------

    def open_consumer(
        self,
        process: ManagedProcess,
        cursor: int | None,
        *,
        name: str | None = None,
        peer: str | None = None,
        role: str | None = None,
    ) -> Consumer:
        """Register a consumer of ``process`` at ``cursor`` (``None``: oldest retained),
        labelled ``role`` (1-32 of ``[a-z0-9_-]``; default ``sdk``)."""
        role = check_role(role)
        if cursor is not None and (cursor < 0 or cursor > process.log.head):
            raise InvalidArgument(
                f"cursor {cursor} is outside 0..{process.log.head} (the head)",
                field="cursor",
            )
        consumer = Consumer(
            process,
            cursor,
            self.config,
            self.journal,
            name=name,
            peer=peer,
            role=role,
            budget=self.send_budget,
        )
        process.consumers[consumer.consumer_id] = consumer
        _prune_closed(process)
        if (sandbox := self.sandboxes.get(process.sandbox_id)) is not None:
            sandbox.reading(process)
        return consumer

    def start_stream(self, consumer: Consumer, sink: FrameSink) -> asyncio.Task[None]:
        """Run ``consumer`` into ``sink`` as a task the host owns (cancelled on close)."""
        sandbox = self.sandboxes.get(consumer.source.sandbox_id)
        if sandbox is not None and sandbox.lab is not None:
            sink = sandbox.lab.transport(consumer, sink)
        task = asyncio.get_running_loop().create_task(consumer.run(sink))
        self._streams.add(task)
        task.add_done_callback(self._streams.discard)
        if sandbox is not None:
            process = sandbox.processes.get(consumer.source.pid)
            if process is not None:
                # Consumers that all leave at once are pruned as they leave, not only
                # when the next one opens.
                task.add_done_callback(lambda _: _prune_closed(process))
        return task

    async def serve(self, consumer: Consumer, sink: FrameSink) -> None:
        """Run ``consumer`` into ``sink`` until it ends; cancelling this cancels it."""
        task = self.start_stream(consumer, sink)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise

    def consumer_metrics(self, sandbox_id: str | None = None) -> list[dict[str, Any]]:
        """Metrics of every consumer (attached, and recently closed or kicked): one row
        per consumer, see :meth:`Consumer.metrics` and
        :data:`~sandboxkit.daemon.consumers.CONSUMER_STATES`; ``ghost`` marks a fault-lab
        pause-snapshot ghost."""
        sandboxes = [self.get(sandbox_id)] if sandbox_id else list(self.sandboxes.values())
        return [
            {**c.metrics(), "ghost": s.lab is not None and s.lab.is_ghost(c)}
            for s in sandboxes
            for p in s.processes.values()
            for c in p.consumers.values()
        ]

    # -- housekeeping ----------------------------------------------------------------

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(self.config.housekeeping_interval)
            now = time.monotonic()
            wall = time.time()
            with contextlib.suppress(WorkdirMissing):  # journalled once by check_root
                self.check_root()
            for sandbox in list(self.sandboxes.values()):
                try:
                    await self._tend(sandbox, now, wall)
                except Exception as exc:  # keep serving whatever one sandbox does
                    self.journal.record(
                        "host.error", sandbox_id=sandbox.sandbox_id, error=repr(exc)
                    )
            self.ticks += 1

    async def _tend(self, sandbox: ManagedSandbox, now: float, wall: float) -> None:
        if sandbox.idle_expired(now):
            if sandbox.on_timeout == "kill":
                await sandbox.kill(reason="timeout")
            else:
                await sandbox.pause(reason="timeout")
        sandbox.evict_expired(wall)
        if (
            sandbox.state == "killed"
            and sandbox.killed_at is not None
            and wall - sandbox.killed_at >= self.config.result_ttl
        ):
            del self.sandboxes[sandbox.sandbox_id]
            await sandbox.release()
