"""``AsyncSandbox``: the async client for one sandbox."""

from __future__ import annotations

import asyncio
import builtins
import warnings
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import httpx
import msgspec

from sandboxkit.client import provider as providers
from sandboxkit.client.api import ApiClient
from sandboxkit.client.backend import SandboxBackend
from sandboxkit.client.commands import AsyncCommands
from sandboxkit.client.daemon_backend import DaemonSandbox
from sandboxkit.client.files import AsyncFiles
from sandboxkit.client.local import Connection, resolve, resolved
from sandboxkit.client.results import SandboxInfo
from sandboxkit.errors import (
    InvalidArgument,
    IsolationWarning,
    SandboxNotFound,
)
from sandboxkit.lab_options import LabOptions
from sandboxkit.limits import Limits, to_limits
from sandboxkit.vocab import DEFAULT_SANDBOX_TIMEOUT, OnTimeout

if TYPE_CHECKING:
    # Imported where a frame is built: pandas takes about a second to import, which every
    # CLI command and client process would pay.
    import pandas as pd

__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncSandbox",
    "consumers_frame",
    "events_frame",
    "note_sandbox",
    "sandboxes_of_this_process",
]

_OF_THIS_PROCESS: set[str] = set()


def note_sandbox(sandbox_id: str) -> None:
    """Remember that this Python process (a notebook's kernel) made or opened a client
    of ``sandbox_id``: the dashboard shows these by default."""
    _OF_THIS_PROCESS.add(sandbox_id)


def sandboxes_of_this_process() -> frozenset[str]:
    """Ids of the sandboxes this process created or connected to (any daemon)."""
    return frozenset(_OF_THIS_PROCESS)


_KILL_DRAIN = 2.0

DEFAULT_TIMEOUT = DEFAULT_SANDBOX_TIMEOUT
"""Seconds a sandbox lives unused (no request, no attached stream) — E2B's default
(:data:`sandboxkit.vocab.DEFAULT_SANDBOX_TIMEOUT`)."""

_EVENT_COLUMNS = ["seq", "time", "kind", "sandbox_id", "pid", "reason", "data"]
_CONSUMER_COLUMNS = [
    "consumer_id",
    "name",
    "role",
    "sandbox_id",
    "pid",
    "state",
    "cursor",
    "head",
    "lag_bytes",
    "bytes_sent",
    "frames_sent",
    "blocked_since",
    "last_send",
    "attached_at",
    "closed_at",
    "close_reason",
    "peer",
    "ghost",
]


async def _connection(url: str | None, token: str | None) -> Connection:
    # Finding (or starting) the local daemon blocks: keep it off the event loop — unless
    # it is the daemon found before, still there (checked in microseconds).
    known = resolved(url, token)
    if known is not None:
        return known
    return await asyncio.to_thread(resolve, url, token)


