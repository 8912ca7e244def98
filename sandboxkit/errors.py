"""The one error vocabulary shared by the daemon, the wire and the client.

Every error is a :class:`SandboxkitError` with a wire ``code`` and an HTTP ``status``;
:data:`ERROR_TABLE` maps codes to classes, so an error raised in the daemon is re-raised in
the client as the same class with the same fields. The table of codes, classes, statuses
and who raises each is ``docs/errors.md`` (a test holds it to this module).

Catch a category rather than listing classes. The tree (a class under two parents is
shown under both)::

    SandboxkitError
        NotFound
            SandboxNotFound
            ProcessNotFound
            ResultUnavailable
            FileNotFound
        StreamInterrupted
            ConsumerKicked
            StreamStalled
            DaemonUnavailable
            MalformedFrame
        Retriable
            ConsumerKicked
            StreamStalled
            DaemonUnavailable
            StdinBusy
            ResourceExhausted
        OutputLost
            OutputGap
            OutputIncomplete
        SandboxPaused
        SandboxClosed
        CommandExitError
        StdinSeqMismatch
        Unauthorized
        InvalidArgument
        PayloadTooLarge
        IsolationUnavailable
        WorkdirMissing
        WaitTimeout
        ProviderUnavailable
        ProviderUnsupported
    TimeoutError
        WaitTimeout

``NotFound``: what the request names is not there (or no longer). ``StreamInterrupted``:
an output stream stopped before its end frame; the process may well run on.
``Retriable``: the same call may succeed later, unchanged (a stream reattaches from its
cursor, a stdin session resends its batch). ``OutputLost``: output was evicted or dropped
before it was read.

Errors whose ``origin`` is ``"client"`` are raised by the client itself and never sent by
the daemon (:data:`DAEMON_ERROR_TABLE` is what the daemon's OpenAPI document lists).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from sandboxkit.results import CommandResult

__all__ = [
    "DAEMON_ERROR_TABLE",
    "ERROR_TABLE",
    "CommandExitError",
    "ConsumerKicked",
    "DaemonUnavailable",
    "FileNotFound",
    "InvalidArgument",
    "IsolationUnavailable",
    "IsolationWarning",
    "MalformedFrame",
    "NotFound",
    "OutputGap",
    "OutputGapWarning",
    "OutputIncomplete",
    "OutputLost",
    "PayloadTooLarge",
    "ProcessNotFound",
    "ProviderUnavailable",
    "ProviderUnsupported",
    "ResourceExhausted",
    "ResultUnavailable",
    "Retriable",
    "SandboxClosed",
    "SandboxNotFound",
    "SandboxPaused",
    "SandboxkitError",
    "StdinBusy",
    "StdinSeqMismatch",
    "StreamInterrupted",
    "StreamStalled",
    "Unauthorized",
    "WaitTimeout",
    "WorkdirMissing",
    "error_from_wire",
]


class SandboxkitError(Exception):
    """Base class of every sandboxkit error.

    ``details`` holds the error's fields; each subclass also exposes them as attributes.
    """

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500
    fields: ClassVar[tuple[str, ...]] = ()
    origin: ClassVar[Literal["daemon", "client"]] = "daemon"
    """``client``: raised by the client itself, never sent by the daemon."""

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


# -- categories: catch these; they have no wire code of their own --------------------


class NotFound(SandboxkitError):
    """What the request names is not there, or no longer: a sandbox, a process, its
    result or a file."""


class StreamInterrupted(SandboxkitError):
    """An output stream stopped before its end frame: kicked, silent, cut off or garbled.
    The process is not affected."""


class Retriable(SandboxkitError):
    """The same call may succeed if made again later, unchanged."""


class OutputLost(SandboxkitError):
    """Output was evicted or dropped before it was read."""


# -- the errors ----------------------------------------------------------------------


class SandboxNotFound(NotFound):
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
    origin = "client"
    status = 409
    fields = ("sandbox_id", "reason")
    sandbox_id: str | None
    reason: str | None


class ProcessNotFound(NotFound):
    """No process with that pid in the sandbox."""

    code = "process_not_found"
    status = 404
    fields = ("sandbox_id", "pid")
    sandbox_id: str | None
    pid: int | None


class ResultUnavailable(NotFound):
    """The process is unknown, or it exited and its result outlived the result TTL."""

    code = "result_unavailable"
    status = 410
    fields = ("sandbox_id", "pid", "reason")
    sandbox_id: str | None
    pid: int | None
    reason: str | None


class OutputGap(OutputLost):
    """Output between ``cursor`` and ``first_available`` was evicted before it was read."""

    code = "output_gap"
    origin = "client"
    status = 410
    fields = ("pid", "cursor", "first_available", "bytes_lost")
    pid: int | None
    cursor: int | None
    first_available: int | None
    bytes_lost: int | None


class OutputIncomplete(OutputLost):
    """A foreground command finished but its result is not its whole output:
    ``bytes_lost`` bytes were evicted by the daemon before they were read (gaps) or
    dropped beyond ``keep_output``; ``result`` has what was kept (a marker where a gap
    was)."""

    code = "output_incomplete"
    origin = "client"
    status = 410
    fields = ("pid", "exit_code", "bytes_lost", "result")
    pid: int | None
    exit_code: int | None
    bytes_lost: int | None
    result: CommandResult | None


class OutputGapWarning(UserWarning):
    """Output was evicted before a stream read it, and nobody passed ``on_gap=`` to handle
    it; the handle's ``stdout`` shows a marker where the bytes are missing."""


