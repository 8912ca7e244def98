"""The options of ``commands.start``, ``run`` and ``connect``, defined once.

Each call takes its options as keywords, typed by a ``TypedDict`` through
``**options: Unpack[...]``, so the async client, the sync one and a provider share one
definition and a type checker still checks every keyword a user passes:

- :class:`ProcessOptions` — how a process is started (``envs``, ``cwd``, ``timeout``,
  ``pty``); :class:`StartOptions` adds the ``tag`` only ``start`` takes;
- :class:`OutputOptions` — how its output is delivered (callbacks, ``lines``, gaps,
  ``keep_output``); :class:`ConnectOptions` adds the consumer's ``role``;
- :class:`RunOptions` — both, for ``run``.

The defaults live in one place, :class:`FollowOptions` (the resolved form a handle's reader
is built from) for output, :func:`process_spec` for processes: ``run``, ``connect`` and a
:class:`~sandboxkit.client.stream.ProcessStream` made by hand all deliver whole lines
unless told ``lines=False``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypedDict

from sandboxkit.client.output import DEFAULT_KEEP_OUTPUT, KeepOutput

if TYPE_CHECKING:  # stream.py builds its reader from FollowOptions: no import cycle
    from sandboxkit.client.stream import BytesCallback, OnGap, OutputCallback

__all__ = [
    "CONNECT_KEYWORDS",
    "RUN_KEYWORDS",
    "START_KEYWORDS",
    "ConnectOptions",
    "FollowOptions",
    "OutputOptions",
    "ProcessOptions",
    "RunOptions",
    "StartOptions",
    "check_keywords",
    "follow_options",
    "process_spec",
]


class ProcessOptions(TypedDict, total=False):
    """How a process is started."""

    envs: dict[str, str] | None
    """Environment variables added to the sandbox's (default: none)."""
    cwd: str | None
    """Working directory; relative to the sandbox's own (default: the sandbox's)."""
    timeout: float | None
    """Seconds after which the process is killed (default: none, F10)."""
    pty: bool
    """Run it on a pseudo-terminal (default ``False``)."""


class StartOptions(ProcessOptions, total=False):
    """``commands.start``: a process started, not followed."""

    tag: str | None
    """A label the daemon keeps with the process (default: none)."""


class OutputOptions(TypedDict, total=False):
    """How a handle delivers its process's output (defaults: :class:`FollowOptions`)."""

    on_stdout: OutputCallback | None
    on_stderr: OutputCallback | None
    on_gap: OnGap
    lines: bool
    on_stdout_bytes: BytesCallback | None
    on_stderr_bytes: BytesCallback | None
    keep_output: KeepOutput | None
    """``None``: the call's default (``run`` in the foreground keeps everything)."""


class ConnectOptions(OutputOptions, total=False):
    """``commands.connect``: a reader of a process already running."""

    role: str | None


class RunOptions(ProcessOptions, OutputOptions, total=False):
    """``commands.run``: a process started and followed."""


@dataclass(frozen=True)
class FollowOptions:
    """How a handle's reader delivers a process's output, resolved: what ``run`` and
    ``connect`` were given, with the defaults filled in (see
    :meth:`~sandboxkit.client.commands.AsyncCommands.run` for what each means)."""

    on_stdout: OutputCallback | None = None
    on_stderr: OutputCallback | None = None
    on_gap: OnGap = None
    lines: bool = True
    role: str | None = None
    on_stdout_bytes: BytesCallback | None = None
    on_stderr_bytes: BytesCallback | None = None
    keep_output: KeepOutput = DEFAULT_KEEP_OUTPUT


_FOLLOW = frozenset(f.name for f in fields(FollowOptions))
_PROCESS_DEFAULTS: dict[str, Any] = {"envs": None, "cwd": None, "timeout": None, "pty": False}
START_KEYWORDS = frozenset(StartOptions.__optional_keys__)
RUN_KEYWORDS = frozenset(RunOptions.__optional_keys__)
CONNECT_KEYWORDS = frozenset(ConnectOptions.__optional_keys__)


def check_keywords(allowed: frozenset[str], call: str, options: Mapping[str, Any]) -> None:
    """TypeError for a keyword of ``options`` not in ``allowed``, as Python words it for
    a signature (``call`` names the function, e.g. ``AsyncCommands.run``)."""
    for name in options:
        if name not in allowed:
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}")


def follow_options(options: Mapping[str, Any], keep_output: KeepOutput) -> FollowOptions:
    """The :class:`FollowOptions` of a call's keywords (the process's ones left out);
    ``keep_output`` is the call's default for it."""
    follow = {k: v for k, v in options.items() if k in _FOLLOW}
    if follow.get("keep_output") is None:
        follow["keep_output"] = keep_output
    return FollowOptions(**follow)


def process_spec(cmd: str | list[str], options: Mapping[str, Any]) -> dict[str, Any]:
    """The daemon's request body for starting ``cmd`` (a list: an argv; a string: a shell
    command) as ``options`` say, with the defaults filled in."""
    spec = {k: options.get(k, default) for k, default in _PROCESS_DEFAULTS.items()}
    spec["envs"] = spec["envs"] or {}
    spec["tag"] = options.get("tag")
    spec["argv" if isinstance(cmd, list) else "cmd"] = cmd
    return spec