class AsyncSandbox:
    """A sandbox — on a sandboxkit daemon, or a provider's (``provider="e2b"``).

    Use :meth:`create` or :meth:`connect`. As an async context manager it always kills the
    sandbox on exit, even when the body or the close raises (F9). It holds one backend
    (:class:`~sandboxkit.client.backend.SandboxBackend`): the daemon's, or a provider's.
    """

    def __init__(self, backend: SandboxBackend) -> None:
        self._backend = backend
        self._owner = backend.owner
        self.sandbox_id = backend.sandbox_id
        note_sandbox(self.sandbox_id)
        self.commands = AsyncCommands(backend.commands, self._owner)
        self.files = AsyncFiles(backend.files)

    @property
    def backend(self) -> SandboxBackend:
        """What this sandbox talks to: a sandboxkit daemon, or a provider."""
        return self._backend

    @property
    def info(self) -> SandboxInfo:
        """The sandbox's state as last known (:meth:`get_info` refreshes it)."""
        return self._backend.info

    @property
    def provider(self) -> str | None:
        """``None`` on a sandboxkit daemon; else the provider's name (``"e2b"``)."""
        return self._backend.provider

    @property
    def metrics_scope(self) -> str:
        """``"daemon"`` when a daemon measures the consumers; ``"client"`` when only this
        client's own readers are known (a provider's, e.g. E2B)."""
        return self._backend.metrics_scope

    # -- construction ----------------------------------------------------------------

    @classmethod
    async def create(
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
    ) -> AsyncSandbox:
        """Create a sandbox. It lives until you kill it (``kill()``, or the end of its
        ``with`` block) or until ``timeout`` seconds (default 300, as E2B) pass with no
        request naming it and no stream attached to it; then it is killed, or paused if
        ``on_timeout="pause"``. ``set_timeout`` changes the timeout; ``None``: never.
        With ``auto_resume`` a request to a paused sandbox resumes it.

        ``lab=LabOptions(...)`` (:mod:`sandboxkit.lab_options`) makes it a fault-lab
        sandbox: ``fanout`` ``blocking``/``kick`` (the shipped designs behind F1/F2;
        they deliver new output only, so a ``connect(pid, cursor=...)`` starts at the
        policy's position instead, what it skipped comes as a gap of its exact size and the
        daemon records ``consumer.cursor_ignored``),
        ``kick_grace``, ``queue``, and ``pause_ghosts``: streams open at a pause become
        ghosts on resume (F1). Without it: ``cursor`` fan-out, no ghosts.

        ``provider="e2b"``: an E2B sandbox behind this same interface, through the official
        ``e2b`` SDK (``pip install 'sandboxkit[e2b]'``); ``url`` is then an envd URL (the
        SDK's debug mode) and ``token`` an E2B API key, ``provider_options`` go to the
        SDK (see :mod:`sandboxkit.providers.e2b` and ``docs/e2b.md``).

        ``isolation`` (``docs/isolation.md``): ``"auto"`` — the daemon's default unless it
        was started with another — runs its processes in their own namespaces where the
        kernel allows (``/home/user`` is its directory, ``/tmp`` its own, the host's
        system read-only, nothing of the daemon or your home), and falls back to
        ``"none"`` with an :class:`IsolationWarning` where it does not;
        ``"namespaces"`` raises :class:`~sandboxkit.IsolationUnavailable` there instead.
        ``allow_internet_access=False`` leaves them loopback only. ``limits`` (a dict or
        :class:`~sandboxkit.limits.Limits`: ``memory``, ``pids``, ``cpu``, ``open_files``,
        ``disk``) caps what they use; ``get_info().limits_enforced`` says how each holds."""
        limits = to_limits(limits)  # InvalidArgument before anything is sent
        if provider is not None:
            if lab is not None or transport is not None:
                raise InvalidArgument(
                    "lab= and transport= need a sandboxkit daemon, not a provider",
                    field="provider",
                )
            if limits is not None or isolation not in (None, "auto") or not allow_internet_access:
                raise InvalidArgument(
                    "isolation=, allow_internet_access= and limits= are a sandboxkit daemon's;"
                    " pass the provider's own options in provider_options",
                    field="provider",
                )
            return await providers.load(provider).create(
                providers.CreateOptions(
                    timeout=timeout,
                    on_timeout=on_timeout,
                    auto_resume=auto_resume,
                    envs=envs,
                    metadata=metadata,
                    url=url,
                    token=token,
                    options=dict(provider_options or {}),
                )
            )
        conn = await _connection(url, token)
        api = ApiClient(conn.url, conn.token, transport=transport)
        try:
            body = {
                "timeout": timeout,
                "on_timeout": on_timeout,
                "auto_resume": auto_resume,
                "envs": envs or {},
                "metadata": metadata or {},
                "lab": None if lab is None else msgspec.to_builtins(lab),
                "allow_internet_access": allow_internet_access,
            }
            if isolation is not None:
                body["isolation"] = isolation
            if limits is not None:
                body["limits"] = msgspec.to_builtins(limits)
            info = SandboxInfo.from_json(await api.call("POST", "/sandboxes", json=body))
        except BaseException:
            await api.aclose()
            raise
        if info.isolation == "none" and info.isolation_reason:
            _warn_unisolated(info.isolation_reason)
        return cls(DaemonSandbox(api, info))

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        *,
        url: str | None = None,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        """Attach to an existing sandbox (e.g. after a kernel restart)."""
        conn = await _connection(url, token)
        api = ApiClient(conn.url, conn.token, transport=transport)
        try:
            info = SandboxInfo.from_json(await api.call("GET", f"/sandboxes/{sandbox_id}"))
            if info.state == "killed":
                raise SandboxNotFound(f"sandbox {sandbox_id} was killed", sandbox_id=sandbox_id)
        except BaseException:
            await api.aclose()
            raise
        return cls(DaemonSandbox(api, info))

    @staticmethod
    async def list(
        *,
        url: str | None = None,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> list[SandboxInfo]:
        """Every sandbox the daemon knows."""
        conn = await _connection(url, token)
        api = ApiClient(conn.url, conn.token, transport=transport)
        try:
            return [SandboxInfo.from_json(s) for s in await api.call("GET", "/sandboxes")]
        finally:
            await api.aclose()

    @property
    def connection(self) -> Connection:
        """Where this sandbox's backend is: the daemon's url and token (a provider's:
        its URL, no token)."""
        return self._backend.connection

    # -- lifecycle -------------------------------------------------------------------

    async def get_info(self) -> SandboxInfo:
        """Fresh state from the daemon (a provider: as it knows it)."""
        self._owner.check()
        return await self._backend.get_info()

    async def pause(self) -> None:
        """Freeze every process of the sandbox."""
        self._owner.check()
        await self._backend.pause()

    async def resume(self) -> None:
        """Thaw every process of the sandbox."""
        self._owner.check()
        await self._backend.resume()

    async def set_timeout(self, timeout: float | None) -> None:
        """Let the sandbox live until ``timeout`` seconds pass with no request and no
        attached stream (``None``: until killed); the clock restarts now."""
        self._owner.check()
        await self._backend.set_timeout(timeout)

    async def kill(self) -> None:
        """Kill every process and delete the sandbox; then close this client (every later
        call raises SandboxClosed)."""
        self._owner.check()
        try:
            await self._backend.kill()
        finally:
            await self._after_kill()

    async def _after_kill(self) -> None:
        self._owner.closed_because = "killed"
        # The backend has ended every process: let the streams this client follows read
        # their end frame (the exit code a handle's wait() reports), boundedly.
        try:
            await self._owner.drain(_KILL_DRAIN)
        finally:
            await self.close()

    async def close(self) -> None:
        """Drop this client — stop the streams it follows, close its connections — and
        keep the sandbox: its processes run on until its timeout, and
        ``AsyncSandbox.connect(sandbox_id)`` reattaches. Idempotent."""
        try:
            await self._owner.aclose()
        finally:
            await self._backend.aclose()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._owner.closed:
            return  # already killed (or closed) inside the block
        try:
            await self._backend.kill()
        finally:
            await self._after_kill()

    # -- observability ---------------------------------------------------------------

    async def events(self, since: int = 0) -> pd.DataFrame:
        """The sandbox's event journal as a DataFrame (one row per transition)."""
        return events_frame(await self.raw_events(since))

    async def consumers(self) -> pd.DataFrame:
        """Per-consumer metrics: cursor, head, lag, bytes sent, state, blocked-since. A
        provider's are this client's own readers only: ``frame.attrs["scope"]`` is then
        ``"client"``."""
        frame = consumers_frame(await self.raw_consumers())
        if self.metrics_scope == "client":
            frame.attrs["scope"] = "client"
        return frame

    async def raw_consumers(self) -> builtins.list[dict[str, Any]]:
        """The per-consumer metrics as the daemon (or a provider: :attr:`metrics_scope`)
        sends them, one dict per consumer: what :meth:`consumers` makes its DataFrame of,
        without pandas (a widget polling them several times a second pays a millisecond
        a DataFrame)."""
        return await self._backend.consumer_rows()

    async def raw_events(
        self, since: int = 0, *, wait: float | None = None
    ) -> builtins.list[dict[str, Any]]:
        """The event journal as the daemon sends it. With ``wait`` (seconds, at most 25)
        and no event from ``since`` on yet, the daemon answers as soon as one is recorded
        (a long poll), or with ``[]`` after ``wait``. A provider's journal is this
        client's own (each event's ``data`` says ``"source": "client"``), answered at
        once."""
        return await self._backend.raw_events(since, wait=wait)

    def __repr__(self) -> str:
        extra = self._backend.describe()
        return f"<AsyncSandbox {self.sandbox_id} {self.info.state}{extra}>"


_warned_unisolated = False


def _warn_unisolated(reason: str) -> None:
    """Say once per process that sandboxes here run without namespaces, and why."""
    global _warned_unisolated
    if not _warned_unisolated:
        _warned_unisolated = True
        warnings.warn(
            IsolationWarning(
                f"sandboxes run without isolation on this daemon: {reason or 'unknown'} "
                "(see docs/isolation.md; isolation='namespaces' makes this an error)"
            ),
            stacklevel=4,
        )


def events_frame(events: list[dict[str, Any]]) -> pd.DataFrame:
    """Events as a DataFrame with a datetime ``time`` column."""
    import pandas as pd

    frame: pd.DataFrame = pd.DataFrame(
        events, columns=["seq", "ts", "kind", "sandbox_id", "pid", "reason", "data"]
    )
    frame.insert(1, "time", pd.to_datetime(frame["ts"], unit="s"))
    frame["pid"] = frame["pid"].astype("Int64")
    result: pd.DataFrame = frame.drop(columns=["ts"])[_EVENT_COLUMNS]
    return result


def consumers_frame(consumers: list[dict[str, Any]]) -> pd.DataFrame:
    """Consumer metrics as a DataFrame."""
    import pandas as pd

    frame: pd.DataFrame = pd.DataFrame(consumers, columns=_CONSUMER_COLUMNS)
    frame["pid"] = frame["pid"].astype("Int64")
    return frame
