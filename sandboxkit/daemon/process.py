"""A process running in a sandbox: spawn, output capture into its log, stdin, kill (its
pipes and pty, as the event loop sees them, are :mod:`sandboxkit.daemon.process_io`)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import pty
import secrets
import signal
import struct
import termios
import time
from collections.abc import Callable
from typing import Any

from sandboxkit._compat import within
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.consumers import Consumer
from sandboxkit.daemon.events import EventJournal
from sandboxkit.daemon.fanout import Fanout
from sandboxkit.daemon.fds import FdBudget, exhausted
from sandboxkit.daemon.freezer import Freezer
from sandboxkit.daemon.freezer.termination import FIRST_LOOK, LAST_LOOK, Termination
from sandboxkit.daemon.isolation import HOME, NamespacePlan, sandbox_account
from sandboxkit.daemon.launcher import LauncherGone
from sandboxkit.daemon.launcher_slot import LauncherSlot
from sandboxkit.daemon.limits import LimitEnforcer
from sandboxkit.daemon.off_loop import off_loop
from sandboxkit.daemon.output_log import OutputLog
from sandboxkit.daemon.process_io import PtyInput, PtyReader
from sandboxkit.daemon.process_spec import (
    ProcessSpec,
    check_exec_size,
    direct,
    host_cwd,
    prepare,
)
from sandboxkit.daemon.run_as import resolve_user
from sandboxkit.daemon.spawn import Child, loop_file, spawn
from sandboxkit.daemon.standby import Standby, StandbySlot, exec_line
from sandboxkit.daemon.stdin import StdinLedger
from sandboxkit.errors import InvalidArgument, ResourceExhausted, StdinBusy

__all__ = ["ManagedProcess", "ProcessSpec", "check_exec_size"]


_COALESCE_UNREAD = 4096
"""Small writes nobody has read yet join one chunk up to this size (see OutputLog)."""


class ManagedProcess:
    """One process of a sandbox and everything the daemon keeps about it."""

    def __init__(
        self,
        sandbox_id: str,
        spec: ProcessSpec,
        config: DaemonConfig,
        journal: EventJournal,
        sandbox_state: Callable[[], str],
        fanout: Callable[[OutputLog], Fanout],
        log_dir: str | os.PathLike[str] | None = None,
        *,
        state_seq: Callable[[], int] | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.spec = spec
        self.config = config
        self.journal = journal
        # On disk under ``log_dir`` (the sandbox's runtime directory), else in memory.
        self.log = OutputLog(
            config.retention_bytes,
            charge_overhead=True,
            coalesce=_COALESCE_UNREAD,
            directory=log_dir,
            cache_bytes=config.output_cache_bytes,
            on_degraded=self._log_degraded,
        )
        self.fanout: Fanout = fanout(self.log)
        self.pid = -1
        self.started_at = time.time()
        self.restarted_from: int | None = None
        self.restarted_to: int | None = None
        self.kill_reason: str | None = None
        self.consumers: dict[str, Consumer] = {}
        self._sandbox_state = sandbox_state
        self._state_seq = state_seq
        self._child: Child | None = None
        self._pty_master: int | None = None
        self._stdin = StdinLedger(
            -1,
            ttl=config.stdin_session_ttl,
            max_sessions=config.stdin_sessions,
            idle_grace=config.stdin_session_grace,
        )
        self._stdin_closed = False
        self._stdin_pipe: asyncio.WriteTransport | None = None
        self._stdin_lock = asyncio.Lock()
        self.stdin_drained = asyncio.Event()
        """Set while nothing waits in the daemon's stdin buffer for this process."""
        self.stdin_drained.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._done = asyncio.Event()
        self.launch = secrets.token_hex(6)
        """Names this process and all it starts to the freezer (see ``Freezer``)."""
        self._freezer: Freezer | None = None
        self.isolated = False
        """Whether it runs in namespaces (set by :meth:`start`)."""
        self._limits: LimitEnforcer | None = None

    # -- lifecycle -------------------------------------------------------------------

    async def start(
        self,
        freezer: Freezer,
        workdir: str,
        base_env: dict[str, str],
        plan: NamespacePlan | None = None,
        limits: LimitEnforcer | None = None,
        standby: StandbySlot | LauncherSlot | None = None,
    ) -> None:
        """Spawn the process in the sandbox's ``freezer`` (and namespaces, with a ``plan``)
        and start capturing its output: through the sandbox's launcher
        (:mod:`~sandboxkit.daemon.launcher`) or by taking its ``standby``
        (:mod:`~sandboxkit.daemon.standby`) where the command fits, else anew."""
        self.isolated = plan is not None
        self._limits = limits
        if isinstance(standby, LauncherSlot):
            if await self._start_via(standby, freezer, workdir, base_env, plan):
                self._running(freezer)
                return
        elif standby is not None and await self._start_on(standby, workdir, plan):
            self._running(freezer)
            return
        launch = prepare(self.spec, self.launch, freezer, workdir, base_env, plan, limits)
        with contextlib.closing(launch), freezer.launching(self.launch):
            child, pty_reader = await self._spawn(
                launch.argv, launch.cwd, launch.env, launch.pass_fds
            )
            self._child = child
            if self._stdin_pipe is not None and not self._stdin_pipe.is_closing():
                # Paused while anything is buffered, resumed once it all went to the child.
                self._stdin_pipe.set_write_buffer_limits(high=0, low=0)
            self.pid = child.pid
            self._stdin.pid = self.pid
            # Off the event loop: the first pid written into a new cgroup takes 9-13 ms
            # (the kernel's cgroup migration), during which every stream of the daemon
            # would wait. Also where the wrapper joins by itself: left to the wrapper
            # alone, a namespaced sandbox's first command took about 4 ms longer
            # (benchmarks/isolation.py).
            await off_loop(freezer.add, self.pid, self.launch, contained=self.isolated)
            if self.isolated:
                self._own(freezer.settle_soon(self.launch, lambda: self.running))
        self._running(freezer, pty_reader)

    async def _start_via(
        self,
        slot: LauncherSlot,
        freezer: Freezer,
        workdir: str,
        base_env: dict[str, str],
        plan: NamespacePlan | None,
    ) -> bool:
        """Start through the sandbox's launcher (started now if need be) if the command
        fits and the sandbox is not paused (its launcher is frozen with it); False to start
        it anew. InvalidArgument (a bad cwd or user, a command over the kernel's limits)
        as anew."""
        launch = direct(self.spec, self.launch, freezer, workdir, base_env, plan)
        launcher = None if launch is None or freezer.frozen else await slot.ready()
        if launch is None or launcher is None or freezer.frozen:
            slot.touch()
            return False
        budget = FdBudget.current(self.config.fd_reserve)
        budget.check_spawn()
        with freezer.launching(self.launch):
            try:
                child = await launcher.spawn(
                    launch.argv, launch.env, launch.cwd, self, lambda: freezer.frozen
                )
            except LauncherGone:
                return False
            except ResourceExhausted:
                # It may have forked the command before it went silent: nothing of the
                # refused request may run (a process carrying its launch's mark).
                freezer.signal_launch(self.launch, signal.SIGKILL)
                raise
            except OSError as exc:
                raise _spawn_error(exc, budget) from None
            self._child = child
            self._stdin_pipe = child.stdin
            if self._stdin_pipe is not None:
                self._stdin_pipe.set_write_buffer_limits(high=0, low=0)
            self.pid = child.pid
            self._stdin.pid = self.pid
            # Born in the cgroup already: registering it moves nothing (no thread needed).
            freezer.add(self.pid, self.launch, contained=self.isolated, born=child.born)
        return True

    async def _start_on(
        self, standby: StandbySlot, workdir: str, plan: NamespacePlan | None
    ) -> bool:
        """Start by taking the sandbox's standby, if the command fits one and one is
        ready; False to start it anew. InvalidArgument (a bad cwd or user, a command over
        the kernel's limits) before anything is taken."""
        line = self._standby_line(workdir, plan)
        if line is None:
            standby.soon()  # a launch all the same: the next standby waits for quiet
            return False
        check_exec_size(
            self.spec.command_line(),
            {**standby.env, **self.spec.envs},
            argv_field="argv" if self.spec.argv is not None else "cmd",
        )
        taken = standby.take()
        if taken is None:
            return False
        await self._take(taken, line)
        return True

    def _standby_line(self, workdir: str, plan: NamespacePlan | None) -> bytes | None:
        """The line that makes a standby this process, where it fits one (see
        :mod:`~sandboxkit.daemon.standby`); validates the user and cwd as a launch does."""
        spec = self.spec
        if plan is not None:
            default_user = sandbox_account(spec.user) == "user"
            cwd, home = plan.inside_path(spec.cwd)[0], HOME
        else:
            default_user = resolve_user(spec.user) is None
            cwd, home = host_cwd(spec.cwd, workdir), workdir
        if spec.pty or not default_user:
            return None
        return exec_line(spec.command_line(), spec.envs, None if cwd == home else cwd)

    async def _take(self, standby: Standby, line: bytes) -> None:
        """Become ``standby``: its pipes are this process's, and ``line`` goes down its
        stdin, ahead of anything else, for its shell to exec the command."""
        self.launch = standby.launch  # the freezer's name for it, its mark's too
        child = standby.child
        await child.join(self)
        self._child = child
        self._stdin_pipe = child.stdin
        if self._stdin_pipe is not None:
            self._stdin_pipe.write(line)  # into an empty pipe: taken at once
            self._stdin_pipe.set_write_buffer_limits(high=0, low=0)
        self.pid = child.pid
        self._stdin.pid = self.pid
        # Once the freezer holds it (as a launch's start waits for that too), while the
        # command already runs.
        await standby.registered

    def _running(self, freezer: Freezer, pty_reader: PtyReader | None = None) -> None:
        """Once spawned: its exit watched, its deadline set."""
        assert self._child is not None
        self._freezer = freezer
        self.started_at = time.time()
        if self.log.disk_error is not None:  # its directory could not even be made
            self._log_degraded("disk_error", self.log.disk_error)
        self._own(self._watch_exit(self._child, pty_reader))
        if self.spec.timeout is not None:
            self._own(self._deadline(self.spec.timeout))

    async def _spawn(
        self, argv: list[str], cwd: str, env: dict[str, str], pass_fds: tuple[int, ...]
    ) -> tuple[Child, PtyReader | None]:
        """Spawn ``argv`` on pipes or a pty; a request's fault is InvalidArgument, and
        running out of descriptors a typed 503."""
        loop = asyncio.get_running_loop()
        budget = FdBudget.current(self.config.fd_reserve)
        budget.check_spawn()  # out of descriptors: a typed 503, not a "bad command"
        pty_reader: PtyReader | None = None
        try:
            if self.spec.pty:
                master, slave = pty.openpty()
                try:
                    child = await spawn(
                        argv, cwd=cwd, env=env, owner=self, terminal=slave, pass_fds=pass_fds
                    )
                except BaseException:
                    os.close(master)
                    raise
                finally:
                    os.close(slave)
                self._pty_master = master
                pty_reader = PtyReader(self)
                await loop.connect_read_pipe(
                    lambda: pty_reader,
                    loop_file(os.dup(master), "rb"),
                )
                # Input buffered without blocking the loop, bounded like a pipe's.
                self._stdin_pipe = PtyInput(self, master)
            else:
                child = await spawn(argv, cwd=cwd, env=env, owner=self, pass_fds=pass_fds)
                self._stdin_pipe = child.stdin
        except OSError as exc:
            raise _spawn_error(exc, budget) from None
        return child, pty_reader

    def capture(self, stream: str, data: bytes) -> None:
        """Record output from one of the process's streams."""
        step = self.config.read_chunk
        for start in range(0, len(data), step):
            self.log.append(stream, data[start : start + step])

    async def _watch_exit(self, child: Child, pty_reader: PtyReader | None) -> None:
        await child.exited
        # A grandchild may keep the pipes open after the leader exits: drain, with a bound.
        closers: list[asyncio.Future[None]] = [child.pipes_closed]
        if pty_reader is not None:
            closers.append(pty_reader.closed)
        if not all(closer.done() for closer in closers):  # (most often they are)
            with contextlib.suppress(asyncio.TimeoutError):
                await within(asyncio.gather(*closers), self.config.exit_drain)
        code = child.returncode
        if self.isolated and code is not None and 128 < code <= 128 + 64:
            # bwrap reports a command that a signal ended as 128 + the signal, as a shell
            # does; the daemon's convention (and without isolation) is minus the signal.
            # Alike for one the launcher started, whichever way an isolated command went.
            code = 128 - code
        if self._limits is not None and self._limits.new_oom_kill():
            # The kernel's OOM killer ended a process of the sandbox as this one exited.
            self.kill_reason = self.kill_reason or "oom"
        self._close_transports()
        # Kept for result_ttl, a result holds nothing of what ran it: every object kept is
        # walked by each full collection, a pause of the daemon (benchmarks/gc_pause.py).
        self._child = self._stdin_pipe = None
        self.log.finish(code if code is not None else -1)
        self.journal.record(
            "process.exited",
            sandbox_id=self.sandbox_id,
            pid=self.pid,
            reason=self.kill_reason or "exit",
            exit_code=self.log.exit_code,
        )
        self._done.set()

    async def _deadline(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.kill(reason="timeout")

    def _close_transports(self) -> None:
        if self._stdin_pipe is not None and self._pty_master is not None:
            self._stdin_pipe.abort()
        self.stdin_drained.set()
        if self._child is not None:
            self._child.close()
        if self._pty_master is not None:
            with contextlib.suppress(OSError):
                os.close(self._pty_master)
            self._pty_master = None

    def resize_pty(self, cols: int, rows: int) -> None:
        """Set the terminal size of a pty process (its foreground group gets SIGWINCH)."""
        if self._pty_master is None:
            raise InvalidArgument(f"process {self.pid} has no pty to resize", field="pty")
        if not (0 < cols < 65536 and 0 < rows < 65536):
            raise InvalidArgument("a pty size needs 1-65535 columns and rows", field="pty")
        size = struct.pack("HHHH", rows, cols, 0, 0)
        fcntl.ioctl(self._pty_master, termios.TIOCSWINSZ, size)

    @property
    def running(self) -> bool:
        """True until the exit is recorded."""
        return not self.log.ended

    async def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the recorded exit; returns the exit code (``None`` on timeout)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._done.wait(), timeout)
        return self.log.exit_code

    async def kill(self, reason: str = "user", grace: float | None = None) -> int | None:
        """SIGTERM the process and everything it started, SIGKILL what is left after
        ``grace``; wait for the exit. What an already exited process started (a daemon it
        left behind) is killed too, so a restart never runs beside its predecessor."""
        if self.running:
            self.kill_reason = self.kill_reason or reason
            grace = self.config.kill_grace if grace is None else grace
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            # Each process of the tree gets one SIGTERM, those born later too (see
            # daemon/freezer/termination.py): the tree is looked at again meanwhile.
            term = Termination(self._freezer, self.launch, contained=self.isolated)
            term.send()
            look = FIRST_LOOK
            while self.running and (left := deadline - loop.time()) > 0:
                await self.wait(min(left, look))
                term.send()
                look = min(look * 2, LAST_LOOK)
            if self.running:
                self.signal_tree(signal.SIGKILL)
                await self.wait(grace + self.config.exit_drain + 5)
            # The leader is gone; what it started may still be ending (or ignore SIGTERM,
            # or have escaped the leader, or be born only now): the rest of the grace,
            # then SIGKILL.
            while loop.time() < deadline:
                pids = self.tree_pids()
                if not pids:
                    break
                if term.missed(pids):
                    term.send()
                await asyncio.sleep(0.01)  # sleep-ok: poll, bounded by the grace
        self.signal_tree(signal.SIGKILL)
        return self.log.exit_code

    def tree_pids(self) -> list[int]:
        """The live processes this one started (itself included), wherever they went:
        the freezer decides (see ``Freezer.launch_members``)."""
        if self._freezer is None:
            return []
        return sorted(self._freezer.launch_members(self.launch))

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to the process and everything it started, through the freezer:
        descendants, its session, and what escaped both (setsid'd, double-forked)."""
        if self._freezer is not None:
            self._freezer.signal_launch(self.launch, sig)

    async def close(self) -> None:
        """Cancel this process's own tasks (its exit watcher, its deadline, its fan-out)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.fanout.close()
        self._close_transports()

    def _own(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- stdin -----------------------------------------------------------------------

    async def write_stdin(self, session: str, seq: int, data: bytes) -> dict[str, Any]:
        """Apply stdin batch ``seq`` of ``session`` exactly once, in order (see
        :class:`StdinLedger`).

        Backpressure: at most ``stdin_buffer`` bytes wait in the daemon for a child that
        does not read. A batch that does not fit waits up to ``stdin_wait`` for the child
        to drain them, then is refused with the retryable StdinBusy — not written, not
        recorded, so the writer sends the same batch again later. Batches of one process
        are applied one at a time, so a resend arriving while the original waits is a
        duplicate, never a second write."""
        async with self._stdin_lock:
            if seq >= self._stdin.expected(session):
                self._check_stdin_open()
                if seq == self._stdin.expected(session) and data:
                    await self._stdin_room(len(data))
                    self._check_stdin_open()
            return self._stdin.apply(session, seq, data, self._write)

    def end_stdin_session(self, session: str) -> dict[str, Any]:
        """Forget ``session``: its writer holds every ack (see :meth:`StdinLedger.end`)."""
        return self._stdin.end(session)

    def _check_stdin_open(self) -> None:
        if not self.running:
            raise InvalidArgument("the process has exited", field="pid")
        if self._stdin_closed:
            raise InvalidArgument("stdin is closed", field="stdin")

    @property
    def stdin_buffered(self) -> int:
        """Bytes written to stdin that the process has not read yet (daemon side)."""
        pipe = self._stdin_pipe
        if pipe is None or pipe.is_closing():
            return 0
        return pipe.get_write_buffer_size()

    async def _stdin_room(self, size: int) -> None:
        limit = self.config.stdin_buffer
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.stdin_wait
        while True:
            buffered = self.stdin_buffered
            if buffered == 0 or buffered + size <= limit:
                return
            remaining = deadline - loop.time()
            if remaining <= 0 or not self.running:
                raise StdinBusy(
                    f"process {self.pid} is not reading its stdin: {buffered} bytes wait "
                    f"(limit {limit}); send this batch again later",
                    pid=self.pid,
                    buffered=buffered,
                    limit=limit,
                )
            drained = asyncio.ensure_future(self.stdin_drained.wait())
            exited = asyncio.ensure_future(self._done.wait())
            try:
                await asyncio.wait(
                    {drained, exited}, timeout=remaining, return_when="FIRST_COMPLETED"
                )
            finally:
                for waiter in (drained, exited):
                    waiter.cancel()
                await asyncio.gather(drained, exited, return_exceptions=True)

    def _write(self, data: bytes) -> None:
        pipe = self._stdin_pipe
        if pipe is None or pipe.is_closing():
            raise InvalidArgument("stdin is closed", field="stdin")
        if data:
            pipe.write(data)

    def close_stdin(self) -> None:
        """Close the process's stdin (EOF); for a PTY, send the EOF character."""
        if self._stdin_closed or not self.running:
            self._stdin_closed = True
            return
        self._stdin_closed = True
        pipe = self._stdin_pipe
        if pipe is None or pipe.is_closing():
            return
        if self._pty_master is not None:
            pipe.write(b"\x04")
            return
        pipe.close()

    # -- views -----------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``running``, ``paused`` (its sandbox is) or ``exited``."""
        if not self.running:
            return "exited"
        return "paused" if self._sandbox_state() == "paused" else "running"

    def states(self) -> dict[str, Any]:
        """Process and sandbox state, as keepalive frames carry them."""
        states: dict[str, Any] = {
            "process_state": self.state,
            "sandbox_state": self._sandbox_state(),
        }
        if self._state_seq is not None:  # the sandbox's transition count: orders views
            states["state_seq"] = self._state_seq()
        return states

    def _log_degraded(self, reason: str, error: OSError) -> None:
        # Output lost to the disk is visible: an event, and the log's fields in to_json.
        self.journal.record(
            "process.log_degraded",
            sandbox_id=self.sandbox_id,
            pid=self.pid,
            reason=reason,
            errno=errno.errorcode.get(error.errno or 0),
            error=str(error),
            storage=self.log.storage,
            retention_bytes=self.log.effective_retention,
            first_seq=self.log.first_seq,
            evicted_bytes=self.log.evicted_bytes,
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description."""
        log_error = self.log.disk_error
        return {
            "pid": self.pid,
            "sandbox_id": self.sandbox_id,
            "spec": self.spec.to_json(),
            "state": self.state,
            "exit_code": self.log.exit_code,
            "started_at": self.started_at,
            "ended_at": self.log.ended_at,
            "kill_reason": self.kill_reason,
            "restarted_from": self.restarted_from,
            "restarted_to": self.restarted_to,
            "head": self.log.head,
            "first_seq": self.log.first_seq,
            "total_bytes": self.log.total_bytes,
            "evicted_bytes": self.log.evicted_bytes,
            "log_storage": self.log.storage,
            "log_retention_bytes": self.log.effective_retention,
            "log_error": None if log_error is None else str(log_error),
            "consumers": sum(1 for c in self.consumers.values() if c.closed_at is None),
            "stdin_buffered": self.stdin_buffered,
            "stdin_limit": self.config.stdin_buffer,
            "stdin_sessions": len(self._stdin),
        }


def _spawn_error(exc: OSError, budget: FdBudget) -> Exception:
    """What a spawn's OSError is to the request: out of descriptors, processes or memory
    (a sandbox at its ``pids`` or ``memory`` limit, whose launcher cannot fork) a typed
    503; not found, not permitted, not an executable, too long (E2BIG) the request's
    fault, refused with nothing started."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return exhausted(budget.limit)
    if exc.errno in (errno.EAGAIN, errno.ENOMEM):
        resource = "processes" if exc.errno == errno.EAGAIN else "memory"
        return ResourceExhausted(
            f"cannot start a process: {exc.strerror} (out of {resource}: the sandbox's "
            "limits, or the machine's)",
            resource=resource,
        )
    field = "cwd" if isinstance(exc, NotADirectoryError) else "cmd"
    return InvalidArgument(f"cannot execute: {exc}", field=field)
