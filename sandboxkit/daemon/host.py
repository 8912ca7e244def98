"""The host: every sandbox of one daemon, the event journal, and housekeeping."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.consumers import Consumer, FrameSink, SendBudget, check_role
from sandboxkit.daemon.events import EventJournal
from sandboxkit.daemon.freezer import Freezer, make_freezer
from sandboxkit.daemon.process import ManagedProcess
from sandboxkit.daemon.recovery import ROOT_PREFIX, claim_root, recover
from sandboxkit.daemon.sandbox import ManagedSandbox, OnTimeout
from sandboxkit.errors import InvalidArgument, SandboxNotFound, SandboxPaused
from sandboxkit.lab_options import LabOptions

__all__ = ["Host"]

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
        if self._own_root:
            claim_root(self.root)
        self._housekeeper: asyncio.Task[None] | None = None
        self._streams: set[asyncio.Task[None]] = set()
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
            try:
                reports = await asyncio.to_thread(recover)
            except Exception as exc:  # best effort: never keep the daemon from serving
                self.journal.record("host.error", reason="recovery", error=repr(exc))
                reports = []
            for report in reports:
                self.journal.record("host.recovered", reason="dead_daemon", **report)
            self._housekeeper = asyncio.get_running_loop().create_task(self._housekeeping())

    async def close(self) -> None:
        """Stop streams (bounded), kill every sandbox, stop housekeeping."""
        if self.closing:
            return
        self.closing = True
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        streams = list(self._streams)
        for task in streams:
            task.cancel()
        if streams:
            await asyncio.wait(streams, timeout=self.config.shutdown_drain)
        await asyncio.gather(
            *(s.kill(reason="shutdown") for s in self.sandboxes.values()),
            return_exceptions=True,
        )
        for sandbox in self.sandboxes.values():
            await sandbox.release()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

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
    ) -> ManagedSandbox:
        """Create a sandbox with its own working directory and process tree; ``lab``
        makes it a fault-lab sandbox (see :mod:`sandboxkit.daemon.faults`)."""
        sandbox_id = "sbx-" + secrets.token_hex(4)
        workdir = self.root / sandbox_id
        workdir.mkdir()
        tree: Freezer | None = None
        try:
            tree = make_freezer(sandbox_id, self.config.freezer)
            sandbox = ManagedSandbox(
                sandbox_id,
                workdir,
                tree,
                self.config,
                self.journal,
                envs=envs,
                timeout=timeout,
                on_timeout=on_timeout,
                auto_resume=auto_resume,
                metadata=metadata,
                lab=lab,
            )
        except BaseException:
            # A refused sandbox (e.g. a bad timeout) must not leak its directory or cgroup.
            if tree is not None:
                tree.close()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        self.sandboxes[sandbox_id] = sandbox
        self.journal.record(
            "sandbox.created", sandbox_id=sandbox_id, reason="user", timeout=timeout
        )
        return sandbox

    def get(self, sandbox_id: str) -> ManagedSandbox:
        """The sandbox, or SandboxNotFound."""
        try:
            return self.sandboxes[sandbox_id]
        except KeyError:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id) from None

    async def access(self, sandbox_id: str, *, needs_running: bool = False) -> ManagedSandbox:
        """Look up a sandbox for a request: restart its idle timer and, if it is paused,
        auto-resume it or (for requests that need it running) refuse with SandboxPaused."""
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
            for sandbox in list(self.sandboxes.values()):
                try:
                    await self._tend(sandbox, now, wall)
                except Exception as exc:  # keep serving whatever one sandbox does
                    self.journal.record(
                        "host.error", sandbox_id=sandbox.sandbox_id, error=repr(exc)
                    )

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