class IsolationWarning(UserWarning):
    """Sandboxes were asked for with ``isolation="auto"`` on a daemon whose host cannot
    give them namespaces: they run without isolation (warned once per process)."""


class ConsumerKicked(StreamInterrupted, Retriable):
    """The daemon closed this stream because its transport made no progress."""

    code = "consumer_kicked"
    status = 409
    fields = ("pid", "cursor", "blocked_for", "reason")
    pid: int | None
    cursor: int | None
    blocked_for: float | None
    reason: str | None


class StreamStalled(StreamInterrupted, Retriable):
    """The client received no frame within its watchdog bound and gave up reattaching."""

    code = "stream_stalled"
    origin = "client"
    status = 504
    fields = ("pid", "cursor", "silence")
    pid: int | None
    cursor: int | None
    silence: float | None


class CommandExitError(SandboxkitError):
    """A foreground command exited with a non-zero code; ``result`` has its output."""

    code = "command_exit"
    origin = "client"
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


class StdinBusy(Retriable):
    """Nothing was written, for one of two reasons: the process is not reading its stdin
    and ``buffered`` bytes already wait (the limit is ``limit`` bytes); or a new session
    found ``sessions`` stdin sessions of the process all in use (the limit is ``limit``
    sessions). Retryable: send the same batch again later."""

    code = "stdin_busy"
    status = 429
    fields = ("pid", "buffered", "limit", "sessions")
    pid: int | None
    buffered: int | None
    limit: int | None
    sessions: int | None


class ResourceExhausted(Retriable):
    """The daemon is out of ``resource`` (``file_descriptors``, ``connections``) up to its
    ``limit``, or a sandbox's ``launcher`` did not answer: nothing was done. Retryable once
    other processes or connections end (a sandbox's next command starts a new launcher)."""

    code = "resource_exhausted"
    status = 503
    fields = ("resource", "limit")
    resource: str | None
    limit: int | None


class MalformedFrame(StreamInterrupted):
    """Bytes that are not a valid frame, or a request body that is not valid JSON."""

    code = "malformed_frame"
    status = 400


class DaemonUnavailable(StreamInterrupted, Retriable):
    """The daemon cannot be reached, or a connection to it broke (a stream reattaches by
    itself; what reaches you is what it gave up on)."""

    code = "daemon_unavailable"
    origin = "client"
    status = 503
    fields = ("url",)
    url: str | None


class Unauthorized(SandboxkitError):
    """Missing or wrong bearer token."""

    code = "unauthorized"
    status = 401


