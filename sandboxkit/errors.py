"""The one error vocabulary shared by the daemon, the wire and the client.

Every error has a wire ``code`` and an HTTP ``status``; :data:`ERROR_TABLE` maps codes to
classes so that an error raised in the daemon is re-raised in the client as the same class
with the same fields.

=====================  ======  =========================================================
class                  status  meaning
=====================  ======  =========================================================
SandboxNotFound        404     no sandbox with that id
SandboxPaused          409     the sandbox is paused and does not auto-resume
SandboxClosed          409     this client was closed (``close()``/``kill()``/``with`` exit)
ProcessNotFound        404     no process with that pid in the sandbox
ResultUnavailable      410     the process is unknown, or its result outlived the TTL
OutputGap              410     the cursor fell behind retention (bytes were evicted)
OutputIncomplete       410     a foreground command's output was not all received or kept
ConsumerKicked         409     the daemon closed a stream that made no progress
StreamStalled          504     the client saw no frame within its watchdog bound
CommandExitError       500     a foreground command exited non-zero (carries the result)
StdinSeqMismatch       409     a stdin batch arrived out of order
StdinBusy              429     the process's stdin buffer is full; retry the same batch later
MalformedFrame         400     bytes on the wire are not a valid frame or JSON body
DaemonUnavailable      503     the daemon cannot be reached or is shutting down
Unauthorized           401     missing or wrong bearer token
FileNotFound           404     no file (or directory) at that path in the sandbox
InvalidArgument        422     a well-formed request with a bad value
PayloadTooLarge        413     the request body is larger than the daemon accepts
=====================  ======  =========================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from sandboxkit.client.results import CommandResult

__all__ = [
    "ERROR_TABLE",
    "CommandExitError",
    "ConsumerKicked",
    "DaemonUnavailable",
    "FileNotFound",
    "InvalidArgument",
    "MalformedFrame",
    "OutputGap",
    "OutputGapWarning",
    "OutputIncomplete",
    "PayloadTooLarge",
    "ProcessNotFound",
    "ResultUnavailable",
    "SandboxClosed",
    "SandboxNotFound",
    "SandboxPaused",
    "SandboxkitError",
    "StdinBusy",
    "StdinSeqMismatch",
    "StreamStalled",
    "Unauthorized",
    "error_from_wire",
]


class SandboxkitError(Exception):
    """Base class of every sandboxkit error.

    ``details`` holds the error's fields; each subclass also exposes them as attributes.
    """

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500
    fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str = "", **details: Any) -> None:
        unknown = set(details) - set(self.fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(unknown)}")
        self.message = message or type(self).__name__
        self.details: dict[str, Any] = {name: details.get(name) for name in self.fields}
        for name, value in self.details.items():
            setattr(self, name, value)
        super().__init__(self.message)

    def to_wire(self) -> dict[str, Any]:
        """The JSON body that carries this error over HTTP or in an ``error`` frame."""
        details = {k: v for k, v in self.details.items() if _jsonable(v)}
        return {"code": self.code, "message": self.message, "details": details}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.details.items() if v is not None)
        return f"{type(self).__name__}({self.message!r}{', ' if fields else ''}{fields})"


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))


class SandboxNotFound(SandboxkitError):
    """No sandbox with that id."""

    code = "sandbox_not_found"
    status = 404
    fields = ("sandbox_id",)
    sandbox_id: str | None


class SandboxPaused(SandboxkitError):
    """The sandbox is paused and ``auto_resume`` is off."""

    code = "sandbox_paused"
    status = 409
    fields = ("sandbox_id",)
    sandbox_id: str | None


class SandboxClosed(SandboxkitError):
    """This client object was closed — by ``close()`` (the sandbox keeps running; reattach
    with ``Sandbox.connect(sandbox_id)``), or by ``kill()`` or leaving its ``with`` block
    (the sandbox is gone). Raised by the client itself; no request is sent."""

    code = "sandbox_closed"
    status = 409
    fields = ("sandbox_id", "reason")
    sandbox_id: str | None
    reason: str | None


class ProcessNotFound(SandboxkitError):
    """No process with that pid in the sandbox."""

    code = "process_not_found"
    status = 404
    fields = ("sandbox_id", "pid")
    sandbox_id: str | None
    pid: int | None


class ResultUnavailable(SandboxkitError):
    """The process is unknown, or it exited and its result outlived the result TTL."""

    code = "result_unavailable"
    status = 410
    fields = ("sandbox_id", "pid", "reason")
    sandbox_id: str | None
    pid: int | None
    reason: str | None


class OutputGap(SandboxkitError):
    """Output between ``cursor`` and ``first_available`` was evicted before it was read."""

    code = "output_gap"
    status = 410
    fields = ("pid", "cursor", "first_available", "bytes_lost")
    pid: int | None
    cursor: int | None
    first_available: int | None
    bytes_lost: int | None


class OutputIncomplete(SandboxkitError):
    """A foreground command finished but its result is not its whole output:
    ``bytes_lost`` bytes were evicted by the daemon before they were read (gaps) or
    dropped beyond ``keep_output``; ``result`` has what was kept (a marker where a gap
    was)."""

    code = "output_incomplete"
    status = 410
    fields = ("pid", "exit_code", "bytes_lost", "result")
    pid: int | None
    exit_code: int | None
    bytes_lost: int | None
    result: CommandResult | None


class OutputGapWarning(UserWarning):
    """Output was evicted before a stream read it, and nobody passed ``on_gap=`` to handle
    it; the handle's ``stdout`` shows a marker where the bytes are missing."""


