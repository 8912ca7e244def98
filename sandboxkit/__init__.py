"""sandboxkit: local sandboxes whose process output streams never stall.

The public API, re-exported from focused modules::

    from sandboxkit import Sandbox, AsyncSandbox

    with Sandbox.create() as sbx:
        handle = sbx.commands.run("python -u worker.py", background=True, on_stdout=print)
        ...
"""

from typing import TYPE_CHECKING, Any

from sandboxkit._version import __version__
from sandboxkit.errors import (
    CommandExitError,
    ConsumerKicked,
    DaemonUnavailable,
    InvalidArgument,
    MalformedFrame,
    OutputGap,
    OutputGapWarning,
    OutputIncomplete,
    ProcessNotFound,
    ResultUnavailable,
    SandboxClosed,
    SandboxkitError,
    SandboxNotFound,
    SandboxPaused,
    StdinSeqMismatch,
    StreamStalled,
    Unauthorized,
)

if TYPE_CHECKING:
    from sandboxkit.client import (
        AsyncCommandHandle,
        AsyncSandbox,
        CommandHandle,
        CommandResult,
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
_CLIENT_NAMES = frozenset(
    {
        "AsyncCommandHandle",
        "AsyncSandbox",
        "CommandHandle",
        "CommandResult",
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
    }
)


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        import sandboxkit.client

        return getattr(sandboxkit.client, name)
    raise AttributeError(f"module 'sandboxkit' has no attribute {name!r}")


__all__ = [
    "AsyncCommandHandle",
    "AsyncSandbox",
    "CommandExitError",
    "CommandHandle",
    "CommandResult",
    "ConsumerKicked",
    "DaemonUnavailable",
    "Failed",
    "GapInfo",
    "InvalidArgument",
    "MalformedFrame",
    "Ok",
    "Outcome",
    "OutputGap",
    "OutputGapWarning",
    "OutputIncomplete",
    "ProcessInfo",
    "ProcessNotFound",
    "ProcessStream",
    "ResultUnavailable",
    "Sandbox",
    "SandboxClosed",
    "SandboxInfo",
    "SandboxNotFound",
    "SandboxPaused",
    "SandboxkitError",
    "StdinSeqMismatch",
    "StdinSession",
    "StreamStalled",
    "Unauthorized",
    "__version__",
    "attempt",
]
