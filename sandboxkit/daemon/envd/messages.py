"""envd's ``process.Process`` request messages (proto3 JSON), as msgspec structs.

Only the fields sandboxkit acts on are declared; the rest are ignored, as a proto3 JSON
parser ignores unknown fields. Bytes fields arrive base64-encoded.
"""

from __future__ import annotations

from msgspec import Struct, field

__all__ = [
    "ConnectRequest",
    "ProcessConfig",
    "ProcessInput",
    "ProcessSelector",
    "SendInputRequest",
    "SendSignalRequest",
    "StartRequest",
    "StreamInputRequest",
    "UpdateRequest",
]


class ProcessSelector(Struct):
    pid: int | None = None
    tag: str | None = None


class ProcessConfig(Struct):
    cmd: str
    args: list[str] = field(default_factory=list)
    envs: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None


class PtySize(Struct):
    cols: int = 0
    rows: int = 0


class Pty(Struct):
    size: PtySize | None = None


class StartRequest(Struct):
    process: ProcessConfig
    pty: Pty | None = None
    tag: str | None = None
    stdin: bool = False


class ConnectRequest(Struct):
    process: ProcessSelector


class UpdateRequest(Struct):
    process: ProcessSelector
    pty: Pty | None = None


class ProcessInput(Struct):
    stdin: bytes | None = None
    pty: bytes | None = None

    @property
    def data(self) -> bytes:
        return self.stdin if self.stdin is not None else (self.pty or b"")


class SendInputRequest(Struct):
    process: ProcessSelector
    input: ProcessInput | None = None


class SendSignalRequest(Struct):
    process: ProcessSelector
    signal: str | int = 0


class CloseStdinRequest(Struct):
    process: ProcessSelector


class StreamInputStart(Struct):
    process: ProcessSelector


class StreamInputData(Struct):
    input: ProcessInput | None = None


class StreamInputRequest(Struct):
    start: StreamInputStart | None = None
    data: StreamInputData | None = None
