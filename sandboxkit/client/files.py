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

import builtins
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

from sandboxkit.client.loop_thread import LoopThread
from sandboxkit.errors import InvalidArgument

if TYPE_CHECKING:
    from sandboxkit.client.backend import FilesBackend

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


class AsyncFiles:
    """The files of one sandbox (async), through its backend
    (:class:`~sandboxkit.client.backend.FilesBackend`)."""

    def __init__(self, backend: FilesBackend) -> None:
        self._backend = backend

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
        return await self._backend.write(path, raw)

    @overload
    async def read(self, path: str, format: Literal["text"] = "text") -> str: ...

    @overload
    async def read(self, path: str, format: Literal["bytes"]) -> bytes: ...

    async def read(self, path: str, format: Literal["text", "bytes"] = "text") -> str | bytes:
        """The content of ``path``: ``str`` (UTF-8, undecodable bytes replaced) or
        ``bytes``. Raises FileNotFound if there is no such file, PayloadTooLarge for a file
        over the daemon's whole-file limit (16 MiB, ``docs/protocol.md``)."""
        return await self._backend.read(path, format)

    async def list(self, path: str = ".") -> builtins.list[EntryInfo]:
        """The entries of directory ``path`` (default: the working directory), by name."""
        return await self._backend.list(path)


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
