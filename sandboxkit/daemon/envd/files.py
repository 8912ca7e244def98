"""envd's HTTP files API: ``GET /files?path=`` reads a file, ``POST /files`` writes one
(an ``application/octet-stream`` body with ``path=``, or ``multipart/form-data`` whose
parts are named by their file name, or by ``path=`` for a single part).

Paths are the sandbox's, as in :mod:`sandboxkit.daemon.sandbox_paths` (``/home/user``,
``/tmp``, relative to ``/home/user``). Content is streamed both ways in
``sandbox_paths.CHUNK`` blocks, each system call off the event loop: a file of any size
costs the daemon one block of memory. The ``username`` parameter is accepted and
ignored: sandboxkit's sandboxes run as the daemon's user. Errors are envd's: a JSON
``{"code": <status>, "message": ...}`` (404 for a missing file, 400 for a bad path).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from sandboxkit.daemon.files import entry, resolve, write_all, write_fd
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.sandbox_paths import CHUNK, Located, fs_error, off_loop
from sandboxkit.errors import InvalidArgument, SandboxkitError

__all__ = ["error_response", "read_file", "write_file"]


def error_response(exc: SandboxkitError) -> Response:
    """envd's error body for a typed error (a bad path is envd's 400)."""
    status = 400 if isinstance(exc, InvalidArgument) else exc.status
    return JSONResponse({"code": status, "message": str(exc)}, status)


async def read_file(sandbox: ManagedSandbox, request: Request) -> Response:
    target = resolve(sandbox, request.query_params.get("path"))
    fd = _Descriptor(await off_loop(target.shown, target.open_regular, os.O_RDONLY))
    body = _chunks(fd, target)
    # A response torn down before its first chunk never runs the generator's finally.
    weakref.finalize(body, fd.close)
    return StreamingResponse(body, media_type="application/octet-stream")


class _Descriptor:
    """A file descriptor closed exactly once, by whoever is first."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


async def _chunks(fd: _Descriptor, target: Located) -> AsyncIterator[bytes]:
    try:
        while fd.fd is not None and (block := await off_loop(target.shown, _read, fd.fd, target)):
            yield block
    finally:
        fd.close()


def _read(fd: int, target: Located) -> bytes:
    try:
        return os.read(fd, CHUNK)
    except OSError as exc:
        raise fs_error(exc, target.shown) from None


async def write_file(sandbox: ManagedSandbox, request: Request) -> Response:
    content_type = request.headers.get("content-type", "")
    query_path = request.query_params.get("path")
    written: list[dict[str, Any]] = []
    if content_type.startswith("multipart/form-data"):
        async with request.form(max_files=1000, max_fields=1000) as form:
            uploads = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
            if not uploads:
                raise InvalidArgument("no file in the upload", field="file")
            for upload in uploads:
                name = query_path if query_path and len(uploads) == 1 else upload.filename
                target = resolve(sandbox, name)
                fd = await off_loop(target.shown, write_fd, target)
                try:
                    while block := await upload.read(CHUNK):
                        await off_loop(target.shown, write_all, fd, block, target)
                    written.append(await off_loop(target.shown, _entry, fd, target))
                finally:
                    os.close(fd)
    else:
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise InvalidArgument("compressed uploads are not supported", field="gzip")
        target = resolve(sandbox, query_path)
        fd = await off_loop(target.shown, write_fd, target)
        try:
            async for block in request.stream():
                if block:
                    await off_loop(target.shown, write_all, fd, block, target)
            written.append(await off_loop(target.shown, _entry, fd, target))
        finally:
            os.close(fd)
    return JSONResponse(written)


def _entry(fd: int, target: Located) -> dict[str, Any]:
    return entry(target, os.fstat(fd))
