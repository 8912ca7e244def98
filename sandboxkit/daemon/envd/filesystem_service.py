"""envd's ``filesystem.Filesystem`` service (unary calls): ``Stat``, ``ListDir``,
``MakeDir``, ``Move``, ``Remove`` — what the SDK's ``files.list``, ``exists``,
``get_info``, ``make_dir``, ``rename`` and ``remove`` call. Paths resolve as in
:mod:`sandboxkit.daemon.files` (inside the sandbox's directory). Watchers are not served.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import Response

from sandboxkit.daemon.envd.connect import ConnectError, decode
from sandboxkit.daemon.envd.process_service import RpcService
from sandboxkit.daemon.files import resolve
from sandboxkit.daemon.sandbox import Sandbox
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


def _is_root(sandbox: Sandbox, target: Path) -> bool:
    return target == Path(sandbox.workdir).resolve()


class FilesystemService(RpcService):
    """The ``filesystem.Filesystem`` handlers."""

    def routes(self) -> dict[str, Callable[[Request], Awaitable[Response]]]:
        """Method path → handler."""
        return {
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
