"""Commands of a sandbox: run, connect, list, kill, restart, stdin."""

from __future__ import annotations

import asyncio
import inspect
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

from sandboxkit.client.options import (
    CONNECT_KEYWORDS,
    RUN_KEYWORDS,
    START_KEYWORDS,
    ConnectOptions,
    FollowOptions,
    RunOptions,
    StartOptions,
    check_keywords,
    follow_options,
    process_spec,
)
from sandboxkit.client.output import DEFAULT_KEEP_OUTPUT, Cursor
from sandboxkit.client.results import CommandResult, Failed, Ok, ProcessInfo, attempt
from sandboxkit.client.stdin import StdinSession
from sandboxkit.client.tasks import TaskOwner
from sandboxkit.errors import (
    CommandExitError,
    InvalidArgument,
    ResultUnavailable,
    WaitTimeout,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from sandboxkit.client.backend import CommandsBackend, OutputReader

_STDERR_LINES = 5
"""How many of the last stderr lines a CommandExitError's message quotes."""


_REASONS = {
    "oom": " (out of memory: the sandbox's memory limit)",
    "timeout": " (its timeout= ran out)",
}


def wait_timeout(pid: int, timeout: float | None) -> WaitTimeout:
    """The error of a ``wait(timeout=)`` that ran out."""
    return WaitTimeout(
        f"process {pid} did not exit within {timeout:g} s; it runs on and the handle keeps "
        "following it: wait again, or kill it",
        pid=pid,
        timeout=timeout,
    )


def _check_cursor_type(cursor: object) -> None:
    """InvalidArgument unless ``cursor`` is None or a sequence number (an int >= 0)."""
    if cursor is None:
        return
    if isinstance(cursor, bool) or not isinstance(cursor, int):
        raise InvalidArgument(
            f"cursor must be an int (a sequence number, e.g. handle.cursor) or None, not "
            f"{type(cursor).__name__} {cursor!r}"[:200],
            field="cursor",
        )
    if cursor < 0:
        raise InvalidArgument(
            f"cursor {cursor} is negative: a cursor is a sequence number from 0 up", field="cursor"
        )


def exit_error(result: CommandResult) -> CommandExitError:
    """The error for a command that did not exit 0: its exit code (or the signal that
    killed it) and the last lines of its stderr, so the reason is in the message."""
    code = result.exit_code
    if code is None:
        what = "ended without an exit code"
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        what = f"was killed by {name} (exit code {code})"
    else:
        what = f"failed with exit code {code}"
    tail = [line[:300] for line in result.stderr.rstrip("\n").splitlines()[-_STDERR_LINES:]]
    message = f"process {result.pid} {what}"
    if result.reason not in (None, "exit"):
        message += f", reason {result.reason}" + _REASONS.get(str(result.reason), "")
    if result.bytes_lost:
        message += f" ({result.bytes_lost} bytes of its output were lost)"
    if tail:
        message += "; the end of its stderr:\n    " + "\n    ".join(tail)
    else:
        message += "; it wrote nothing to stderr"
    return CommandExitError(message, pid=result.pid, exit_code=code, result=result)


async def _await(awaitable: Any) -> None:
    await awaitable


def _retrieve(task: asyncio.Task[Any]) -> None:
    # A handle nobody waits on must not print "Task exception was never retrieved";
    # wait() still raises the error, from the task.
    if not task.cancelled():
        task.exception()


__all__ = ["AsyncCommandHandle", "AsyncCommands", "FollowOptions", "OnEnd"]

OnEnd = Callable[["AsyncCommandHandle"], Any]
"""Called once with the handle when it stops following its process — the process exited
(``handle.exit_code``), the stream ended with an error (``handle.error``), or the handle
was disconnected (neither) — after the last output callback. Sync or async; an async one
runs as a task of the sandbox client, so it is not run once the client is closed."""


class AsyncCommandHandle:
    """A running (or finished) process whose output this client follows."""

    def __init__(
        self, commands: AsyncCommands, stream: OutputReader, on_end: OnEnd | None = None
    ) -> None:
        self._commands = commands
        self.stream = stream
        self.pid = stream.pid
        self._on_end = on_end
        self._disconnecting = False
        self._task = commands._owner.spawn(stream.run(), name=f"sandboxkit-stream-{self.pid}")
        self._task.add_done_callback(_retrieve)
        self._task.add_done_callback(self._stream_ended)

    @property
    def cursor(self) -> Cursor | None:
        """Sequence number of the next chunk this handle will receive (a
        :class:`~sandboxkit.client.output.Cursor`: an ``int`` that also carries a
        character split there, for ``commands.connect(pid, cursor=...)``)."""
        return self.stream.cursor

    @property
    def stdout(self) -> str:
        """Stdout received so far (the newest ``keep_output`` bytes), decoded; a marker
        where output was lost to a gap."""
        return self.stream.stdout

    @property
    def stderr(self) -> str:
        """Stderr received so far (the newest ``keep_output`` bytes), decoded."""
        return self.stream.stderr

    @property
    def stdout_bytes(self) -> bytes:
        """Stdout bytes received so far (the newest ``keep_output``), exactly as written."""
        return self.stream.stdout_bytes

    @property
    def stderr_bytes(self) -> bytes:
        """Stderr bytes received so far (the newest ``keep_output``), exactly as written."""
        return self.stream.stderr_bytes

    @property
    def exit_code(self) -> int | None:
        """The exit code once the process ended, else ``None``."""
        return self.stream.exit_code

    @property
    def done(self) -> bool:
        """True once the stream ended (exit, error or disconnect)."""
        return self._task.done()

    @property
    def error(self) -> BaseException | None:
        """The error the stream ended with (e.g. a
        :class:`~sandboxkit.errors.StreamInterrupted` it gave up reattaching after, or
        :class:`~sandboxkit.errors.OutputGap` with ``on_gap="raise"``); ``None`` while it
        runs, after the process exited, and after :meth:`disconnect`."""
        if not self._task.done() or self._task.cancelled():
            return None
        return self._task.exception()

    def result(self) -> CommandResult:
        """What was received so far, as a :class:`CommandResult`."""
        lost = self.stream.stats.bytes_lost + self.stream.bytes_dropped
        return CommandResult(
            self.stdout,
            self.stderr,
            self.exit_code,
            self.pid,
            bytes_lost=lost,
            reason=self.stream.end_reason,
        )

    async def wait(self, timeout: float | None = None) -> CommandResult:
        """Wait for the process to exit and return its result. Raises CommandExitError
        when the exit code is not 0 — also for a killed process (a negative code, the
        signal) — with the result in ``error.result``; SandboxClosed if the sandbox
        client was closed; ResultUnavailable if this handle was disconnected.
        ``timeout``: give up after that many seconds with WaitTimeout (also a
        TimeoutError); the process runs on and this handle keeps following it."""
        try:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except TimeoutError:
                if self._task.done():
                    raise  # the stream's own error happened to be a TimeoutError
                raise wait_timeout(self.pid, timeout) from None
        except asyncio.CancelledError:
            if not self._task.cancelled():
                raise  # it is this wait that was cancelled
            self._commands._owner.check()
            raise ResultUnavailable(
                f"this handle of process {self.pid} was disconnected at cursor={self.cursor}; "
                f"follow it again with commands.connect({self.pid}, cursor={self.cursor})",
                pid=self.pid,
                reason="disconnected",
            ) from None
        result = self.result()
        if result.exit_code != 0:
            raise exit_error(result)
        return result

    async def kill(self) -> bool:
        """Kill the process (SIGTERM, then SIGKILL); False if it was not running. A
        following :meth:`wait` raises CommandExitError with the signal's negative code."""
        return await self._commands.kill(self.pid)

    async def disconnect(self) -> Cursor | None:
        """Stop following output; the process keeps running. Returns the cursor to resume
        from, exactly after the last output received here — with the bytes of a character
        and the start of a line cut there, so text and lines continue exactly:
        ``commands.connect(pid, cursor=await handle.disconnect())``."""
        self._disconnecting = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._end()
        return self.cursor

    def _stream_ended(self, task: asyncio.Task[Any]) -> None:
        if not self._disconnecting:
            self._end()

    def _end(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is None:
            return
        try:
            result = on_end(self)
            if not inspect.isawaitable(result):
                return
            owner = self._commands._owner
            if owner.closed:  # its task would be cancelled before it ran
                if inspect.iscoroutine(result):
                    result.close()
                return
            owner.spawn(_await(result), name=f"sandboxkit-on-end-{self.pid}")
        except Exception as exc:  # a callback's bug is reported, as asyncio reports its own
            asyncio.get_running_loop().call_exception_handler(
                {"message": f"on_end of process {self.pid} raised", "exception": exc}
            )

    async def send_stdin(self, data: str | bytes) -> None:
        """Write to the process's stdin."""
        await self._commands.send_stdin(self.pid, data)

    def __repr__(self) -> str:
        return f"<AsyncCommandHandle pid={self.pid} cursor={self.cursor} exit={self.exit_code}>"


class AsyncCommands:
    """``sbx.commands``: start processes and follow their output.

    ``run``, ``connect`` and the handles they return are the same for every backend; the
    backend (:class:`~sandboxkit.client.backend.CommandsBackend`: a sandboxkit daemon's,
    or a provider's) starts the processes and supplies the reader each handle runs."""

    def __init__(self, backend: CommandsBackend, owner: TaskOwner) -> None:
        self._backend = backend
        self._owner = owner

    async def start(self, cmd: str | list[str], **options: Unpack[StartOptions]) -> ProcessInfo:
        """Start a process without following it. A list is an argv; a string, a shell
        command. No deadline unless ``timeout`` is given (F10); the options are
        :class:`~sandboxkit.client.options.StartOptions`."""
        check_keywords(START_KEYWORDS, "AsyncCommands.start", options)
        self._owner.check()
        return await self._backend.start_process(process_spec(cmd, options))

    @overload
    async def run(
        self,
        cmd: str | list[str],
        background: Literal[False] = False,
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[RunOptions],
    ) -> CommandResult: ...

    @overload
    async def run(
        self,
        cmd: str | list[str],
        background: Literal[True],
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[RunOptions],
    ) -> AsyncCommandHandle: ...

    @overload
    async def run(
        self,
        cmd: str | list[str],
        background: bool = False,
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[RunOptions],
    ) -> CommandResult | AsyncCommandHandle: ...

    async def run(
        self,
        cmd: str | list[str],
        background: bool = False,
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[RunOptions],
    ) -> CommandResult | AsyncCommandHandle:
        """Run a command. Foreground (default): wait and return a :class:`CommandResult`,
        raising CommandExitError on a non-zero exit. ``background=True``: return an
        :class:`AsyncCommandHandle` at once.

        Every option is a keyword (:class:`~sandboxkit.client.options.RunOptions`, defined
        once for the async and sync clients). The command runs in the sandbox's own
        working directory unless ``cwd`` says otherwise; ``envs``, ``timeout`` and ``pty``
        as in :meth:`start`. ``on_stdout``/``on_stderr`` get whole lines without their newline
        (``on_stdout=print`` prints what the process printed); ``lines=False`` gives them
        raw chunks as they arrive instead. ``on_stdout_bytes``/``on_stderr_bytes`` get
        each chunk's bytes exactly as written (binary output).

        ``keep_output``: what the result (or handle) keeps — ``True`` all of it, ``False``
        nothing, a number the newest that many bytes of each stream; default: all in the
        foreground, 8 MiB in the background. Output lost to a gap is announced (an
        :class:`~sandboxkit.errors.OutputGapWarning` and a marker in ``stdout``) unless
        ``on_gap`` handles it. A foreground result is complete or the call raises
        :class:`~sandboxkit.errors.OutputIncomplete` saying how many bytes were lost.

        ``on_end(handle)`` is called once when the handle stops following the process
        (see :data:`OnEnd`), after the last output callback."""
        check_keywords(RUN_KEYWORDS, "AsyncCommands.run", options)
        follow = follow_options(options, DEFAULT_KEEP_OUTPUT if background else True)
        self._owner.check()
        reader = await self._backend.start_reader(process_spec(cmd, options), follow)
        handle = AsyncCommandHandle(self, reader, on_end)
        if background:
            return handle
        try:
            result = await handle.wait()
        except asyncio.CancelledError:
            await handle.disconnect()
            raise
        incomplete = handle.stream.incomplete_error(result)
        if incomplete is not None:
            raise incomplete
        return result

    async def connect(
        self,
        pid: int,
        cursor: int | None = None,
        *,
        on_end: OnEnd | None = None,
        **options: Unpack[ConnectOptions],
    ) -> AsyncCommandHandle:
        """Follow a running or recently exited process from ``cursor`` (default: the oldest
        retained output). An unknown or evicted pid raises ResultUnavailable here, before
        a handle exists. Callbacks, gaps and ``keep_output`` (default: the newest 8 MiB)
        and ``on_end`` as in :meth:`run`; ``role`` labels this reader in the consumer
        metrics (default ``sdk``). Without a cursor, output evicted before this reader
        started is a gap (``on_gap``, or the default warning and marker), never a silent
        start at what is left. In a fault-lab sandbox whose fan-out is ``blocking`` or
        ``kick`` the cursor cannot be honoured (those designs deliver new output only):
        the stream starts where the policy is, and what it skipped is a gap of its exact
        size (``GapInfo.reason == "not_replayed"``)."""
        check_keywords(CONNECT_KEYWORDS, "AsyncCommands.connect", options)
        self._owner.check()
        _check_cursor_type(cursor)
        follow = follow_options(options, DEFAULT_KEEP_OUTPUT)
        reader = await self._backend.follow_reader(pid, cursor, follow)
        return AsyncCommandHandle(self, reader, on_end)

    async def try_run(
        self, cmd: str | list[str], **options: Unpack[RunOptions]
    ) -> Ok[CommandResult] | Failed:
        """:meth:`run` in the foreground, returning ``Ok(result)`` or ``Failed(error)``
        (a non-zero exit is ``Failed(CommandExitError)``) instead of raising."""
        options.pop("background", None)  # type: ignore[typeddict-item]  # ignored if given
        return await attempt(self.run(cmd, **options))

    async def try_connect(
        self, pid: int, cursor: int | None = None, **options: Unpack[ConnectOptions]
    ) -> Ok[CommandResult] | Failed:
        """Connect and wait for the exit; ``Ok(result)`` or ``Failed(error)`` — e.g.
        ``Failed(ResultUnavailable)`` for an unknown or evicted pid."""

        async def follow() -> CommandResult:
            handle = await self.connect(pid, cursor, **options)
            return await handle.wait()

        return await attempt(follow())

    async def list(self) -> list[ProcessInfo]:
        """Every process the sandbox still knows (running, or exited within the TTL)."""
        self._owner.check()
        return await self._backend.list()

    async def get(self, pid: int) -> ProcessInfo:
        """One process."""
        self._owner.check()
        return await self._backend.get(pid)

    async def kill(self, pid: int) -> bool:
        """Kill a process; False if it had already exited or is unknown."""
        self._owner.check()
        return await self._backend.kill(pid)

    async def restart(self, pid: int) -> ProcessInfo:
        """Kill ``pid`` and start the same command again; returns the new process."""
        self._owner.check()
        return await self._backend.restart(pid)

    def stdin_session(self, pid: int, **options: Any) -> StdinSession:
        """An exactly-once stdin session for ``pid`` (see :class:`StdinSession`)."""
        self._owner.check()
        return self._backend.stdin_session(pid, **options)

    async def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Write ``data`` to the process's stdin exactly once, retrying through
        disconnects (where the backend can: E2B's writes at most once)."""
        self._owner.check()
        await self._backend.send_stdin(pid, data)

    async def close_stdin(self, pid: int) -> None:
        """Close the process's stdin (it reads EOF)."""
        self._owner.check()
        await self._backend.close_stdin(pid)
