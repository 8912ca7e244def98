"""``AsyncSandbox``: the async client for one sandbox."""

from __future__ import annotations

import asyncio
import builtins
from types import TracebackType
from typing import Any, Literal

import httpx
import pandas as pd

from sandboxkit.client.api import ApiClient
from sandboxkit.client.commands import AsyncCommands
from sandboxkit.client.local import Connection, resolve
from sandboxkit.client.results import SandboxInfo
from sandboxkit.client.tasks import TaskOwner
from sandboxkit.errors import SandboxNotFound

__all__ = ["AsyncSandbox", "consumers_frame", "events_frame"]

_EVENT_COLUMNS = ["seq", "time", "kind", "sandbox_id", "pid", "reason", "data"]
_CONSUMER_COLUMNS = [
    "consumer_id",
    "name",
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
    # Finding (or starting) the local daemon blocks: keep it off the event loop.
    return await asyncio.to_thread(resolve, url, token)


class AsyncSandbox:
    """A sandbox on a sandboxkit daemon.

    Use :meth:`create` or :meth:`connect`. As an async context manager it always kills the
    sandbox on exit, even when the body or the close raises (F9).
    """

    def __init__(self, api: ApiClient, info: SandboxInfo) -> None:
        self._api = api
        self._owner = TaskOwner()
        self.sandbox_id = info.sandbox_id
        self.info = info
        self.commands = AsyncCommands(api, info.sandbox_id, self._owner)

    # -- construction ----------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        timeout: float | None = None,
        on_timeout: Literal["pause", "kill"] = "pause",
        auto_resume: bool = False,
        *,
        envs: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        fanout: str | None = None,
        kick_grace: float | None = None,
        pause_ghosts: bool = False,
        ghost_buffer: int | None = None,
        url: str | None = None,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox. ``timeout`` is an idle timeout in seconds (``None``: never),
        after which the sandbox is paused or killed as ``on_timeout`` says; with
        ``auto_resume`` a request to a paused sandbox resumes it.

        Fault-lab options: ``fanout`` (``cursor``, the default; or ``blocking``/``kick``,
        the shipped designs behind F1/F2), ``kick_grace`` for ``kick``, and
        ``pause_ghosts``: streams open at a pause become ghosts on resume (F1)."""
        conn = await _connection(url, token)
        api = ApiClient(conn.url, conn.token, transport=transport)
        try:
            body = {
                "timeout": timeout,
                "on_timeout": on_timeout,
                "auto_resume": auto_resume,
                "envs": envs or {},
                "metadata": metadata or {},
                "fanout": fanout,
                "kick_grace": kick_grace,
                "pause_ghosts": pause_ghosts,
                "ghost_buffer": ghost_buffer,
            }
            info = SandboxInfo.from_json(await api.call("POST", "/sandboxes", json=body))
        except BaseException:
            await api.aclose()
            raise
        return cls(api, info)

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
        return cls(api, info)

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
        """The daemon this sandbox lives on (url and token)."""
        return Connection(self._api.url, self._api.token)

    # -- lifecycle -------------------------------------------------------------------

    @property
    def _path(self) -> str:
        return f"/sandboxes/{self.sandbox_id}"

    async def get_info(self) -> SandboxInfo:
        """Fresh state from the daemon."""
        self.info = SandboxInfo.from_json(await self._api.call("GET", self._path))
        return self.info

    async def pause(self) -> None:
        """Freeze every process of the sandbox."""
        self.info = SandboxInfo.from_json(await self._api.call("POST", self._path + "/pause"))

    async def resume(self) -> None:
        """Thaw every process of the sandbox."""
        self.info = SandboxInfo.from_json(await self._api.call("POST", self._path + "/resume"))

    async def kill(self) -> None:
        """Kill every process and delete the sandbox; then close this client."""
        try:
            await self._api.call("DELETE", self._path)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop every stream this client follows and close its connections; the sandbox
        itself keeps running (reconnect with :meth:`connect`)."""
        try:
            await self._owner.aclose()
        finally:
            await self._api.aclose()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._api.call("DELETE", self._path)
        finally:
            await self.close()

    # -- observability ---------------------------------------------------------------

    async def events(self, since: int = 0) -> pd.DataFrame:
        """The sandbox's event journal as a DataFrame (one row per transition)."""
        return events_frame(await self.raw_events(since))

    async def consumers(self) -> pd.DataFrame:
        """Per-consumer metrics: cursor, head, lag, bytes sent, state, blocked-since."""
        return consumers_frame(await self._api.call("GET", self._path + "/consumers"))

    async def raw_events(self, since: int = 0) -> builtins.list[dict[str, Any]]:
        """The event journal as the daemon sends it."""
        result: builtins.list[dict[str, Any]] = await self._api.call(
            "GET", self._path + "/events", since=since
        )
        return result

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.sandbox_id} {self.info.state}>"


def events_frame(events: list[dict[str, Any]]) -> pd.DataFrame:
    """Events as a DataFrame with a datetime ``time`` column."""
    frame: pd.DataFrame = pd.DataFrame(
        events, columns=["seq", "ts", "kind", "sandbox_id", "pid", "reason", "data"]
    )
    frame.insert(1, "time", pd.to_datetime(frame["ts"], unit="s"))
    frame["pid"] = frame["pid"].astype("Int64")
    result: pd.DataFrame = frame.drop(columns=["ts"])[_EVENT_COLUMNS]
    return result


def consumers_frame(consumers: list[dict[str, Any]]) -> pd.DataFrame:
    """Consumer metrics as a DataFrame."""
    frame: pd.DataFrame = pd.DataFrame(consumers, columns=_CONSUMER_COLUMNS)
    frame["pid"] = frame["pid"].astype("Int64")
    return frame
