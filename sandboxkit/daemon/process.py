"""A process running in a sandbox: spawn, output capture into its log, stdin, kill."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.consumers import Consumer
from sandboxkit.daemon.events import EventJournal
from sandboxkit.daemon.fanout import Fanout, make_fanout
from sandboxkit.daemon.output_log import OutputLog
from sandboxkit.daemon.stdin import StdinLedger
from sandboxkit.daemon.tree import ProcessTree
from sandboxkit.errors import InvalidArgument

__all__ = ["ManagedProcess", "ProcessSpec"]


@dataclass(frozen=True)
class ProcessSpec:
    """What to run: a shell command or an argv, where, with what environment."""

    cmd: str | None = None
    argv: tuple[str, ...] | None = None
    cwd: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    pty: bool = False
    timeout: float | None = None
    """Kill after this many seconds; ``None`` (the default) means no deadline."""
    tag: str | None = None

    def __post_init__(self) -> None:
        if (self.cmd is None) == (self.argv is None):
            raise InvalidArgument("give exactly one of cmd and argv", field="cmd")
        if self.argv is not None and not self.argv:
            raise InvalidArgument("argv must not be empty", field="argv")
        if self.timeout is not None and self.timeout <= 0:
            raise InvalidArgument("timeout must be positive", field="timeout")

    def command_line(self) -> list[str]:
        """The argv to execute."""
        if self.argv is not None:
            return list(self.argv)
        assert self.cmd is not None
        return ["/bin/sh", "-c", self.cmd]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = asdict(self)
        data["argv"] = list(self.argv) if self.argv is not None else None
        return data


class _Capture(asyncio.SubprocessProtocol):
    """Appends pipe output to the log as it arrives: the producer never waits."""

    def __init__(self, process: ManagedProcess) -> None:
        self._process = process
        self.exited = asyncio.get_running_loop().create_future()
        self.pipes_closed = asyncio.get_running_loop().create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._process.capture("stdout" if fd == 1 else "stderr", data)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.pipes_closed.done():
            self.pipes_closed.set_result(None)


class _PtyReader(asyncio.Protocol):
    def __init__(self, process: ManagedProcess) -> None:
        self._process = process
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._process.capture("pty", data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


_PIPE_SIZE = 1024 * 1024


def _widen_pipes(transport: asyncio.SubprocessTransport) -> None:
    """Ask for 1 MiB pipe buffers: a chatty process then blocks, and the daemon wakes,
    a sixteenth as often as with the default 64 KiB (best effort: capped by the system)."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:
        return
    for fd in (1, 2):
        pipe = transport.get_pipe_transport(fd)
        handle = pipe.get_extra_info("pipe") if pipe is not None else None
        if handle is not None:
            # The pipe may already be closed by a process that exited at once.
            with contextlib.suppress(OSError, ValueError):
                fcntl.fcntl(handle.fileno(), set_size, _PIPE_SIZE)


def _default_fanout(config: DaemonConfig) -> Callable[[OutputLog], Fanout]:
    return lambda log: make_fanout(config.fanout, log, config, grace=config.kick_grace)


