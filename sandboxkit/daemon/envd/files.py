"""envd's HTTP files API: ``GET /files?path=`` reads a file, ``POST /files`` writes one
(an ``application/octet-stream`` body with ``path=``, or ``multipart/form-data`` whose
parts are named by their file name, or by ``path=`` for a single part).

Paths resolve as in :mod:`sandboxkit.daemon.files` (relative: to the sandbox's working
directory, envd's is the user's home). The ``username`` parameter is accepted and
ignored: sandboxkit's sandboxes run as the daemon's user. Errors are envd's: a JSON
``{"code": <status>, "message": ...}`` (404 for a missing file, 400 for a bad path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from sandboxkit.daemon.files import entry, resolve
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.errors import FileNotFound, InvalidArgument, SandboxkitError

__all__ = ["error_response", "read_file", "write_file"]

_COPY = 256 * 1024


def error_response(exc: SandboxkitError) -> Response:
    """envd's error body for a typed error (a bad path is envd's 400)."""
    status = 400 if isinstance(exc, InvalidArgument) else exc.status
    return JSONResponse({"code": status, "message": str(exc)}, status)


async def read_file(sandbox: ManagedSandbox, request: Request) -> Response:
    target = resolve(sandbox, request.query_params.get("path"))
    if target.is_dir():
        raise InvalidArgument(f"{target} is a directory", field="path")
    if not target.exists():
        raise FileNotFound(f"no file {target}", path=str(target))
    return FileResponse(target, media_type="application/octet-stream")


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
                target = _prepare(resolve(sandbox, name))
                with target.open("wb") as f:
                    while block := await upload.read(_COPY):
                        f.write(block)
                written.append(entry(target))
    else:
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise InvalidArgument("compressed uploads are not supported", field="gzip")
        target = _prepare(resolve(sandbox, query_path))
        with target.open("wb") as f:
            async for block in request.stream():
                f.write(block)
        written.append(entry(target))
    return JSONResponse(written)


def _prepare(target: Path) -> Path:
    if target.is_dir():
        raise InvalidArgument(f"{target} is a directory", field="path")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"cannot create {target.parent}: {exc.strerror}") from None
    return target
