"""Commands of a sandbox: run, connect, list, kill, restart, stdin."""

from __future__ import annotations

import asyncio
from typing import Any

from sandboxkit.client.api import ApiClient
from sandboxkit.client.results import CommandResult, Failed, Ok, ProcessInfo, attempt
from sandboxkit.client.stdin import HttpStdinTransport, StdinSession
from sandboxkit.client.stream import OnGap, OutputCallback, ProcessStream
from sandboxkit.client.tasks import TaskOwner
from sandboxkit.errors import CommandExitError, ProcessNotFound

__all__ = ["AsyncCommandHandle", "AsyncCommands"]


class AsyncCommandHandle:
    """A running (or finished) process whose output this client follows."""

    def __init__(self, commands: AsyncCommands, stream: ProcessStream) -> None:
        self._commands = commands
        self.stream = stream
        self.pid = stream.pid
        self._task = commands._owner.spawn(stream.run(), name=f"sandboxkit-stream-{self.pid}")

    @property
    def cursor(self) -> int | None:
        """Sequence number of the next chunk this handle will receive."""
        return self.stream.cursor

    @property
    def stdout(self) -> str:
        """Stdout received so far."""
        return self.stream.stdout

    @property
    def stderr(self) -> str:
        """Stderr received so far."""
        return self.stream.stderr

    @property
    def exit_code(self) -> int | None:
        """The exit code once the process ended, else ``None``."""
        return self.stream.exit_code

    @property
    def done(self) -> bool:
        """True once the stream ended (exit, error or disconnect)."""
        return self._task.done()

    def result(self) -> CommandResult:
        """What was received so far, as a :class:`CommandResult`."""
        return CommandResult(self.stdout, self.stderr, self.exit_code, self.pid)

    async def wait(self) -> CommandResult:
        """Wait for the process to exit; raises CommandExitError on a non-zero exit."""
        await asyncio.shield(self._task)
        result = self.result()
        if result.exit_code != 0:
            raise CommandExitError(
                f"command exited with code {result.exit_code}",
                pid=self.pid,
                exit_code=result.exit_code,
                result=result,
            )
        return result

    async def kill(self) -> bool:
        """Kill the process (SIGTERM, then SIGKILL); False if it was not running."""
        return await self._commands.kill(self.pid)

    async def disconnect(self) -> None:
        """Stop following output; the process keeps running. Reconnect with
        ``commands.connect(pid, cursor=handle.cursor)``."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def send_stdin(self, data: str | bytes) -> None:
        """Write to the process's stdin."""
        await self._commands.send_stdin(self.pid, data)

    def __repr__(self) -> str:
        return f"<AsyncCommandHandle pid={self.pid} cursor={self.cursor} exit={self.exit_code}>"


class AsyncCommands:
    """``sbx.commands``: start processes and follow their output."""

    def __init__(self, api: ApiClient, sandbox_id: str, owner: TaskOwner) -> None:
        self._api = api
        self._sandbox_id = sandbox_id
        self._owner = owner

    def _path(self, pid: int | None = None) -> str:
        base = f"/sandboxes/{self._sandbox_id}/processes"
        return base if pid is None else f"{base}/{pid}"

    async def start(
        self,
        cmd: str | list[str],
        *,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        pty: bool = False,
        tag: str | None = None,
    ) -> ProcessInfo:
        """Start a process without following it. A list is an argv; a string, a shell
        command. No deadline unless ``timeout`` is given (F10)."""
        body: dict[str, Any] = {
            "envs": envs or {},
            "cwd": cwd,
            "timeout": timeout,
            "pty": pty,
            "tag": tag,
        }
        body["argv" if isinstance(cmd, list) else "cmd"] = cmd
        return ProcessInfo.from_json(await self._api.call("POST", self._path(), json=body))

    async def run(
        self,
        cmd: str | list[str],
        background: bool = False,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        *,
        pty: bool = False,
        on_gap: OnGap = None,
    ) -> Any:
        """Run a command. Foreground (default): wait and return a :class:`CommandResult`,
        raising CommandExitError on a non-zero exit. ``background=True``: return an
        :class:`AsyncCommandHandle` at once."""
        info = await self.start(cmd, envs=envs, cwd=cwd, timeout=timeout, pty=pty)
        handle = self._follow(info.pid, 0, on_stdout, on_stderr, on_gap)
        if background:
            return handle
        try:
            return await handle.wait()
        except asyncio.CancelledError:
            await handle.disconnect()
            raise

    async def connect(
        self,
        pid: int,
        cursor: int | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        *,
        on_gap: OnGap = None,
    ) -> AsyncCommandHandle:
        """Follow a running or recently exited process from ``cursor`` (default: the oldest
        retained output)."""
        return self._follow(pid, cursor, on_stdout, on_stderr, on_gap)

    def _follow(
        self,
        pid: int,
        cursor: int | None,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        on_gap: OnGap,
    ) -> AsyncCommandHandle:
        stream = ProcessStream(
            self._api,
            self._sandbox_id,
            pid,
            cursor,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_gap=on_gap,
        )
        return AsyncCommandHandle(self, stream)

    async def try_run(self, cmd: str | list[str], **options: Any) -> Ok[CommandResult] | Failed:
        """:meth:`run` in the foreground, returning ``Ok(result)`` or ``Failed(error)``
        (a non-zero exit is ``Failed(CommandExitError)``) instead of raising."""
        options.pop("background", None)
        return await attempt(self.run(cmd, **options))

    async def try_connect(
        self, pid: int, cursor: int | None = None, **options: Any
    ) -> Ok[CommandResult] | Failed:
        """Connect and wait for the exit; ``Ok(result)`` or ``Failed(error)`` — e.g.
        ``Failed(ResultUnavailable)`` for an unknown or evicted pid."""

        async def follow() -> CommandResult:
            handle = await self.connect(pid, cursor, **options)
            return await handle.wait()

        return await attempt(follow())

    async def list(self) -> list[ProcessInfo]:
        """Every process the daemon still knows (running, or exited within the TTL)."""
        return [ProcessInfo.from_json(p) for p in await self._api.call("GET", self._path())]

    async def get(self, pid: int) -> ProcessInfo:
        """One process."""
        return ProcessInfo.from_json(await self._api.call("GET", self._path(pid)))

    async def kill(self, pid: int) -> bool:
        """Kill a process; False if it had already exited or is unknown."""
        try:
            answer = await self._api.call("POST", self._path(pid) + "/kill")
        except ProcessNotFound:
            return False
        return bool(answer.get("killed"))

    async def restart(self, pid: int) -> ProcessInfo:
        """Kill ``pid`` and start the same command again; returns the new process."""
        return ProcessInfo.from_json(await self._api.call("POST", self._path(pid) + "/restart"))

    def stdin_session(self, pid: int, **options: Any) -> StdinSession:
        """An exactly-once stdin session for ``pid`` (see :class:`StdinSession`)."""
        return StdinSession(HttpStdinTransport(self._api, self._sandbox_id, pid), **options)

    async def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Write ``data`` to the process's stdin exactly once, retrying through
        disconnects."""
        async with self.stdin_session(pid) as session:
            await session.write(data)

    async def close_stdin(self, pid: int) -> None:
        """Close the process's stdin (it reads EOF)."""
        await self._api.call("POST", self._path(pid) + "/stdin/close")
