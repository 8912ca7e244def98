"""Files in a sandbox: put a script in, read a result out (E2B's ``sandbox.files``).

Paths are the sandbox's (:mod:`sandboxkit.daemon.sandbox_paths`): ``/home/user/...`` is
its working directory, ``/tmp/...`` its private temporary directory, a relative path is
relative to ``/home/user``; nothing outside is reached, whatever symlinks a sandboxed
process swaps in meanwhile. Served two ways: sandboxkit's own API (:class:`FilesApi`,
JSON with base64 content, behind the bearer token) and envd's ``/files``
(:mod:`sandboxkit.daemon.envd.files`, raw bytes streamed, for the e2b SDK). Every file
operation runs off the event loop (``sandbox_paths.off_loop``), so a FIFO, a huge file or
a slow disk never stalls another client.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from sandboxkit.daemon.host import Host
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.sandbox_paths import CHUNK, Located, fs_error, locate, off_loop
from sandboxkit.daemon.schema import decode_body, decode_query
from sandboxkit.errors import PayloadTooLarge, SandboxkitError

__all__ = [
    "MAX_READ",
    "FileContent",
    "FileEntry",
    "FileQuery",
    "FilesApi",
    "WriteFile",
    "entry",
    "list_dir",
    "read",
    "resolve",
    "write",
    "write_fd",
]

MAX_READ = 16 * 1024 * 1024
"""Largest file sandboxkit's ``GET .../files`` returns (whole, base64 in JSON): past it,
PayloadTooLarge. envd's ``GET /files`` streams a file of any size."""


def resolve(sandbox: ManagedSandbox, path: str | None) -> Located:
    """Where ``path`` leads in ``sandbox`` (not yet opened): InvalidArgument for no
    path, or one outside ``/home/user`` and ``/tmp``."""
    return locate(Path(sandbox.workdir), Path(sandbox.tmpdir), path)


def entry(target: Located, info: os.stat_result | None = None) -> dict[str, Any]:
    """A file's description, E2B-shaped: ``name``, ``type`` (file/dir), ``path`` (the
    sandbox path), ``size``. A symlink is described by its target if that stays inside."""
    if info is None or stat.S_ISLNK(info.st_mode):
        try:
            info = target.stat()
        except SandboxkitError:
            if info is None:
                info = target.lstat()
    kind = "dir" if stat.S_ISDIR(info.st_mode) else "file"
    return {"name": target.name, "type": kind, "path": target.shown, "size": info.st_size}


def list_dir(target: Located) -> list[dict[str, Any]]:
    """The entries of a directory, sorted by name; FileNotFound if it is not one."""
    return [entry(target.child(name), info) for name, info in target.scandir()]


def write_fd(target: Located) -> int:
    """``target`` opened for writing, emptied, its parents created: a regular file only."""
    target.make_parents()
    fd = target.open_regular(os.O_WRONLY | os.O_CREAT)
    try:
        os.ftruncate(fd, 0)
    except OSError as exc:
        os.close(fd)
        raise _fs(exc, target) from None
    return fd


def write_all(fd: int, data: bytes | memoryview, target: Located) -> None:
    """Write every byte of ``data`` (typed errors, e.g. ENOSPC)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view[:CHUNK]) :]
    except OSError as exc:
        raise _fs(exc, target) from None


def write(target: Located, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``target`` (creating its parents); its entry."""
    fd = write_fd(target)
    try:
        write_all(fd, data, target)
        return entry(target, os.fstat(fd))
    finally:
        os.close(fd)


def read(target: Located, limit: int = MAX_READ) -> tuple[dict[str, Any], bytes]:
    """The entry and bytes of ``target``: FileNotFound if it is missing, InvalidArgument
    if it is a directory or not a regular file, PayloadTooLarge past ``limit``."""
    fd = target.open_regular(os.O_RDONLY)
    try:
        info = os.fstat(fd)
        data = bytearray()
        while info.st_size <= limit and len(data) <= limit:
            try:
                block = os.read(fd, min(CHUNK, limit + 1 - len(data)))
            except OSError as exc:
                raise _fs(exc, target) from None
            if not block:
                break
            data += block
        if info.st_size > limit or len(data) > limit:
            raise PayloadTooLarge(
                f"{target.shown} is larger than the {limit} bytes sandboxkit's files API "
                "reads whole; read it through envd's GET /files (streamed), or in parts "
                "with a command"
            )
        return entry(target, info), bytes(data)
    finally:
        os.close(fd)


def _fs(exc: OSError, target: Located) -> SandboxkitError:
    return fs_error(exc, target.shown)


# -- sandboxkit's API ----------------------------------------------------------------


class WriteFile(Struct, forbid_unknown_fields=True):
    """Body of ``PUT /sandboxes/{sid}/files``."""

    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    data: bytes
    """The content, base64-encoded."""


class FileQuery(Struct):
    """Query of ``GET /sandboxes/{sid}/files`` and ``.../files/list``."""

    file: Annotated[str, Meta(max_length=4096)] | None = None
    """The path (``/home/user/...``, ``/tmp/...`` or relative to ``/home/user``); for a
    listing, default ``.``."""


class FileEntry(Struct):
    """A file or directory of a sandbox."""

    name: str
    type: str
    path: str
    size: int


class FileContent(Struct):
    """A file and its content (base64)."""

    name: str
    type: str
    path: str
    size: int
    data: bytes


class FilesApi:
    """The files routes of sandboxkit's API (listed in its route table)."""

    def __init__(self, host: Host) -> None:
        self.host = host

    async def write(self, request: Request) -> Response:
        body = decode_body(await _body(request, self.host.config.max_body), WriteFile)
        sandbox = await self.host.access(request.path_params["sid"])
        target = resolve(sandbox, body.path)
        return _json(await off_loop(target.shown, write, target, body.data), 201)

    async def read(self, request: Request) -> Response:
        query = decode_query(dict(request.query_params), FileQuery)
        sandbox = self.host.get(request.path_params["sid"])  # a read: not activity
        target = resolve(sandbox, query.file)
        info, data = await off_loop(target.shown, read, target)
        return _json({**info, "data": data})

    async def list(self, request: Request) -> Response:
        query = decode_query(dict(request.query_params), FileQuery)
        sandbox = self.host.get(request.path_params["sid"])  # a read: not activity
        target = resolve(sandbox, query.file or ".")
        return _json(await off_loop(target.shown, list_dir, target))


async def _body(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body is over {limit} bytes")
    return bytes(body)


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")