class FileNotFound(NotFound):
    """No file (or directory) at that path in the sandbox."""

    code = "file_not_found"
    status = 404
    fields = ("path",)
    path: str | None


class InvalidArgument(SandboxkitError):
    """A well-formed request with a value the daemon cannot accept: ``field`` names it;
    for a file, ``path`` is the file and ``reason`` why (an errno name such as
    ``ENAMETOOLONG`` or ``ELOOP``, or ``outside``, ``not_regular``, ``deadline``)."""

    code = "invalid_argument"
    status = 422
    fields = ("field", "path", "reason")
    field: str | None
    path: str | None
    reason: str | None


class PayloadTooLarge(SandboxkitError):
    """The request body is larger than the daemon's limit (``DaemonConfig.max_body``), or
    a file to be read whole is larger than the files API's (``MAX_READ``, in
    ``docs/protocol.md``)."""

    code = "payload_too_large"
    status = 413


class IsolationUnavailable(SandboxkitError):
    """``isolation="namespaces"`` was asked for on a host where namespaces cannot be had
    (no bubblewrap, user namespaces disabled); ``missing`` names what is missing. Nothing
    was created. ``isolation="auto"`` falls back to ``"none"`` instead, and says so."""

    code = "isolation_unavailable"
    status = 501
    fields = ("missing",)
    missing: str | None


class WorkdirMissing(SandboxkitError):
    """A directory the daemon made is gone, removed from outside the daemon (a cleanup of
    the temp directory, another program): ``path`` is the daemon's root (then nothing can
    be created until the daemon restarts) or a sandbox's working directory (``sandbox_id``;
    that sandbox can run nothing more)."""

    code = "workdir_missing"
    status = 410
    fields = ("path", "sandbox_id")
    path: str | None
    sandbox_id: str | None


class WaitTimeout(SandboxkitError, TimeoutError):
    """``wait(timeout=)`` gave up after ``timeout`` seconds; the process runs on and the
    handle keeps following it, so ``wait`` again later. Also a builtin ``TimeoutError``,
    so code that caught that still does."""

    code = "wait_timeout"
    origin = "client"
    status = 504
    fields = ("pid", "timeout")
    pid: int | None
    timeout: float | None


class ProviderUnavailable(SandboxkitError):
    """``create(provider=...)`` names no known provider, or the provider's SDK is not
    installed (the message names the ``pip install``)."""

    code = "provider_unavailable"
    status = 400
    origin = "client"
    fields = ("provider",)
    provider: str | None


class ProviderUnsupported(SandboxkitError):
    """The provider cannot do this (e.g. pause in E2B's debug mode, which has no control
    plane, or a ``create()`` option it has no equivalent of); nothing was changed."""

    code = "provider_unsupported"
    status = 501
    origin = "client"
    fields = ("provider", "operation")
    provider: str | None
    operation: str | None


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
        ResourceExhausted,
        MalformedFrame,
        DaemonUnavailable,
        Unauthorized,
        FileNotFound,
        InvalidArgument,
        PayloadTooLarge,
        IsolationUnavailable,
        WorkdirMissing,
        WaitTimeout,
        ProviderUnavailable,
        ProviderUnsupported,
    )
}


DAEMON_ERROR_TABLE: dict[str, type[SandboxkitError]] = {
    code: cls for code, cls in ERROR_TABLE.items() if cls.origin == "daemon"
}
"""The errors the daemon answers with (its OpenAPI document lists only these)."""


def error_from_wire(body: Any, status: int | None = None) -> SandboxkitError:
    """Rebuild the typed error from a wire body ``{"code", "message", "details"}``."""
    if isinstance(body, dict) and isinstance(body.get("code"), str):
        cls = ERROR_TABLE.get(body["code"], SandboxkitError)
        raw = body.get("details")
        details = raw if isinstance(raw, dict) else {}
        known = {k: v for k, v in details.items() if k in cls.fields}
        return cls(str(body.get("message", "")), **known)
    return SandboxkitError(f"unexpected error response (HTTP {status}): {body!r}"[:500])
