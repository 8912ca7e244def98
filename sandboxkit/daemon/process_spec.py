"""What to run in a sandbox and how it is started: a process's spec, the check that
``execve`` can take it, and the launch made of it (its wrappers, bubblewrap, account,
environment and owner mark: :func:`prepare`), which a process and a sandbox's standby
(:mod:`~sandboxkit.daemon.standby`) both spawn."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from sandboxkit.daemon.freezer import Freezer
from sandboxkit.daemon.isolation import NamespacePlan, Wrapped, sandbox_account
from sandboxkit.daemon.limits import LimitEnforcer
from sandboxkit.daemon.run_as import resolve_user
from sandboxkit.errors import InvalidArgument

__all__ = [
    "Launch",
    "ProcessSpec",
    "check_exec_size",
    "daemon_environ",
    "direct",
    "host_cwd",
    "prepare",
]


@dataclass(frozen=True)
class ProcessSpec:
    """What to run: a shell command or an argv, where, with what environment."""

    cmd: str | None = None
    argv: tuple[str, ...] | None = None
    cwd: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    pty: bool = False
    timeout: float | None = None
    """Kill after this many seconds; ``None`` (the default) means no deadline."""
    tag: str | None = None
    user: str | None = None
    """Run as this account (see :mod:`sandboxkit.daemon.run_as`); ``None``: the daemon's."""

    def __post_init__(self) -> None:
        if (self.cmd is None) == (self.argv is None):
            raise InvalidArgument("give exactly one of cmd and argv", field="cmd")
        if self.argv is not None and not self.argv:
            raise InvalidArgument("argv must not be empty", field="argv")
        if self.timeout is not None and self.timeout <= 0:
            raise InvalidArgument("timeout must be positive", field="timeout")

    def command_line(self) -> list[str]:
        """The argv to execute."""
        if self.argv is not None:
            return list(self.argv)
        assert self.cmd is not None
        return ["/bin/sh", "-c", self.cmd]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        data = asdict(self)
        data["argv"] = list(self.argv) if self.argv is not None else None
        if data["user"] is None:
            del data["user"]  # only envd requests name a user
        return data


_MAX_ARG_STRLEN = 128 * 1024
"""Linux refuses (E2BIG) any single argv or environment string this long, NUL included."""


@functools.cache
def _arg_max() -> int:
    try:
        return int(os.sysconf("SC_ARG_MAX"))
    except (OSError, ValueError):
        return 128 * 1024


def check_exec_size(argv: list[str], env: dict[str, str], *, argv_field: str = "argv") -> None:
    """InvalidArgument unless ``execve`` can take ``argv`` and ``env``: every string under
    the kernel's per-string limit and all of them (with their pointers) under ARG_MAX.
    Checked before spawning, so a too-long command is a 422, not a failed fork."""
    total = 0
    for arg in argv:
        size = _encoded_size(arg) + 1
        if size > _MAX_ARG_STRLEN:
            raise InvalidArgument(
                f"an argument of {size} bytes is over the kernel's limit", field=argv_field
            )
        total += size + 8
    argv_total = total
    for key, value in env.items():
        size = _encoded_size(key) + _encoded_size(value) + 2
        if size > _MAX_ARG_STRLEN:
            raise InvalidArgument(
                f"environment variable {key[:40]!r} is over the kernel's limit", field="envs"
            )
        total += size + 8
    # Headroom for the loader's own use of the stack (auxv, the file name, alignment).
    if total > _arg_max() - 8192:
        field = argv_field if argv_total > total - argv_total else "envs"
        raise InvalidArgument(
            f"argument list and environment are {total} bytes, over the system's limit",
            field=field,
        )


def _encoded_size(text: str) -> int:
    """``text``'s length in bytes as ``execve`` gets it (an ASCII string's is its length:
    not encoded, since every command's whole environment is measured)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogateescape"))


class Launch(NamedTuple):
    """A launch ready to spawn: its whole argv (wrappers first), environment, host
    directory to start in and descriptors to pass (see :func:`prepare`)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    pass_fds: tuple[int, ...]
    wrapped: Wrapped | None

    def close(self) -> None:
        """Close what was opened for it (its seccomp filter's pipe), once spawned."""
        if self.wrapped is not None:
            self.wrapped.close()


