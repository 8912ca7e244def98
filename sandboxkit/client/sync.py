"""The sync facade: ``Sandbox``, for scripts and notebooks.

Every call runs on one background event loop (:func:`shared_loop_thread`), never on the
caller's: inside a Jupyter kernel the caller's loop is already running, and patching
asyncio to nest loops silently stalls the cells queued behind.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Coroutine, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import httpx

from sandboxkit.client.backend import OutputReader, SandboxBackend
from sandboxkit.client.commands import AsyncCommandHandle, AsyncCommands
from sandboxkit.client.files import Files
from sandboxkit.client.local import Connection
from sandboxkit.client.loop_thread import LoopThread, shared_loop_thread
from sandboxkit.client.options import ConnectOptions, RunOptions, StartOptions
from sandboxkit.client.output import Cursor
from sandboxkit.client.results import CommandResult, Failed, Ok, ProcessInfo, SandboxInfo
from sandboxkit.client.sandbox import DEFAULT_TIMEOUT, AsyncSandbox
from sandboxkit.client.stdin import StdinSession
from sandboxkit.lab_options import LabOptions
from sandboxkit.limits import Limits
from sandboxkit.vocab import OnTimeout

if TYPE_CHECKING:
    import pandas as pd
    from typing_extensions import Unpack  # (see client/sandbox.py: imported only to build a frame)

__all__ = ["CommandHandle", "Commands", "Sandbox", "SyncStdinSession"]

T = TypeVar("T")


def _run(coro: Coroutine[Any, Any, T], loop: LoopThread | None = None) -> T:
    return (loop or shared_loop_thread()).run(coro)


class CommandHandle:
    """Sync view of :class:`AsyncCommandHandle`."""

    def __init__(self, handle: AsyncCommandHandle, loop: LoopThread) -> None:
        self._handle = handle
        self._loop = loop
        self.pid = handle.pid

    @property
    def cursor(self) -> Cursor | None:
        """Sequence number of the next chunk this handle will receive (see
        :attr:`AsyncCommandHandle.cursor`)."""
        return self._handle.cursor

    @property
    def stdout(self) -> str:
        """Stdout received so far."""
        return self._handle.stdout

    @property
    def stderr(self) -> str:
        """Stderr received so far."""
        return self._handle.stderr

    @property
    def stdout_bytes(self) -> bytes:
        """Stdout bytes received so far, exactly as written."""
        return self._handle.stdout_bytes

    @property
    def stderr_bytes(self) -> bytes:
        """Stderr bytes received so far, exactly as written."""
        return self._handle.stderr_bytes

    @property
    def exit_code(self) -> int | None:
        """The exit code once the process ended."""
        return self._handle.exit_code

    @property
    def stream(self) -> OutputReader:
        """The underlying reader (stats, states): a :class:`ProcessStream` on a sandboxkit
        daemon."""
        return self._handle.stream

    @property
    def done(self) -> bool:
        """True once the stream ended (exit, error or disconnect)."""
        return self._handle.done

    @property
    def error(self) -> BaseException | None:
        """The error the stream ended with (see :attr:`AsyncCommandHandle.error`)."""
        return self._handle.error

    def result(self) -> CommandResult:
        """What was received so far, as a :class:`CommandResult`."""
        return self._handle.result()

    def wait(self, timeout: float | None = None) -> CommandResult:
        """Wait for exit and return the result; raises CommandExitError when the exit code
        is not 0, also for a killed process (see :meth:`AsyncCommandHandle.wait`).
        ``timeout``: give up waiting after that many seconds with WaitTimeout (a
        SandboxkitError, and a TimeoutError too); the process runs on and this handle
        keeps following it, so ``wait`` again later."""
        return self._loop.run(self._handle.wait(timeout))

    def kill(self) -> bool:
        """Kill the process."""
        return self._loop.run(self._handle.kill())

    def disconnect(self) -> Cursor | None:
        """Stop following output; the process keeps running. Returns the cursor to resume
        from: ``commands.connect(pid, cursor=handle.disconnect())``."""
        return self._loop.run(self._handle.disconnect())

    def send_stdin(self, data: str | bytes) -> None:
        """Write to the process's stdin."""
        self._loop.run(self._handle.send_stdin(data))

    def __repr__(self) -> str:
        return f"<CommandHandle pid={self.pid} cursor={self.cursor} exit={self.exit_code}>"


