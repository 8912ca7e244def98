"""``sbx.files``: put files into a sandbox and read them back, shaped like E2B's
``sandbox.files`` (``write``, ``read``, ``list``).

Paths are the sandbox's, as in E2B: ``/home/user/...`` is its working directory (where
its commands start), ``/tmp/...`` its private temporary directory, and a relative path is
relative to ``/home/user`` — so ``sbx.files.write("worker.py", code)`` then
``sbx.commands.run("python worker.py")`` runs it. A path anywhere else raises
InvalidArgument; a file name that is not UTF-8 is listed with its undecodable bytes as
``\\xNN`` (and a backslash as ``\\\\``), and reads back by that name. Content travels
base64-encoded in JSON, within the daemon's request size limit (``DaemonConfig.max_body``,
4 MiB by default) and its whole-file read limit (16 MiB): for scripts and results, not
data sets.
"""

from __future__ import annotations

import base64
import builtins
from dataclasses import dataclass
from typing import Any, Literal, overload

from sandboxkit.client.api import ApiClient
from sandboxkit.client.loop_thread import LoopThread
from sandboxkit.errors import InvalidArgument

__all__ = ["AsyncFiles", "EntryInfo", "Files", "WriteInfo"]


@dataclass(frozen=True)
class WriteInfo:
    """A file that was written: its ``name``, ``type`` (``file``) and full ``path``."""

    name: str
    type: str
    path: str


@dataclass(frozen=True)
class EntryInfo(WriteInfo):
    """A directory entry: ``type`` is ``file`` or ``dir``; ``size`` in bytes."""

    size: int


def _entry(raw: dict[str, Any]) -> EntryInfo:
    return EntryInfo(name=raw["name"], type=raw["type"], path=raw["path"], size=raw["size"])


class AsyncFiles:
    """The files of one sandbox (async)."""

    def __init__(self, api: ApiClient, sandbox_id: str) -> None:
        self._api = api
        self._path = f"/sandboxes/{sandbox_id}/files"

    async def write(self, path: str, data: str | bytes) -> WriteInfo:
        """Write ``data`` (``str`` as UTF-8, or bytes-like) to ``path``, creating parent
        directories. InvalidArgument (``field="data"``) for anything else."""
        if isinstance(data, str):
            raw = data.encode()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        else:
            raise InvalidArgument(
                f"data must be str or bytes, not {type(data).__name__} (writing {path})",
                field="data",
                path=path,
            )
        body = {"path": path, "data": base64.b64encode(raw).decode()}
        info = await self._api.call("PUT", self._path, json=body)
        return WriteInfo(name=info["name"], type=info["type"], path=info["path"])

    @overload
    async def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    async def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    async def read(self, path: str, format: Literal["text", "bytes"] = "text") -> str | bytes:
        """The content of ``path``: ``str`` (UTF-8, undecodable bytes replaced) or
        ``bytes``. Raises FileNotFound if there is no such file, PayloadTooLarge for a file
        over the daemon's whole-file limit (16 MiB, ``docs/protocol.md``)."""
        info = await self._api.call("GET", self._path, file=path)
        data = base64.b64decode(info["data"])
        return data if format == "bytes" else data.decode("utf-8", errors="replace")

    async def list(self, path: str = ".") -> builtins.list[EntryInfo]:
        """The entries of directory ``path`` (default: the working directory), by name."""
        entries = await self._api.call("GET", f"{self._path}/list", file=path)
        return [_entry(e) for e in entries]


class Files:
    """Sync view of :class:`AsyncFiles`."""

    def __init__(self, files: AsyncFiles, loop: LoopThread) -> None:
        self._files = files
        self._loop = loop

    def write(self, path: str, data: str | bytes) -> WriteInfo:
        """See :meth:`AsyncFiles.write`."""
        return self._loop.run(self._files.write(path, data))

    @overload
    def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    def read(self, path: str, format: Literal["text", "bytes"] = "text") -> str | bytes:
        """See :meth:`AsyncFiles.read`."""
        if format == "bytes":
            return self._loop.run(self._files.read(path, "bytes"))
        return self._loop.run(self._files.read(path))

    def list(self, path: str = ".") -> builtins.list[EntryInfo]:
        """See :meth:`AsyncFiles.list`."""
        return self._loop.run(self._files.list(path))
