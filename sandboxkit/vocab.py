"""The words the daemon, the client and the widgets share, each defined once.

What a sandbox and a process are described as (:class:`SandboxInfo`, :class:`ProcessInfo`:
the daemon's response models, from which its OpenAPI document is generated, and the very
structs the client decodes its answers into, with ``msgspec.convert``); the states of a
sandbox, a process and a consumer, what each consumer state means and the colour it is
drawn in; the consumer roles; how soon a consumer counts as blocked or starved; the
defaults both sides assume (a sandbox's idle timeout, envd's port).

It sits at the bottom layer, beside :mod:`sandboxkit.wire`: it imports no daemon, client or
widget code, so all of them can import it. ``tests/test_vocab.py`` finds none of these
defined a second time anywhere in the package.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import msgspec
from msgspec import Struct

from sandboxkit.lab_options import FanoutPolicy, LabOptions

__all__ = [
    "BLOCKED_AFTER",
    "CONSUMER_STATES",
    "DEFAULT_ROLE",
    "DEFAULT_SANDBOX_TIMEOUT",
    "ENVD_PORT",
    "ENVD_ROLE",
    "FINAL_CONSUMER_STATES",
    "GHOST_ROLE",
    "PANEL_ROLE",
    "ROLE_PATTERN",
    "ROLE_TEXT",
    "STARVED_AFTER",
    "STATE_COLORS",
    "ConsumerState",
    "Fanout",
    "LimitEnforcement",
    "LogStorage",
    "OnTimeout",
    "ProcessInfo",
    "ProcessSpecInfo",
    "ProcessState",
    "SandboxInfo",
    "SandboxState",
]

# -- defaults ------------------------------------------------------------------------------

ENVD_PORT = 49983
"""envd's port: the e2b SDK in debug mode connects to ``localhost:49983`` by default, and
``sandboxkit serve --envd`` listens there unless told otherwise."""

DEFAULT_SANDBOX_TIMEOUT = 300.0
"""Seconds a sandbox lives unused (no request, no attached stream) when its creator names
no timeout: E2B's default, for the Python client and for the e2b SDK's control plane."""

# -- sandboxes and processes ---------------------------------------------------------------

SandboxState = Literal["running", "paused", "killed"]
OnTimeout = Literal["pause", "kill"]
"""What an idle timeout does to a sandbox."""
ProcessState = Literal["running", "paused", "exited"]
LogStorage = Literal["disk", "memory"]
"""Where a process's output log is kept (``sandboxkit/daemon/output_log.py``)."""
LimitEnforcement = Literal["cgroup", "cgroup-v1", "rlimit", "none"]

Fanout = FanoutPolicy | Literal["e2b"]
"""How output reaches a sandbox's consumers: a fan-out policy of the daemon
(:mod:`sandboxkit.lab_options`), or ``e2b`` for a sandbox of the E2B provider (whose
output reaches only this client's readers)."""

# -- consumers -----------------------------------------------------------------------------

ConsumerState = Literal["streaming", "blocked", "starved", "kicked", "closed"]

CONSUMER_STATES: dict[str, str] = {
    "streaming": "attached and keeping up: its sends complete, or there is nothing to send",
    "blocked": "its transport takes no more bytes: its own send has not completed for a "
    "while, or its peer's receive window has stayed full (a stopped or frozen client), even "
    "if the server's buffers still take its sends",
    "starved": "output it has not received has been waiting for a while, yet it is not "
    "sending: something else holds its data back (under the lab's blocking and kick "
    "policies, the shared loop stuck on another consumer)",
    "kicked": "closed by the daemon because it made no progress; its lag is frozen at the kick",
    "closed": "detached (the client left or the output ended); its lag is frozen at close",
}
"""Every consumer state and what it means (documented in the OpenAPI document too)."""

FINAL_CONSUMER_STATES: frozenset[str] = frozenset({"kicked", "closed"})
"""The states a consumer ends in: its lag and head are frozen from then on."""

STATE_COLORS: dict[str, str] = {
    "streaming": "#2ca02c",
    "starved": "#e6ab02",
    "blocked": "#ff7f0e",
    "kicked": "#d62728",
    "closed": "#9e9e9e",
}
"""The colour each consumer state is drawn in: the charts' badges and state strips, in the
figure and in the browser (``charts.js`` gets them from the chart's widget)."""

BLOCKED_AFTER = 0.2
"""A send that has not completed after this many seconds shows the consumer as blocked."""

STARVED_AFTER = 0.2
"""Output pending this many seconds while the consumer is not sending shows it as starved
(the daemon's measure; a chart infers the same from lag that grows without progress)."""

DEFAULT_ROLE = "sdk"
"""The role of a consumer whose client did not name one (a command handle's stream)."""

PANEL_ROLE = "panel"
"""The role of a :class:`~sandboxkit.notebook.ProcessPanel`'s stream."""

GHOST_ROLE = "ghost"
"""The role of the fault lab's ghost readers (``sandboxkit/lab/ghosts.py``)."""

ENVD_ROLE = "e2b"
"""The role of the envd endpoint's streams (the e2b SDK's readers)."""

ROLE_PATTERN = re.compile(r"[a-z0-9_-]{1,32}")
"""A role is a short label the client chooses (``panel``, ``sdk``, ``chart``, ...)."""

