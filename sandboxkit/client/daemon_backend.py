"""The sandboxkit daemon as a backend (:mod:`sandboxkit.client.backend`): a sandbox, its
commands and its files, over the daemon's HTTP API."""

from __future__ import annotations

import base64
import builtins
from typing import Any, Literal

from sandboxkit.client.api import ApiClient
from sandboxkit.client.files import EntryInfo, WriteInfo
from sandboxkit.client.local import Connection
from sandboxkit.client.options import FollowOptions
from sandboxkit.client.results import ProcessInfo, SandboxInfo
from sandboxkit.client.start_stream import follow_stream, start_stream
from sandboxkit.client.stdin import HttpStdinTransport, StdinSession
from sandboxkit.client.stream import ProcessStream
from sandboxkit.client.tasks import TaskOwner
from sandboxkit.errors import ProcessNotFound

__all__ = ["DaemonCommands", "DaemonFiles", "DaemonSandbox"]


class DaemonCommands:
    """A sandbox's processes on the daemon; each handle reads a :class:`ProcessStream` of
    the daemon's output log."""

    def __init__(self, api: ApiClient, sandbox_id: str, owner: TaskOwner) -> None:
        self.api = api
        self.sandbox_id = sandbox_id
        self.owner = owner

    async def _call(self, method: str, path: str, json: Any = None) -> Any:
        self.owner.check()  # SandboxClosed, saying why, before any request
        return await self.api.call(method, path, json=json)

    def _path(self, pid: int | None = None) -> str:
        base = f"/sandboxes/{self.sandbox_id}/processes"
        return base if pid is None else f"{base}/{pid}"

    async def start_process(self, spec: dict[str, Any]) -> ProcessInfo:
        """``spec`` is the daemon's request body as it is."""
        return ProcessInfo.from_json(await self._call("POST", self._path(), json=spec))

    async def follow_reader(
        self, pid: int, cursor: int | None, options: FollowOptions
    ) -> ProcessStream:
        """One request: the stream from ``cursor``, opened now (the daemon refuses an
        unknown pid or a cursor past the head before a handle exists)."""
        self.owner.check()
        return await follow_stream(self.api, self.sandbox_id, pid, cursor, options)

    async def start_reader(self, spec: dict[str, Any], options: FollowOptions) -> ProcessStream:
        """One request: the start answers with the output stream."""
        self.owner.check()
        return await start_stream(self.api, self.sandbox_id, spec, options)

    async def list(self) -> builtins.list[ProcessInfo]:
        return [ProcessInfo.from_json(p) for p in await self._call("GET", self._path())]

    async def get(self, pid: int) -> ProcessInfo:
        return ProcessInfo.from_json(await self._call("GET", self._path(pid)))

    async def kill(self, pid: int) -> bool:
        try:
            answer = await self._call("POST", self._path(pid) + "/kill")
        except ProcessNotFound:
            return False
        return bool(answer.get("killed"))

    async def restart(self, pid: int) -> ProcessInfo:
        return ProcessInfo.from_json(await self._call("POST", self._path(pid) + "/restart"))

    def stdin_session(self, pid: int, **options: Any) -> StdinSession:
        self.owner.check()
        return StdinSession(HttpStdinTransport(self.api, self.sandbox_id, pid), **options)

    async def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Exactly once, retrying through disconnects (a stdin session)."""
        async with self.stdin_session(pid) as session:
            await session.write(data)

    async def close_stdin(self, pid: int) -> None:
        await self._call("POST", self._path(pid) + "/stdin/close")


class DaemonFiles:
    """A sandbox's files on the daemon: content base64-encoded in JSON."""

    def __init__(self, api: ApiClient, sandbox_id: str) -> None:
        self.api = api
        self.path = f"/sandboxes/{sandbox_id}/files"

    async def write(self, path: str, data: bytes) -> WriteInfo:
        body = {"path": path, "data": base64.b64encode(data).decode()}
        info = await self.api.call("PUT", self.path, json=body)
        return WriteInfo(name=info["name"], type=info["type"], path=info["path"])

    async def read(self, path: str, format: Literal["text", "bytes"]) -> str | bytes:
        info = await self.api.call("GET", self.path, file=path)
        data = base64.b64decode(info["data"])
        return data if format == "bytes" else data.decode("utf-8", errors="replace")

    async def list(self, path: str) -> builtins.list[EntryInfo]:
        entries = await self.api.call("GET", f"{self.path}/list", file=path)
        return [
            EntryInfo(name=e["name"], type=e["type"], path=e["path"], size=e["size"])
            for e in entries
        ]


class DaemonSandbox:
    """One sandbox on a sandboxkit daemon, through one :class:`ApiClient`."""

    provider: str | None = None
    metrics_scope: str = "daemon"

    def __init__(self, api: ApiClient, info: SandboxInfo) -> None:
        self.api = api
        self.info = info
        self.owner = TaskOwner(info.sandbox_id)
        self.commands = DaemonCommands(api, info.sandbox_id, self.owner)
        self.files = DaemonFiles(api, info.sandbox_id)

    @property
    def sandbox_id(self) -> str:
        return self.info.sandbox_id

    @property
    def connection(self) -> Connection:
        return Connection(self.api.url, self.api.token)

    @property
    def _path(self) -> str:
        return f"/sandboxes/{self.sandbox_id}"

    async def _call(self, method: str, path: str, json: Any = None, **params: Any) -> Any:
        self.owner.check()  # SandboxClosed, saying why, before any request
        return await self.api.call(method, self._path + path, json=json, **params)

    async def get_info(self) -> SandboxInfo:
        self.info = SandboxInfo.from_json(await self._call("GET", ""))
        return self.info

    async def pause(self) -> None:
        self.info = SandboxInfo.from_json(await self._call("POST", "/pause"))

    async def resume(self) -> None:
        self.info = SandboxInfo.from_json(await self._call("POST", "/resume"))

    async def set_timeout(self, timeout: float | None) -> None:
        self.info = SandboxInfo.from_json(
            await self._call("POST", "/timeout", {"timeout": timeout})
        )

    async def kill(self) -> None:
        await self.api.call("DELETE", self._path)

    async def aclose(self) -> None:
        await self.api.aclose()

    async def consumer_rows(self) -> builtins.list[dict[str, Any]]:
        rows: builtins.list[dict[str, Any]] = await self._call("GET", "/consumers")
        return rows

    async def raw_events(
        self, since: int = 0, *, wait: float | None = None
    ) -> builtins.list[dict[str, Any]]:
        result: builtins.list[dict[str, Any]] = await self._call(
            "GET", "/events", since=since, wait=wait
        )
        return result

    def describe(self) -> str:
        return ""