class ManagedProcess:
    """One process of a sandbox and everything the daemon keeps about it."""

    def __init__(
        self,
        sandbox_id: str,
        spec: ProcessSpec,
        config: DaemonConfig,
        journal: EventJournal,
        sandbox_state: Callable[[], str],
        fanout: Callable[[OutputLog], Fanout] | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.spec = spec
        self.config = config
        self.journal = journal
        self.log = OutputLog(config.retention_bytes)
        self.fanout: Fanout = (fanout or _default_fanout(config))(self.log)
        self.pid = -1
        self.started_at = time.time()
        self.restarted_from: int | None = None
        self.restarted_to: int | None = None
        self.kill_reason: str | None = None
        self.consumers: dict[str, Consumer] = {}
        self._sandbox_state = sandbox_state
        self._transport: asyncio.SubprocessTransport | None = None
        self._pty_master: int | None = None
        self._stdin = StdinLedger(-1)
        self._stdin_closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._done = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, tree: ProcessTree, workdir: str, base_env: dict[str, str]) -> None:
        """Spawn the process inside ``tree`` and start capturing its output."""
        loop = asyncio.get_running_loop()
        cwd = self._cwd(workdir)
        env = {**os.environ, **base_env, **self.spec.envs}
        argv = tree.launch_prefix() + self.spec.command_line()
        capture = _Capture(self)
        pty_reader: _PtyReader | None = None
        try:
            if self.spec.pty:
                master, slave = pty.openpty()
                try:
                    transport, _ = await loop.subprocess_exec(
                        lambda: capture,
                        *argv,
                        stdin=slave,
                        stdout=slave,
                        stderr=slave,
                        cwd=cwd,
                        env=env,
                        start_new_session=True,
                    )
                finally:
                    os.close(slave)
                self._pty_master = master
                pty_reader = _PtyReader(self)
                await loop.connect_read_pipe(
                    lambda: pty_reader,
                    os.fdopen(os.dup(master), "rb", buffering=0),
                )
            else:
                transport, _ = await loop.subprocess_exec(
                    lambda: capture,
                    *argv,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )
        except FileNotFoundError as exc:
            raise InvalidArgument(f"cannot execute: {exc}", field="cmd") from None
        except PermissionError as exc:
            raise InvalidArgument(f"cannot execute: {exc}", field="cmd") from None
        self._transport = transport
        _widen_pipes(transport)
        self.pid = transport.get_pid()
        self._stdin.pid = self.pid
        tree.add(self.pid)
        self.started_at = time.time()
        self._own(self._watch_exit(capture, pty_reader))
        if self.spec.timeout is not None:
            self._own(self._deadline(self.spec.timeout))

    def _cwd(self, workdir: str) -> str:
        cwd = self.spec.cwd or workdir
        if not os.path.isabs(cwd):
            cwd = os.path.join(workdir, cwd)
        if not os.path.isdir(cwd):
            raise InvalidArgument(f"cwd does not exist: {self.spec.cwd}", field="cwd")
        return cwd

    def capture(self, stream: str, data: bytes) -> None:
        """Record output from one of the process's streams."""
        step = self.config.read_chunk
        for start in range(0, len(data), step):
            self.log.append(stream, data[start : start + step])

    async def _watch_exit(self, capture: _Capture, pty_reader: _PtyReader | None) -> None:
        await capture.exited
        # A grandchild may keep the pipes open after the leader exits: drain, with a bound.
        closers: list[asyncio.Future[None]] = [capture.pipes_closed]
        if pty_reader is not None:
            closers.append(pty_reader.closed)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*closers), self.config.exit_drain)
        assert self._transport is not None
        code = self._transport.get_returncode()
        self._close_transports()
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
        if self._transport is not None:
            self._transport.close()
        if self._pty_master is not None:
            with contextlib.suppress(OSError):
                os.close(self._pty_master)
            self._pty_master = None

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
        """SIGTERM the process and its descendants, SIGKILL after ``grace``; wait for exit."""
        if not self.running:
            return self.log.exit_code
        self.kill_reason = self.kill_reason or reason
        grace = self.config.kill_grace if grace is None else grace
        self.signal_tree(signal.SIGTERM)
        self.signal_tree(signal.SIGCONT)
        if await self.wait(grace) is None and self.running:
            self.signal_tree(signal.SIGKILL)
            await self.wait(grace + self.config.exit_drain + 5)
        return self.log.exit_code

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to the process, its process group and all its descendants."""
        if self.pid <= 0:
            return
        targets: set[int] = {self.pid}
        with contextlib.suppress(psutil.Error):
            targets.update(c.pid for c in psutil.Process(self.pid).children(recursive=True))
        with contextlib.suppress(OSError):
            os.killpg(self.pid, sig)
        for pid in targets:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)

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

    def write_stdin(self, session: str, seq: int, data: bytes) -> dict[str, Any]:
        """Apply stdin batch ``seq`` of ``session`` exactly once, in order (see
        :class:`StdinLedger`)."""
        if seq >= self._stdin.expected(session):
            if not self.running:
                raise InvalidArgument("the process has exited", field="pid")
            if self._stdin_closed:
                raise InvalidArgument("stdin is closed", field="stdin")
        return self._stdin.apply(session, seq, data, self._write)

    def _write(self, data: bytes) -> None:
        if self._pty_master is not None:
            view = memoryview(data)
            while view:
                written = os.write(self._pty_master, view)
                view = view[written:]
            return
        assert self._transport is not None
        pipe = self._transport.get_pipe_transport(0)
        if pipe is None or pipe.is_closing():
            raise InvalidArgument("stdin is closed", field="stdin")
        pipe.write(data)  # type: ignore[attr-defined]

    def close_stdin(self) -> None:
        """Close the process's stdin (EOF); for a PTY, send the EOF character."""
        if self._stdin_closed or not self.running:
            self._stdin_closed = True
            return
        self._stdin_closed = True
        if self._pty_master is not None:
            os.write(self._pty_master, b"\x04")
            return
        assert self._transport is not None
        pipe = self._transport.get_pipe_transport(0)
        if pipe is not None:
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
        return {"process_state": self.state, "sandbox_state": self._sandbox_state()}

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description."""
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
            "consumers": sum(1 for c in self.consumers.values() if c.closed_at is None),
        }
