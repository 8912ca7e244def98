"""envd's ``filesystem.Filesystem`` service: ``Stat``, ``ListDir``, ``MakeDir``,
``Move``, ``Remove`` — what the SDK's ``files.list``, ``exists``, ``get_info``,
``make_dir``, ``rename`` and ``remove`` call — and directory watchers: the ``WatchDir``
server stream (the async SDK's ``files.watch_dir``) and the polling ``CreateWatcher`` /
``GetWatcherEvents`` / ``RemoveWatcher`` (the sync SDK's), both on inotify
(:mod:`sandboxkit.daemon.dir_watch`). Paths resolve as in :mod:`sandboxkit.daemon.files`
(inside the sandbox's directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import secrets
import shutil
import stat
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sandboxkit.daemon.dir_watch import DirWatcher, WatchBroken, WatchEvent
from sandboxkit.daemon.envd.connect import (
    STREAM_CONTENT_TYPE,
    ConnectError,
    EnvelopeReader,
    decode,
    end_stream,
    envelope,
)
from sandboxkit.daemon.envd.process_service import (
    RpcService,
    SandboxLookup,
    keepalive_interval,
    read_body,
    timeout,
)
from sandboxkit.daemon.envd.streaming import StreamBody, StreamGuards
from sandboxkit.daemon.files import resolve
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.errors import FileNotFound

__all__ = ["FilesystemService"]


class _Path(Struct):
    path: str = ""


class _ListDir(Struct):
    path: str = ""
    depth: int = 1


class _Move(Struct):
    source: str = ""
    destination: str = ""


class _Watch(Struct, rename="camel"):
    path: str = ""
    recursive: bool = False
    include_entry: bool = False
    allow_network_mounts: bool = False


class _WatcherId(Struct, rename="camel"):
    watcher_id: str = ""


MAX_WATCHERS = 256
"""Polling watchers kept at once (the oldest idle one goes first past this)."""

IDLE_WATCHER = 60.0
"""Seconds a polling watcher lives without a ``GetWatcherEvents``: a client that forgot
its ``RemoveWatcher`` does not keep an inotify descriptor forever."""

_KINDS = {
    "create": "EVENT_TYPE_CREATE",
    "write": "EVENT_TYPE_WRITE",
    "remove": "EVENT_TYPE_REMOVE",
    "rename": "EVENT_TYPE_RENAME",
    "chmod": "EVENT_TYPE_CHMOD",
}


def _event(root: Path, event: WatchEvent, include_entry: bool) -> dict[str, Any]:
    name, kind = event
    result: dict[str, Any] = {"name": name, "type": _KINDS[kind]}
    if include_entry and kind not in ("remove", "rename"):
        with contextlib.suppress(FileNotFound):  # gone again already: no entry
            result["entry"] = entry_info(root / name)
    return result


def _broken(exc: WatchBroken) -> ConnectError:
    return ConnectError("aborted", f"{exc}; start a new watch")


class _Polled:
    """A polling watcher and when it was last read."""

    def __init__(self, sandbox_id: str, watcher: DirWatcher, include_entry: bool) -> None:
        self.sandbox_id = sandbox_id
        self.watcher = watcher
        self.include_entry = include_entry
        self.used = time.monotonic()


class WatchStream(Response):
    """A ``WatchDir`` response: ``start``, then one ``filesystem`` message per event,
    keepalives at the client's interval, until it leaves, its deadline, or the watcher
    breaks (``aborted``)."""

    def __init__(
        self,
        watcher: DirWatcher,
        include_entry: bool,
        keepalive: float | None,
        deadline: float | None,
    ) -> None:
        super().__init__(media_type=STREAM_CONTENT_TYPE)
        self.watcher = watcher
        self.include_entry = include_entry
        self.keepalive = keepalive
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", STREAM_CONTENT_TYPE.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        out = StreamBody(send)
        tail = end_stream()
        try:
            await out.write(envelope({"start": {}}))
            pump = asyncio.ensure_future(self._pump(out))
            keepalive = envelope({"keepalive": {}})
            guards = StreamGuards(receive, out, keepalive, self.keepalive, self.deadline)
            guards.tasks.add(pump)
            try:
                await asyncio.wait(guards.tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await guards.cancel()
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                error = pump.exception()
                if isinstance(error, WatchBroken):
                    tail = end_stream(_broken(error))
                else:
                    failed = f"internal error: {type(error).__name__}"
                    tail = end_stream(ConnectError("internal", failed))
            elif guards.expired:
                expired = ConnectError("deadline_exceeded", "the watch reached its timeout")
                tail = end_stream(expired)
        finally:
            self.watcher.close()
            await out.finish(tail)

    async def _pump(self, out: StreamBody) -> None:
        while True:
            for event in await self.watcher.next_events():
                message = _event(self.watcher.root, event, self.include_entry)
                await out.write(envelope({"filesystem": message}))


def _name(lookup: Callable[[int], Any], ident: int) -> str:
    try:
        return str(lookup(ident)[0])
    except KeyError:
        return str(ident)


def entry_info(path: Path) -> dict[str, Any]:
    """envd's ``EntryInfo`` (proto3 JSON) for ``path``."""
    try:
        link = path.lstat()
    except FileNotFoundError:
        raise FileNotFound(f"no such file or directory: {path}", path=str(path)) from None
    info = path.stat() if stat.S_ISLNK(link.st_mode) and path.exists() else link
    kind = "FILE_TYPE_DIRECTORY" if stat.S_ISDIR(info.st_mode) else "FILE_TYPE_FILE"
    modified = datetime.fromtimestamp(info.st_mtime, tz=timezone.utc)
    result: dict[str, Any] = {
        "name": path.name,
        "type": kind,
        "path": str(path),
        "size": str(info.st_size),
        "mode": stat.S_IMODE(info.st_mode),
        "permissions": stat.filemode(info.st_mode),
        "owner": _name(pwd.getpwuid, info.st_uid),
        "group": _name(grp.getgrgid, info.st_gid),
        "modifiedTime": modified.isoformat().replace("+00:00", "Z"),
    }
    if stat.S_ISLNK(link.st_mode):
        result["isSymlink"] = True
        result["symlinkTarget"] = os.readlink(path)
    return result