ROLE_TEXT: dict[str, str] = {
    PANEL_ROLE: "panel",
    DEFAULT_ROLE: "notebook handle",
    GHOST_ROLE: "ghost",
}
"""How a chart labels a role (any other role: by its name)."""

# -- what the daemon describes --------------------------------------------------------------
#
# The daemon sends every field. A struct built elsewhere (the E2B provider describes its
# sandboxes with these too) may leave out what it cannot know: those fields have defaults,
# the daemon's own values where it has one (``fanout``, ``isolation``) and "unknown"
# (``None``, zero) otherwise.


class _Described(Struct, frozen=True, kw_only=True, dict=True):
    """Decoded from the daemon's JSON; keeps that JSON as :attr:`raw`."""

    @property
    def raw(self) -> dict[str, Any]:
        """The JSON as received (fields this version does not know included); for a struct
        built in Python, its fields as JSON values."""
        kept: dict[str, Any] | None = self.__dict__.get("_raw")
        return kept if kept is not None else msgspec.to_builtins(self)

    def keep_raw(self, raw: dict[str, Any]) -> None:
        """Remember ``raw`` as what this struct was decoded from (see :attr:`raw`)."""
        self.__dict__["_raw"] = raw

    @classmethod
    def from_json(cls: type[_D], data: dict[str, Any]) -> _D:
        """Decode the daemon's JSON with this struct (kept as :attr:`raw`): a
        :class:`msgspec.ValidationError` if it is not what the daemon sends."""
        info = msgspec.convert(data, cls)
        info.keep_raw(data)
        return info


_D = TypeVar("_D", bound=_Described)


class ProcessSpecInfo(Struct, frozen=True, kw_only=True):
    """What a process was started with."""

    cmd: str | None = None
    argv: list[str] | None = None
    cwd: str | None = None
    envs: dict[str, str] = {}
    pty: bool = False
    timeout: float | None = None
    tag: str | None = None


class ProcessInfo(_Described, frozen=True, kw_only=True):
    """A process as the daemon describes it."""

    pid: int
    sandbox_id: str
    spec: ProcessSpecInfo = ProcessSpecInfo()
    state: ProcessState
    exit_code: int | None = None
    started_at: float
    ended_at: float | None = None
    kill_reason: str | None = None
    """Why sandboxkit killed it (``timeout``, ``kill``, ``sandbox_killed`` …), else ``None``."""
    restarted_from: int | None = None
    restarted_to: int | None = None
    head: int = 0
    first_seq: int = 0
    total_bytes: int = 0
    evicted_bytes: int = 0
    log_storage: LogStorage | None = None
    """Where the output log is kept: ``disk`` (segment files, the newest output cached in
    memory), or ``memory`` (the disk refused: see ``log_error`` and the
    ``process.log_degraded`` event); ``None`` where the backend does not say."""
    log_retention_bytes: int | None = None
    """The retention in force: the daemon's ``retention_bytes``, or its output cache size
    once the log fell back to memory."""
    log_error: str | None = None
    """Why the log stopped writing to disk, if it did."""
    consumers: int = 0
    stdin_buffered: int = 0
    """Stdin bytes waiting in the daemon for the process to read them."""
    stdin_limit: int = 0
    """Past this many waiting bytes, a batch waits, then gets 429 ``stdin_busy``."""
    stdin_sessions: int = 0
    """Stdin writer sessions remembered (each for its lifetime, for exactly-once)."""

    @property
    def cmd(self) -> str | None:
        """The shell command it runs (``spec.cmd``), or ``None`` for an ``argv``."""
        return self.spec.cmd

    @property
    def argv(self) -> list[str] | None:
        """The argument vector it runs (``spec.argv``), or ``None`` for a ``cmd``."""
        return self.spec.argv

    @property
    def timeout(self) -> float | None:
        """The deadline it was started with (``None``: none, F10)."""
        return self.spec.timeout

    @property
    def tag(self) -> str | None:
        return self.spec.tag


class SandboxInfo(_Described, frozen=True, kw_only=True):
    """A sandbox as the daemon describes it."""

    sandbox_id: str
    state: SandboxState
    workdir: str | None = None
    """The sandbox's own working directory on the daemon's machine."""
    envs: dict[str, str] = {}
    timeout: float | None
    on_timeout: OnTimeout
    auto_resume: bool = False
    metadata: dict[str, str] = {}
    fanout: Fanout = "cursor"
    """The fan-out policy of its processes: ``cursor`` unless the lab set another."""
    lab: LabOptions | None = None
    """The fault-lab options in force (every field set), or ``None``: a production
    sandbox."""
    created_at: float
    killed_at: float | None = None
    freezer: str | None = None
    """How the daemon freezes its processes: ``cgroup`` or ``signals``."""
    processes: int = 0
    isolation: Literal["namespaces", "none"] = "none"
    """What holds for its processes: ``namespaces`` or ``none`` (``docs/isolation.md``)."""
    isolation_reason: str = ""
    """What the host lacks, when ``isolation="auto"`` gave ``none`` (empty otherwise)."""
    allow_internet_access: bool = True
    limits: dict[str, float] = {}
    """The limits asked for (sizes in bytes)."""
    limits_enforced: dict[str, LimitEnforcement] = {}
    """How each limit holds on this host (``sandboxkit/daemon/limits.py``)."""
    state_seq: int = 0
    """Counts the sandbox's lifecycle transitions (pause, resume, kill); streams carry it in
    their state frames, so a view can tell a state sent before its action from one after."""
