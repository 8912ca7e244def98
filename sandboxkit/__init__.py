"""sandboxkit: local sandboxes whose process output streams never stall.

The public API, re-exported from focused modules::

    from sandboxkit import Sandbox, AsyncSandbox

    with Sandbox.create() as sbx:
        handle = sbx.commands.run("python -u worker.py", background=True, on_stdout=print)
        ...

Errors: ``docs/errors.md``. Where each concept lives: ``docs/architecture.md``.
"""

from typing import TYPE_CHECKING, Any

from sandboxkit._lazy import lazy_exports
from sandboxkit._version import __version__
from sandboxkit.errors import (
    CommandExitError,
    ConsumerKicked,
    DaemonUnavailable,
    FileNotFound,
    InvalidArgument,
    IsolationUnavailable,
    IsolationWarning,
    MalformedFrame,
    NotFound,
    OutputGap,
    OutputGapWarning,
    OutputIncomplete,
    OutputLost,
    PayloadTooLarge,
    ProcessNotFound,
    ProviderUnavailable,
    ProviderUnsupported,
    ResourceExhausted,
    ResultUnavailable,
    Retriable,
    SandboxClosed,
    SandboxkitError,
    SandboxNotFound,
    SandboxPaused,
    StdinBusy,
    StdinSeqMismatch,
    StreamInterrupted,
    StreamStalled,
    Unauthorized,
    WaitTimeout,
    WorkdirMissing,
)
from sandboxkit.results import CommandResult

if TYPE_CHECKING:
    from sandboxkit.client import (
        AsyncCommandHandle,
        AsyncSandbox,
        CommandHandle,
        Failed,
        GapInfo,
        Ok,
        Outcome,
        ProcessInfo,
        ProcessStream,
        Sandbox,
        SandboxInfo,
        StdinSession,
        attempt,
    )

# The client (httpx, pandas) loads on first use, so that the daemon process, which shares
# this package, never imports it.
_client_getattr, __dir__ = lazy_exports(
    __name__,
    dict.fromkeys(
        [
            "AsyncCommandHandle",
            "AsyncSandbox",
            "CommandHandle",
            "Failed",
            "GapInfo",
            "Ok",
            "Outcome",
            "ProcessInfo",
            "ProcessStream",
            "Sandbox",
            "SandboxInfo",
            "StdinSession",
            "attempt",
        ],
        "client",
    ),
)


def __getattr__(name: str) -> Any:
    value = _client_getattr(name)
    # The provider layer sits above the client and registers its providers with the
    # client's loader (no SDK imported): loaded with the client, so that
    # Sandbox.create(provider="e2b") finds them while the client never imports it.
    import sandboxkit.providers  # noqa: F401

    return value


__all__ = [
    "AsyncCommandHandle",
    "AsyncSandbox",
    "CommandExitError",
    "CommandHandle",
    "CommandResult",
    "ConsumerKicked",
    "DaemonUnavailable",
    "Failed",
    "FileNotFound",
    "GapInfo",
    "InvalidArgument",
    "IsolationUnavailable",
    "IsolationWarning",
    "MalformedFrame",
    "NotFound",
    "Ok",
    "Outcome",
    "OutputGap",
    "OutputGapWarning",
    "OutputIncomplete",
    "OutputLost",
    "PayloadTooLarge",
    "ProcessInfo",
    "ProcessNotFound",
    "ProcessStream",
    "ProviderUnavailable",
    "ProviderUnsupported",
    "ResourceExhausted",
    "ResultUnavailable",
    "Retriable",
    "Sandbox",
    "SandboxClosed",
    "SandboxInfo",
    "SandboxNotFound",
    "SandboxPaused",
    "SandboxkitError",
    "StdinBusy",
    "StdinSeqMismatch",
    "StdinSession",
    "StreamInterrupted",
    "StreamStalled",
    "Unauthorized",
    "WaitTimeout",
    "WorkdirMissing",
    "__version__",
    "attempt",
]