OnEnd = Callable[[CommandHandle], Any]
"""Called once with the handle when it stops following its process (see
:data:`sandboxkit.client.commands.OnEnd`); it runs on the client's background loop
thread."""


class _Mirror:
    """The one :class:`CommandHandle` of an async handle, made by whichever thread needs it
    first: the caller, or ``on_end`` on the loop thread (a fast process ends before
    ``run`` returns)."""

    def __init__(self, loop: LoopThread, on_end: OnEnd | None) -> None:
        self._loop = loop
        self._on_end = on_end
        self._lock = threading.Lock()
        self._handle: CommandHandle | None = None

    def __call__(self, handle: AsyncCommandHandle) -> CommandHandle:
        with self._lock:
            if self._handle is None:
                self._handle = CommandHandle(handle, self._loop)
            return self._handle

    def end(self, handle: AsyncCommandHandle) -> Any:
        assert self._on_end is not None
        return self._on_end(self(handle))

    @property
    def on_end(self) -> Callable[[AsyncCommandHandle], Any] | None:
        """What the async handle calls: ``on_end`` with this mirror."""
        return None if self._on_end is None else self.end


class SyncStdinSession:
    """Sync view of :class:`StdinSession`: writes run on the loop thread."""

    def __init__(self, session: StdinSession, loop: LoopThread) -> None:
        self._session = session
        self._loop = loop

    @property
    def unacked_bytes(self) -> int:
        """Bytes written but not yet acked."""
        return self._session.unacked_bytes

    @property
    def finished(self) -> bool:
        """Inputs exhausted and nothing in flight: the session has succeeded."""
        return self._session.finished

    def write(self, data: bytes | str) -> int:
        """Queue one batch; returns its sequence number."""
        return self._loop.run(self._session.write(data))

    def write_all(self, inputs: Iterable[bytes | str]) -> None:
        """Write every input, then :meth:`close`."""
        for item in inputs:
            self.write(item)
        self.close()

    def close(self) -> None:
        """No more inputs: wait until every batch is acked (or raise why it cannot be)."""
        self._loop.run(self._session.close())

    def abort(self) -> None:
        """Stop now; unacked batches may or may not have been applied."""
        self._loop.run(self._session.abort())

    def __enter__(self) -> SyncStdinSession:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class Commands:
    """Sync view of :class:`AsyncCommands`."""

    def __init__(self, commands: AsyncCommands, loop: LoopThread) -> None:
        self._commands = commands
        self._loop = loop

    def start(self, cmd: str | list[str], **options: Unpack[StartOptions]) -> ProcessInfo:
        """Start a process without following it (see :meth:`AsyncCommands.start`)."""
        return self._loop.run(self._commands.start(cmd, **options))

    @overload
    def run(
        self,
        cmd: str | list[str],
        background: Literal[False] = False,
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[RunOptions],
    ) -> CommandResult: ...

    @overload
    def run(
        self,
        cmd: str | list[str],
        background: Literal[True],
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[RunOptions],
    ) -> CommandHandle: ...

    @overload
    def run(
        self,
        cmd: str | list[str],
        background: bool = False,
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[RunOptions],
    ) -> CommandResult | CommandHandle: ...

    def run(
        self,
        cmd: str | list[str],
        background: bool = False,
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[RunOptions],
    ) -> CommandResult | CommandHandle:
        """Run a command: a :class:`CommandResult`, or with ``background=True`` a
        :class:`CommandHandle`. ``on_stdout``/``on_stderr`` get whole lines without their
        newline (``lines=False``: raw chunks); they run on the client's background loop
        thread, as does ``on_end(handle)``. See :meth:`AsyncCommands.run`."""
        mirror = _Mirror(self._loop, on_end)
        result = self._loop.run(
            self._commands.run(cmd, background, on_end=mirror.on_end, **options)
        )
        if isinstance(result, AsyncCommandHandle):
            return mirror(result)
        return result

    def connect(
        self,
        pid: int,
        cursor: int | None = None,
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[ConnectOptions],
    ) -> CommandHandle:
        """Follow a process from ``cursor`` (default: oldest retained output); an unknown
        pid raises ResultUnavailable here. See :meth:`AsyncCommands.connect`."""
        mirror = _Mirror(self._loop, on_end)
        handle = self._loop.run(
            self._commands.connect(pid, cursor, on_end=mirror.on_end, **options)
        )
        return mirror(handle)

    def try_run(
        self, cmd: str | list[str], **options: Unpack[RunOptions]
    ) -> Ok[CommandResult] | Failed:
        """:meth:`run` returning ``Ok(result)`` or ``Failed(error)`` instead of raising."""
        return self._loop.run(self._commands.try_run(cmd, **options))

    def try_connect(
        self, pid: int, cursor: int | None = None, **options: Unpack[ConnectOptions]
    ) -> Ok[CommandResult] | Failed:
        """Connect and wait; ``Ok(result)`` or ``Failed(error)``."""
        return self._loop.run(self._commands.try_connect(pid, cursor, **options))

    def list(self) -> list[ProcessInfo]:
        """Every process the daemon still knows."""
        return self._loop.run(self._commands.list())

    def get(self, pid: int) -> ProcessInfo:
        """One process."""
        return self._loop.run(self._commands.get(pid))

    def kill(self, pid: int) -> bool:
        """Kill a process."""
        return self._loop.run(self._commands.kill(pid))

    def restart(self, pid: int) -> ProcessInfo:
        """Kill and start the same command again; returns the new process."""
        return self._loop.run(self._commands.restart(pid))

    def stdin_session(self, pid: int, **options: Any) -> SyncStdinSession:
        """An exactly-once stdin session for ``pid`` (see :class:`StdinSession`)."""
        return SyncStdinSession(self._commands.stdin_session(pid, **options), self._loop)

    def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Write to a process's stdin, exactly once."""
        self._loop.run(self._commands.send_stdin(pid, data))

    def close_stdin(self, pid: int) -> None:
        """Close a process's stdin."""
        self._loop.run(self._commands.close_stdin(pid))


