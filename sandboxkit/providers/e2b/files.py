"""``sbx.files`` of an E2B sandbox, through the SDK's ``files`` (paths relative to the
user's home)."""

from __future__ import annotations

import builtins
from typing import Literal

from e2b import NotFoundException

from sandboxkit.client.files import EntryInfo, WriteInfo
from sandboxkit.errors import FileNotFound
from sandboxkit.providers.e2b.session import E2BSession
from sandboxkit.providers.e2b.target import USER

__all__ = ["E2BFiles"]


class E2BFiles:
    """The :class:`~sandboxkit.client.backend.FilesBackend` of an E2B sandbox."""

    def __init__(self, session: E2BSession) -> None:
        self.session = session

    async def write(self, path: str, data: bytes) -> WriteInfo:
        info = await self.session.sdk.files.write(path, data, user=USER)
        return WriteInfo(
            name=info.name, type=str(getattr(info.type, "value", "file")), path=info.path
        )

    async def read(self, path: str, format: Literal["text", "bytes"]) -> str | bytes:
        files = self.session.sdk.files
        try:
            if format == "bytes":
                return bytes(await files.read(path, format="bytes", user=USER))
            return str(await files.read(path, user=USER))
        except NotFoundException as exc:
            raise FileNotFound(str(exc), path=path) from exc

    async def list(self, path: str) -> builtins.list[EntryInfo]:
        try:
            entries = await self.session.sdk.files.list(path, user=USER)
        except NotFoundException as exc:
            raise FileNotFound(str(exc), path=path) from exc
        return sorted(
            (
                EntryInfo(
                    name=e.name,
                    type=str(getattr(e.type, "value", "file")),
                    path=e.path,
                    size=e.size,
                )
                for e in entries
            ),
            key=lambda e: e.name,
        )