class ConsumerKicked(SandboxkitError):
    """The daemon closed this stream because its transport made no progress."""

    code = "consumer_kicked"
    status = 409
    fields = ("pid", "cursor", "blocked_for", "reason")
    pid: int | None
    cursor: int | None
    blocked_for: float | None
    reason: str | None


class StreamStalled(SandboxkitError):
    """The client received no frame within its watchdog bound and gave up reattaching."""

    code = "stream_stalled"
    status = 504
    fields = ("pid", "cursor", "silence")
    pid: int | None
    cursor: int | None
    silence: float | None


class CommandExitError(SandboxkitError):
    """A foreground command exited with a non-zero code; ``result`` has its output."""

    code = "command_exit"
    status = 500
    fields = ("pid", "exit_code", "result")
    pid: int | None
    exit_code: int | None
    result: CommandResult | None


class StdinSeqMismatch(SandboxkitError):
    """A stdin batch was refused: the daemon expects batch ``expected`` next."""

    code = "stdin_seq_mismatch"
    status = 409
    fields = ("pid", "expected", "got")
    pid: int | None
    expected: int | None
    got: int | None


class StdinBusy(SandboxkitError):
    """The process is not reading its stdin and ``buffered`` bytes already wait (the limit
    is ``limit``): nothing was written. Retryable: send the same batch again later."""

    code = "stdin_busy"
    status = 429
    fields = ("pid", "buffered", "limit")
    pid: int | None
    buffered: int | None
    limit: int | None


class MalformedFrame(SandboxkitError):
    """Bytes that are not a valid frame, or a request body that is not valid JSON."""

    code = "malformed_frame"
    status = 400


class DaemonUnavailable(SandboxkitError):
    """The daemon cannot be reached, or it is shutting down."""

    code = "daemon_unavailable"
    status = 503
    fields = ("url",)
    url: str | None


class Unauthorized(SandboxkitError):
    """Missing or wrong bearer token."""

    code = "unauthorized"
    status = 401


class FileNotFound(SandboxkitError):
    """No file (or directory) at that path in the sandbox."""

    code = "file_not_found"
    status = 404
    fields = ("path",)
    path: str | None


class InvalidArgument(SandboxkitError):
    """A well-formed request with a value the daemon cannot accept."""

    code = "invalid_argument"
    status = 422
    fields = ("field",)
    field: str | None


class PayloadTooLarge(SandboxkitError):
    """The request body is larger than the daemon's limit (``DaemonConfig.max_body``)."""

    code = "payload_too_large"
    status = 413


ERROR_TABLE: dict[str, type[SandboxkitError]] = {
    cls.code: cls
    for cls in (
        SandboxNotFound,
        SandboxPaused,
        SandboxClosed,
        ProcessNotFound,
        ResultUnavailable,
        OutputGap,
        OutputIncomplete,
        ConsumerKicked,
        StreamStalled,
        CommandExitError,
        StdinSeqMismatch,
        StdinBusy,
        MalformedFrame,
        DaemonUnavailable,
        Unauthorized,
        FileNotFound,
        InvalidArgument,
        PayloadTooLarge,
    )
}


def error_from_wire(body: Any, status: int | None = None) -> SandboxkitError:
    """Rebuild the typed error from a wire body ``{"code", "message", "details"}``."""
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        cls = ERROR_TABLE.get(body["code"], SandboxkitError)
        raw = body.get("details")
        details = raw if isinstance(raw, dict) else {}
        known = {k: v for k, v in details.items() if k in cls.fields}
        return cls(str(body.get("message", "")), **known)
    return SandboxkitError(f"unexpected error response (HTTP {status}): {body!r}"[:500])
