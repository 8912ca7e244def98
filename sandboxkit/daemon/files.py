"""Files in a sandbox: put a script in, read a result out (E2B's ``sandbox.files``).

A path is relative to the sandbox's working directory, or absolute inside it: the files
API reaches only the sandbox's own directory (its processes, unlike in an E2B VM, share
this machine, so the API is kept to the one directory that is the sandbox's). Served two
ways: sandboxkit's own API (:class:`FilesApi`, JSON with base64 content, behind the
bearer token) and envd's ``/files`` (:mod:`sandboxkit.daemon.envd.files`, raw bytes, for
the e2b SDK).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from sandboxkit.daemon.host import Host
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.schema import decode_body, decode_query
from sandboxkit.errors import FileNotFound, InvalidArgument, PayloadTooLarge

__all__ = ["FileContent", "FileEntry", "FileQuery", "FilesApi", "WriteFile", "entry", "resolve"]


def resolve(sandbox: ManagedSandbox, path: str | None) -> Path:
    """The file ``path`` names in ``sandbox``: relative to its working directory, or
    absolute inside it. InvalidArgument for no path, or one that leads outside (``..``,
    or a symlink out): the files API reaches only the sandbox's own directory."""
    if not path or not isinstance(path, str):
        raise InvalidArgument("path is required", field="path")
    if "\x00" in path:
        raise InvalidArgument("path must not contain NUL", field="path")
    root = Path(sandbox.workdir).resolve()
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        raise InvalidArgument(f"{path} is outside the sandbox's directory {root}", field="path")
    return target


def entry(path: Path) -> dict[str, Any]:
    """A file's description, E2B-shaped: ``name``, ``type`` (file/dir), ``path``,
    ``size``."""
    kind = "dir" if path.is_dir() else "file"
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return {"name": path.name, "type": kind, "path": str(path), "size": size}


def list_dir(target: Path) -> list[dict[str, Any]]:
    """The entries of a directory, sorted by name; FileNotFound if it is not one."""
    if not target.is_dir():
        raise FileNotFound(f"no directory {target}", path=str(target))
    return [entry(p) for p in sorted(target.iterdir(), key=lambda p: p.name)]


def write(target: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``target`` (creating its parents); its entry."""
    if target.is_dir():
        raise InvalidArgument(f"{target} is a directory", field="path")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    except OSError as exc:
        raise InvalidArgument(f"cannot write {target}: {exc.strerror}", field="path") from None
    return entry(target)


def read(target: Path) -> bytes:
    """The bytes of ``target``; FileNotFound if it is missing, InvalidArgument if it is a
    directory."""
    if target.is_dir():
        raise InvalidArgument(f"{target} is a directory", field="path")
    try:
        return target.read_bytes()
    except FileNotFoundError:
        raise FileNotFound(f"no file {target}", path=str(target)) from None
    except OSError as exc:
        raise InvalidArgument(f"cannot read {target}: {exc.strerror}", field="path") from None


# -- sandboxkit's API ----------------------------------------------------------------


class WriteFile(Struct, forbid_unknown_fields=True):
    """Body of ``PUT /sandboxes/{sid}/files``."""

    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    data: bytes
    """The content, base64-encoded."""


class FileQuery(Struct):
    """Query of ``GET /sandboxes/{sid}/files`` and ``.../files/list``."""

    file: Annotated[str, Meta(max_length=4096)] | None = None
    """The path (relative to the sandbox's directory); for a listing, default ``.``."""


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
        return _json(write(resolve(sandbox, body.path), body.data), 201)

    async def read(self, request: Request) -> Response:
        query = decode_query(dict(request.query_params), FileQuery)
        sandbox = self.host.get(request.path_params["sid"])  # a read: not activity
        target = resolve(sandbox, query.file)
        return _json({**entry(target), "data": read(target)})

    async def list(self, request: Request) -> Response:
        query = decode_query(dict(request.query_params), FileQuery)
        sandbox = self.host.get(request.path_params["sid"])  # a read: not activity
        return _json(list_dir(resolve(sandbox, query.file or ".")))


async def _body(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body is over {limit} bytes")
    return bytes(body)


def _json(value: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(value), status, media_type="application/json")
