"""The small interfaces a sandbox's backend implements: what :class:`AsyncSandbox`,
:class:`AsyncCommands` and :class:`AsyncFiles` hold, as httpx's clients hold a transport.

The client classes are the one public face; a backend is what they talk to. A sandboxkit
daemon is one backend (:mod:`sandboxkit.client.daemon_backend`); a provider's — E2B's, in
:mod:`sandboxkit.providers.e2b` — is a sibling, not a subclass. What a backend cannot
tell is said so: a gap of unknown size is an :class:`~sandboxkit.client.stream.UnknownGap`,
an option it has no equivalent of a :class:`~sandboxkit.errors.ProviderUnsupported`.
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from sandboxkit.client.files import EntryInfo, WriteInfo
    from sandboxkit.client.local import Connection
    from sandboxkit.client.options import FollowOptions
    from sandboxkit.client.output import Cursor
    from sandboxkit.client.results import CommandResult, ProcessInfo, SandboxInfo
    from sandboxkit.client.stdin import StdinSession
    from sandboxkit.client.stream import StreamStats
    from sandboxkit.client.tasks import TaskOwner
    from sandboxkit.errors import OutputIncomplete

__all__ = ["CommandsBackend", "FilesBackend", "OutputReader", "SandboxBackend"]


class OutputReader(Protocol):
    """Follows one process's output from a cursor and delivers it to callbacks: what a
    handle runs and what it (and the widgets) read. A daemon's is a
    :class:`~sandboxkit.client.stream.ProcessStream`."""

    @property
    def pid(self) -> int: ...

    @property
    def cursor(self) -> Cursor | None:
        """Where the reader is; ``None`` before it knows (a daemon stream's first frame)."""

    @property
    def stdout(self) -> str: ...

    @property
    def stderr(self) -> str: ...

    @property
    def stdout_bytes(self) -> bytes: ...

    @property
    def stderr_bytes(self) -> bytes: ...

    @property
    def exit_code(self) -> int | None: ...

    @property
    def ended(self) -> bool:
        """True once the process's end was read."""

    @property
    def end_reason(self) -> str | None:
        """Why the process ended (``exit``, ``oom`` ...), if the backend says."""

    @property
    def stats(self) -> StreamStats:
        """What happened to this reader: gaps, bytes lost to them."""

    @property
    def bytes_dropped(self) -> int:
        """Output received but not kept (beyond ``keep_output``)."""

    @property
    def process_state(self) -> str | None: ...

    @property
    def sandbox_state(self) -> str | None: ...

    async def run(self) -> int | None:
        """Deliver output until the process ended and all was read; its exit code."""

    def incomplete_error(self, result: CommandResult) -> OutputIncomplete | None:
        """The error a foreground ``run`` raises because ``result`` (exit 0) misses output
        this reader lost — to gaps its ``on_gap`` did not take, or beyond ``keep_output``
        — or ``None`` when it is complete."""


class CommandsBackend(Protocol):
    """How a backend starts, follows and drives processes (``sbx.commands``)."""

    async def start_process(self, spec: dict[str, Any]) -> ProcessInfo:
        """Start the process ``spec`` describes — ``cmd`` (a shell command) or ``argv``,
        and ``envs``, ``cwd``, ``timeout``, ``pty``, ``tag`` as ``start`` got them."""

    async def follow_reader(
        self, pid: int, cursor: int | None, options: FollowOptions
    ) -> OutputReader:
        """The reader a handle runs: ``pid``'s output from ``cursor`` (``None``: the oldest
        kept), delivered as ``options`` say; ready before a handle exists, so an unknown
        or evicted pid raises ResultUnavailable here (and, where the backend knows the
        head, a cursor past it InvalidArgument), in as few round trips as it allows."""

    async def start_reader(self, spec: dict[str, Any], options: FollowOptions) -> OutputReader:
        """:meth:`start_process`, then the reader of its output from its first byte: what
        ``run`` does, in as few round trips as the backend allows."""

    async def list(self) -> builtins.list[ProcessInfo]: ...

    async def get(self, pid: int) -> ProcessInfo: ...

    async def kill(self, pid: int) -> bool: ...

    async def restart(self, pid: int) -> ProcessInfo: ...

    def stdin_session(self, pid: int, **options: Any) -> StdinSession: ...

    async def send_stdin(self, pid: int, data: str | bytes) -> None: ...

    async def close_stdin(self, pid: int) -> None: ...


class FilesBackend(Protocol):
    """Where ``sbx.files`` puts and reads files (arguments already checked)."""

    async def write(self, path: str, data: bytes) -> WriteInfo: ...

    async def read(self, path: str, format: Literal["text", "bytes"]) -> str | bytes: ...

    async def list(self, path: str) -> builtins.list[EntryInfo]: ...


class SandboxBackend(Protocol):
    """One sandbox, wherever it runs: what :class:`AsyncSandbox` holds. It owns the
    sandbox's state as last known (``info``) and the :class:`TaskOwner` every background
    task of this client belongs to."""

    @property
    def provider(self) -> str | None:
        """``None`` for a sandboxkit daemon; else the provider's name (``"e2b"``)."""

    @property
    def metrics_scope(self) -> str:
        """``"daemon"`` when a daemon measures the consumers; ``"client"`` when only this
        client's own readers are known."""

    @property
    def sandbox_id(self) -> str: ...

    @property
    def info(self) -> SandboxInfo: ...

    @property
    def owner(self) -> TaskOwner: ...

    @property
    def commands(self) -> CommandsBackend: ...

    @property
    def files(self) -> FilesBackend: ...

    @property
    def connection(self) -> Connection: ...

    async def get_info(self) -> SandboxInfo: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def set_timeout(self, timeout: float | None) -> None: ...

    async def kill(self) -> None:
        """End the sandbox (the client's own closing follows, in :class:`AsyncSandbox`)."""

    async def aclose(self) -> None:
        """Release what this backend holds (connections); the sandbox runs on."""

    async def consumer_rows(self) -> builtins.list[dict[str, Any]]: ...

    async def raw_events(
        self, since: int = 0, *, wait: float | None = None
    ) -> builtins.list[dict[str, Any]]: ...

    def describe(self) -> str:
        """What ``repr`` of the sandbox says after its id and state (e.g. ``(debug)``)."""