class Sandbox:
    """The sync sandbox client; same methods as :class:`AsyncSandbox`, blocking.

    Works inside a running Jupyter kernel. As a context manager it always kills the
    sandbox; otherwise the sandbox lives until :meth:`kill` or its timeout.
    """

    def __init__(self, sandbox: AsyncSandbox, loop: LoopThread | None = None) -> None:
        self._async = sandbox
        self._loop = loop or shared_loop_thread()
        self.sandbox_id = sandbox.sandbox_id
        self.commands = Commands(sandbox.commands, self._loop)
        self.files = Files(sandbox.files, self._loop)

    @property
    def async_sandbox(self) -> AsyncSandbox:
        """The async client underneath (lives on the background loop)."""
        return self._async

    @property
    def loop_thread(self) -> LoopThread:
        """The background loop thread this sandbox's calls run on (the notebook widgets
        run their client work there too)."""
        return self._loop

    @property
    def info(self) -> SandboxInfo:
        """The last known state."""
        return self._async.info

    @property
    def backend(self) -> SandboxBackend:
        """See :attr:`AsyncSandbox.backend`."""
        return self._async.backend

    @property
    def provider(self) -> str | None:
        """See :attr:`AsyncSandbox.provider`."""
        return self._async.provider

    @property
    def metrics_scope(self) -> str:
        """See :attr:`AsyncSandbox.metrics_scope`."""
        return self._async.metrics_scope

    @classmethod
    def create(
        cls,
        timeout: float | None = DEFAULT_TIMEOUT,
        on_timeout: OnTimeout = "kill",
        auto_resume: bool = False,
        *,
        envs: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        lab: LabOptions | None = None,
        isolation: Literal["auto", "namespaces", "none"] | None = None,
        allow_internet_access: bool = True,
        limits: Limits | dict[str, Any] | None = None,
        url: str | None = None,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        provider: str | None = None,
        provider_options: dict[str, Any] | None = None,
    ) -> Sandbox:
        """Create a sandbox (see :meth:`AsyncSandbox.create`; ``provider="e2b"`` for an
        E2B sandbox)."""
        loop = shared_loop_thread()
        sbx = loop.run(
            AsyncSandbox.create(
                timeout,
                on_timeout,
                auto_resume,
                envs=envs,
                metadata=metadata,
                lab=lab,
                isolation=isolation,
                allow_internet_access=allow_internet_access,
                limits=limits,
                url=url,
                token=token,
                transport=transport,
                provider=provider,
                provider_options=provider_options,
            )
        )
        return cls(sbx, loop)

    @classmethod
    def connect(
        cls,
        sandbox_id: str,
        *,
        url: str | None = None,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> Sandbox:
        """Attach to an existing sandbox."""
        loop = shared_loop_thread()
        sbx = loop.run(AsyncSandbox.connect(sandbox_id, url=url, token=token, transport=transport))
        return cls(sbx, loop)

    @staticmethod
    def list(
        *,
        url: str | None = None,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> list[SandboxInfo]:
        """Every sandbox the daemon knows."""
        return _run(AsyncSandbox.list(url=url, token=token, transport=transport))

    @property
    def connection(self) -> Connection:
        """The daemon this sandbox lives on (url and token)."""
        return self._async.connection

    def get_info(self) -> SandboxInfo:
        """Fresh state from the daemon."""
        return self._loop.run(self._async.get_info())

    def pause(self) -> None:
        """Freeze every process of the sandbox."""
        self._loop.run(self._async.pause())

    def resume(self) -> None:
        """Thaw every process of the sandbox."""
        self._loop.run(self._async.resume())

    def set_timeout(self, timeout: float | None) -> None:
        """Let the sandbox live until ``timeout`` seconds pass unused (``None``: until
        killed); the clock restarts now."""
        self._loop.run(self._async.set_timeout(timeout))

    def kill(self) -> None:
        """Kill and delete the sandbox; closes this client (later calls raise
        SandboxClosed)."""
        self._loop.run(self._async.kill())

    def close(self) -> None:
        """Drop this client and keep the sandbox: its processes run on until its timeout;
        ``Sandbox.connect(sandbox_id)`` reattaches (after a kernel restart too)."""
        self._loop.run(self._async.close())

    def events(self, since: int = 0) -> pd.DataFrame:
        """The event journal as a DataFrame."""
        return self._loop.run(self._async.events(since))

    def consumers(self) -> pd.DataFrame:
        """Per-consumer metrics as a DataFrame."""
        return self._loop.run(self._async.consumers())

    def raw_consumers(self) -> builtins.list[dict[str, Any]]:
        """The per-consumer metrics as the daemon sends them (see
        :meth:`AsyncSandbox.raw_consumers`)."""
        return self._loop.run(self._async.raw_consumers())

    def raw_events(
        self, since: int = 0, *, wait: float | None = None
    ) -> builtins.list[dict[str, Any]]:
        """The event journal as the daemon sends it (``wait``: a long poll, see
        :meth:`AsyncSandbox.raw_events`)."""
        return self._loop.run(self._async.raw_events(since, wait=wait))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._loop.run(self._async.__aexit__(exc_type, exc, tb))

    def __repr__(self) -> str:
        return f"<Sandbox {self.sandbox_id} {self.info.state}>"