def prepare(
    spec: ProcessSpec,
    launch: str,
    freezer: Freezer,
    workdir: str,
    base_env: dict[str, str],
    plan: NamespacePlan | None,
    limits: LimitEnforcer | None,
) -> Launch:
    """How to spawn ``spec`` as ``launch`` of a sandbox: through its freezer's or limits'
    wrapper, under bubblewrap with a ``plan``, as ``spec.user``, with its owner mark.
    InvalidArgument (a bad cwd or user, a command over the kernel's limits) first."""
    wrapped = None
    if plan is not None:
        wrapped = plan.wrap(spec.user, spec.cwd)
        wrap, own_env, cwd, pass_fds = wrapped.argv, wrapped.env, wrapped.cwd, wrapped.pass_fds
    else:
        cwd, pass_fds = host_cwd(spec.cwd, workdir), ()
        run_as = resolve_user(spec.user)
        own_env = {**daemon_environ(), **(run_as.env() if run_as is not None else {})}
        wrap = run_as.argv_prefix() if run_as is not None else []
    prepared = Launch([], {}, cwd, pass_fds, wrapped)
    with contextlib.ExitStack() as refused:
        refused.callback(prepared.close)
        # The owner mark last: a request cannot claim another sandbox's processes.
        env = {**own_env, **base_env, **spec.envs, **freezer.launch_env(launch)}
        # With limits, one wrapper joins every cgroup and sets the rlimits (one exec).
        prefix = (
            limits.launch_prefix(freezer.cgroup_joins())
            if limits is not None
            else freezer.launch_prefix()
        )
        argv = prefix + wrap + spec.command_line()
        check_exec_size(argv, env, argv_field="argv" if spec.argv is not None else "cmd")
        refused.pop_all()
    return prepared._replace(argv=argv, env=env)


def direct(
    spec: ProcessSpec,
    launch: str,
    freezer: Freezer,
    workdir: str,
    base_env: dict[str, str],
    plan: NamespacePlan | None,
) -> Launch | None:
    """``spec`` as a sandbox's launcher starts it (:mod:`~sandboxkit.daemon.launcher`),
    from inside the sandbox: its own argv, its environment, its working directory as the
    sandbox sees it. ``None`` unless it runs on pipes as the sandbox's default user (what
    the launcher is). InvalidArgument as :func:`prepare`."""
    if spec.pty:
        return None
    own_env: Mapping[str, str]
    if plan is not None:
        if sandbox_account(spec.user) != "user":
            return None
        cwd, own_env = plan.inside_path(spec.cwd)[0], plan.env("user")
    else:
        if resolve_user(spec.user) is not None:
            return None
        cwd, own_env = host_cwd(spec.cwd, workdir), daemon_environ()
    env = {**own_env, **base_env, **spec.envs, **freezer.launch_env(launch)}
    argv = spec.command_line()
    check_exec_size(argv, env, argv_field="argv" if spec.argv is not None else "cmd")
    return Launch(argv, env, cwd, (), None)


_ENVIRON: list[dict[Any, Any]] = [{}, {}]
"""The daemon's environment as last decoded: its bytes, and the strings they decode to."""


def daemon_environ() -> Mapping[str, str]:
    """What an unisolated command inherits: the daemon's environment, as ``os.environ``
    has it now. Copying ``os.environ`` decodes each variable in Python (20 µs of the 0.3
    ms the daemon spends on a command before its spawn, with 35 variables), so the copy
    is kept and made again only when the bytes behind ``os.environ`` (CPython's
    ``_data``) changed: comparing them is one dict comparison in C."""
    raw = getattr(os.environ, "_data", None)
    if not isinstance(raw, dict):
        return dict(os.environ)
    if raw != _ENVIRON[0]:
        _ENVIRON[:] = [dict(raw), dict(os.environ)]
    return _ENVIRON[1]


def host_cwd(cwd: str | None, workdir: str) -> str:
    """An unisolated process's working directory: ``cwd`` (relative to the sandbox's
    ``workdir``), which must be a directory, else InvalidArgument."""
    path = cwd or workdir
    if not os.path.isabs(path):
        path = os.path.join(workdir, path)
    if not os.path.isdir(path):
        where = (
            ""
            if os.path.isabs(cwd or "")
            else f" (a relative cwd is relative to the sandbox's directory {workdir})"
        )
        raise InvalidArgument(f"cwd {cwd!r} is not a directory{where}", field="cwd")
    return path
