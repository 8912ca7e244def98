"""envd's ``filesystem.Filesystem`` service: ``Stat``, ``ListDir``, ``MakeDir``,
``Move``, ``Remove`` — what the SDK's ``files.list``, ``exists``, ``get_info``,
``make_dir``, ``rename`` and ``remove`` call — and directory watchers: the ``WatchDir``
server stream (the async SDK's ``files.watch_dir``) and the polling ``CreateWatcher`` /
``GetWatcherEvents`` / ``RemoveWatcher`` (the sync SDK's), both on inotify
(:mod:`sandboxkit.daemon.dir_watch`). Paths are the sandbox's
(:mod:`sandboxkit.daemon.sandbox_paths`: ``/home/user``, ``/tmp``, relative to
``/home/user``), resolved beneath its directories; every file-system call runs off the
event loop; ``ListDir``'s ``depth`` is at most ``sandbox_paths.MAX_LIST_DEPTH`` and a
listing at most ``sandbox_paths.MAX_LIST_ENTRIES`` entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import secrets
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

from sandboxkit.daemon.dir_watch import DirWatcher, WatchBroken, WatchEvent, directories
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
from sandboxkit.daemon.sandbox_paths import (
    MAX_LIST_DEPTH,
    MAX_LIST_ENTRIES,
    Located,
    fs_error,
    off_loop,
    wire_name,
)
from sandboxkit.errors import FileNotFound, InvalidArgument, SandboxkitError

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


async def _event(root: Located, event: WatchEvent, include_entry: bool) -> dict[str, Any]:
    name, kind = event
    result: dict[str, Any] = {"name": wire_name(name), "type": _KINDS[kind]}
    if include_entry and kind not in ("remove", "rename"):
        below = Located(root.root, root.base, (*root.parts, *os.fsencode(name).split(b"/")))
        with contextlib.suppress(SandboxkitError):  # gone again already: no entry
            result["entry"] = await off_loop(below.shown, entry_info, below)
    return result


def _broken(exc: WatchBroken) -> ConnectError:
    return ConnectError("aborted", f"{exc}; start a new watch")


class _Polled:
    """A polling watcher and when it was last read."""

    def __init__(
        self, sandbox_id: str, watcher: DirWatcher, root: Located, include_entry: bool
    ) -> None:
        self.sandbox_id = sandbox_id
        self.watcher = watcher
        self.root = root
        self.include_entry = include_entry
        self.used = time.monotonic()


class WatchStream(Response):
    """A ``WatchDir`` response: ``start``, then one ``filesystem`` message per event,
    keepalives at the client's interval, until it leaves, its deadline, or the watcher
    breaks (``aborted``)."""

    def __init__(
        self,
        watcher: DirWatcher,
        root: Located,
        include_entry: bool,
        keepalive: float | None,
        deadline: float | None,
    ) -> None:
        super().__init__(media_type=STREAM_CONTENT_TYPE)
        self.watcher = watcher
        self.root = root
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
                message = await _event(self.root, event, self.include_entry)
                await out.write(envelope({"filesystem": message}))


def _name(lookup: Callable[[int], Any], ident: int) -> str:
    try:
        return str(lookup(ident)[0])
    except KeyError:
        return str(ident)


def entry_info(target: Located, own: os.stat_result | None = None) -> dict[str, Any]:
    """envd's ``EntryInfo`` (proto3 JSON) for ``target`` (blocking: run off the loop). A
    symlink is described by its target where that stays inside, and says so."""
    own = own or target.lstat()
    info = own
    if stat.S_ISLNK(own.st_mode):
        with contextlib.suppress(SandboxkitError):  # dangling, a loop, or leads outside
            info = target.stat()
    kind = "FILE_TYPE_DIRECTORY" if stat.S_ISDIR(info.st_mode) else "FILE_TYPE_FILE"
    modified = datetime.fromtimestamp(info.st_mtime, tz=timezone.utc)
    result: dict[str, Any] = {
        "name": target.name,
        "type": kind,
        "path": target.shown,
        "size": str(info.st_size),
        "mode": stat.S_IMODE(info.st_mode),
        "permissions": stat.filemode(info.st_mode),
        "owner": _name(pwd.getpwuid, info.st_uid),
        "group": _name(grp.getgrgid, info.st_gid),
        "modifiedTime": modified.isoformat().replace("+00:00", "Z"),
    }
    if stat.S_ISLNK(own.st_mode):
        result["isSymlink"] = True
        result["symlinkTarget"] = target.readlink()
    return result


def _list(root: Located, depth: int) -> list[dict[str, Any]]:
    """``depth`` levels of ``root``'s tree, breadth first, by name in each directory;
    subdirectories that vanish meanwhile are skipped; symlinks are not descended."""
    entries: list[dict[str, Any]] = []
    level = [root]
    for below_root in range(depth):
        deeper: list[Located] = []
        for directory in level:
            try:
                children = list(directory.scandir())
            except FileNotFound:
                if below_root == 0:
                    raise
                continue
            for name, own in children:
                child = directory.child(name)
                entries.append(entry_info(child, own))
                if len(entries) > MAX_LIST_ENTRIES:
                    raise InvalidArgument(
                        f"{root.shown} holds more than {MAX_LIST_ENTRIES} entries within "
                        f"depth {depth}: list a smaller depth",
                        field="depth",
                        path=root.shown,
                        reason="too_many_entries",
                    )
                if stat.S_ISDIR(own.st_mode):
                    deeper.append(child)
        level = deeper
    return entries


def _make_dir(target: Located) -> bool:
    with contextlib.suppress(FileNotFound):
        target.lstat()
        return False  # already there (a directory or not): envd's already_exists
    target.make_parents()
    return target.make_dir(exist_ok=True)


def _move(source: Located, destination: Located) -> None:
    source.lstat()  # FileNotFound for a missing source
    destination.make_parents()
    src = source.open_parent()
    try:
        dst = destination.open_parent()
        try:
            os.rename(source.parts[-1], destination.parts[-1], src_dir_fd=src, dst_dir_fd=dst)
        except OSError as exc:
            raise fs_error(exc, f"{source.shown} -> {destination.shown}") from None
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _remove(target: Located) -> None:
    target.lstat()  # FileNotFound for a missing path
    target.remove()


def _watch_root(target: Located) -> Path:
    """The host path of the directory ``target`` leads to (resolved beneath the root)."""
    fd = target.open(os.O_PATH | os.O_DIRECTORY)
    try:
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
    finally:
        os.close(fd)
    if not real.is_relative_to(os.path.realpath(target.root)):
        raise InvalidArgument(f"{target.shown} moved away", field="path", path=target.shown)
    return real


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

    async def _resolve(self, request: Request, path: str, *, not_root: bool = False) -> Located:
        sandbox = await self.lookup(request, False)
        target = resolve(sandbox, path)
        if not_root and (target.is_root or target.parts[-1] == b".."):
            message = f"{target.shown}: the sandbox's own directories stay"
            raise ConnectError("invalid_argument", message)
        return target

    async def stat(self, request: Request, body: bytes) -> dict[str, Any]:
        target = await self._resolve(request, decode(body, _Path).path)
        return {"entry": await off_loop(target.shown, entry_info, target)}

    async def list_dir(self, request: Request, body: bytes) -> dict[str, Any]:
        message = decode(body, _ListDir)
        root = await self._resolve(request, message.path or ".")
        depth = min(max(1, message.depth), MAX_LIST_DEPTH)
        return {"entries": await off_loop(root.shown, _list, root, depth)}

    async def make_dir(self, request: Request, body: bytes) -> dict[str, Any]:
        target = await self._resolve(request, decode(body, _Path).path)
        if not await off_loop(target.shown, _make_dir, target):
            raise ConnectError("already_exists", f"{target.shown} already exists")
        return {"entry": await off_loop(target.shown, entry_info, target)}

    async def move(self, request: Request, body: bytes) -> dict[str, Any]:
        message = decode(body, _Move)
        source = await self._resolve(request, message.source, not_root=True)
        destination = await self._resolve(request, message.destination, not_root=True)
        await off_loop(source.shown, _move, source, destination)
        return {"entry": await off_loop(destination.shown, entry_info, destination)}

    async def remove(self, request: Request, body: bytes) -> dict[str, Any]:
        target = await self._resolve(request, decode(body, _Path).path, not_root=True)
        await off_loop(target.shown, _remove, target)
        return {}

    # -- watchers ----------------------------------------------------------------------

    async def _watcher(self, request: Request, message: _Watch) -> tuple[DirWatcher, Located]:
        if message.allow_network_mounts:
            raise ConnectError("invalid_argument", "sandboxkit watches local directories only")
        root = await self._resolve(request, message.path or ".")
        real = await off_loop(root.shown, _watch_root, root)
        try:
            below = await off_loop(root.shown, directories, real) if message.recursive else []
            return DirWatcher(real, recursive=message.recursive, below=below), root
        except OSError as exc:  # e.g. the inotify limits of this host
            raise ConnectError("unavailable", f"cannot watch {root.shown}: {exc}") from exc

    async def watch_dir(self, request: Request) -> Response:
        body = await self._one_message(request, _Watch)
        deadline = timeout(request)
        watcher, root = await self._watcher(request, body)
        keepalive = keepalive_interval(request)
        return WatchStream(watcher, root, body.include_entry, keepalive, deadline)

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
        watcher, root = await self._watcher(request, message)
        wid = "w-" + secrets.token_hex(8)
        self._watchers[wid] = _Polled(sandbox.sandbox_id, watcher, root, message.include_entry)
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
        return {"events": [await _event(polled.root, e, polled.include_entry) for e in events]}

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