def _is_root(sandbox: ManagedSandbox, target: Path) -> bool:
    return target == Path(sandbox.workdir).resolve()


class FilesystemService(RpcService):
    """The ``filesystem.Filesystem`` handlers."""

    def __init__(self, host: Host, lookup: SandboxLookup) -> None:
        super().__init__(host, lookup)
        self._watchers: dict[str, _Polled] = {}

    def routes(self) -> dict[str, Callable[[Request], Awaitable[Response]]]:
        """Method path → handler."""
        return {
            "/filesystem.Filesystem/WatchDir": self._streaming(self.watch_dir),
            "/filesystem.Filesystem/CreateWatcher": self._unary(self.create_watcher),
            "/filesystem.Filesystem/GetWatcherEvents": self._unary(self.get_watcher_events),
            "/filesystem.Filesystem/RemoveWatcher": self._unary(self.remove_watcher),
            "/filesystem.Filesystem/Stat": self._unary(self.stat),
            "/filesystem.Filesystem/ListDir": self._unary(self.list_dir),
            "/filesystem.Filesystem/MakeDir": self._unary(self.make_dir),
            "/filesystem.Filesystem/Move": self._unary(self.move),
            "/filesystem.Filesystem/Remove": self._unary(self.remove),
        }

    async def _resolve(self, request: Request, path: str, *, not_root: bool = False) -> Path:
        sandbox = await self.lookup(request, False)
        target = resolve(sandbox, path)
        if not_root and _is_root(sandbox, target):
            raise ConnectError("invalid_argument", "the sandbox's own directory stays")
        return target

    async def stat(self, request: Request, body: bytes) -> dict[str, Any]:
        target = await self._resolve(request, decode(body, _Path).path)
        return {"entry": entry_info(target)}

    async def list_dir(self, request: Request, body: bytes) -> dict[str, Any]:
        message = decode(body, _ListDir)
        root = await self._resolve(request, message.path or ".")
        if not root.is_dir():
            raise FileNotFound(f"no such directory: {root}", path=str(root))
        depth = max(1, message.depth)
        entries: list[dict[str, Any]] = []
        level = [root]
        for _ in range(depth):
            below: list[Path] = []
            for directory in level:
                for child in sorted(directory.iterdir(), key=lambda p: p.name):
                    entries.append(entry_info(child))
                    if child.is_dir() and not child.is_symlink():
                        below.append(child)
            level = below
        return {"entries": entries}

    async def make_dir(self, request: Request, body: bytes) -> dict[str, Any]:
        target = await self._resolve(request, decode(body, _Path).path)
        if target.exists():
            raise ConnectError("already_exists", f"{target} already exists")
        target.mkdir(parents=True)
        return {"entry": entry_info(target)}

    async def move(self, request: Request, body: bytes) -> dict[str, Any]:
        message = decode(body, _Move)
        source = await self._resolve(request, message.source, not_root=True)
        destination = await self._resolve(request, message.destination)
        if not source.exists():
            raise FileNotFound(f"no such file or directory: {source}", path=str(source))
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, destination)
        return {"entry": entry_info(destination)}

    async def remove(self, request: Request, body: bytes) -> dict[str, Any]:
        target = await self._resolve(request, decode(body, _Path).path, not_root=True)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        else:
            raise FileNotFound(f"no such file or directory: {target}", path=str(target))
        return {}

    # -- watchers ----------------------------------------------------------------------

    async def _watcher(self, request: Request, message: _Watch) -> DirWatcher:
        if message.allow_network_mounts:
            raise ConnectError("invalid_argument", "sandboxkit watches local directories only")
        root = await self._resolve(request, message.path or ".")
        if not root.is_dir():
            raise FileNotFound(f"no such directory: {root}", path=str(root))
        try:
            return DirWatcher(root, recursive=message.recursive)
        except OSError as exc:  # e.g. the inotify limits of this host
            raise ConnectError("unavailable", f"cannot watch {root}: {exc}") from exc

    async def watch_dir(self, request: Request) -> Response:
        body = await self._one_message(request, _Watch)
        deadline = timeout(request)
        watcher = await self._watcher(request, body)
        return WatchStream(watcher, body.include_entry, keepalive_interval(request), deadline)

    async def _one_message(self, request: Request, model: type[_Watch]) -> _Watch:
        reader = EnvelopeReader()
        found = reader.feed(await read_body(request))
        if len(found) != 1 or reader.pending:
            raise ConnectError("invalid_argument", "expected exactly one request message")
        return decode(found[0], model)

    def _expire(self) -> None:
        """Drop watchers idle too long, of killed sandboxes, and the oldest past the cap."""
        now = time.monotonic()
        for wid, polled in list(self._watchers.items()):
            sandbox = self.host.sandboxes.get(polled.sandbox_id)
            if now - polled.used > IDLE_WATCHER or sandbox is None or sandbox.state == "killed":
                self._watchers.pop(wid).watcher.close()
        while len(self._watchers) >= MAX_WATCHERS:
            oldest = min(self._watchers, key=lambda w: self._watchers[w].used)
            self._watchers.pop(oldest).watcher.close()

    async def create_watcher(self, request: Request, body: bytes) -> dict[str, Any]:
        message = decode(body, _Watch)
        sandbox = await self.lookup(request, False)
        self._expire()
        watcher = await self._watcher(request, message)
        wid = "w-" + secrets.token_hex(8)
        self._watchers[wid] = _Polled(sandbox.sandbox_id, watcher, message.include_entry)
        return {"watcherId": wid}

    def _polled(self, wid: str) -> _Polled:
        self._expire()
        polled = self._watchers.get(wid)
        if polled is None:
            raise ConnectError("not_found", f"no watcher {wid!r} (removed, or idle too long)")
        polled.used = time.monotonic()
        return polled

    async def get_watcher_events(self, request: Request, body: bytes) -> dict[str, Any]:
        polled = self._polled(decode(body, _WatcherId).watcher_id)
        try:
            events = polled.watcher.take()
        except WatchBroken as exc:
            raise _broken(exc) from exc
        root = polled.watcher.root
        return {"events": [_event(root, e, polled.include_entry) for e in events]}

    async def remove_watcher(self, request: Request, body: bytes) -> dict[str, Any]:
        wid = decode(body, _WatcherId).watcher_id
        polled = self._watchers.pop(wid, None)
        if polled is None:
            raise ConnectError("not_found", f"no watcher {wid!r}")
        polled.watcher.close()
        return {}

    def close(self) -> None:
        """Release every polling watcher."""
        for polled in self._watchers.values():
            polled.watcher.close()
        self._watchers.clear()
