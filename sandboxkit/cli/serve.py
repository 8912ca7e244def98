"""The daemon's lifetime from the command line: ``serve`` (run one in the foreground) and
``stop`` (end the local one, and with it every sandbox process).

``serve`` sets the :class:`DaemonConfig` fields named in :data:`CONFIG_OPTIONS` from the
options of the same name; each option's default and type are the field's, so the
config is the one source of the daemon's defaults.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from typing import Any

from sandboxkit._proc import pid_alive
from sandboxkit._version import __version__
from sandboxkit.cli.find_daemon import state_path
from sandboxkit.cli.options import add_command, add_state_file
from sandboxkit.daemon.config import SPARE_MODES, STANDBY_MODES, DaemonConfig
from sandboxkit.daemon.file_span import ZERO_COPY_MODES
from sandboxkit.statefile import read_state, remove_state
from sandboxkit.vocab import ENVD_PORT

__all__ = ["CONFIG_OPTIONS", "add_serve", "add_stop"]


CONFIG_OPTIONS: dict[str, str] = {
    "retention_bytes": (
        "output kept per process, in bytes, on disk (segment files under the daemon's "
        "root); older output is evicted (a reader behind it gets a gap)"
    ),
    "output_cache_bytes": "memory per process for its newest output, for the readers that keep up",
    "result_ttl": "seconds an exited process's output and exit code stay available",
    "stall_timeout": "seconds a stream may make no progress before the daemon kicks it",
    "keepalive_interval": "seconds between keepalive frames on an idle stream",
    "freezer": (
        "how pause freezes a process tree: cgroup freezer, SIGSTOP/SIGCONT, or the best available"
    ),
    "isolation": (
        "what a sandbox created without isolation= gets: its own namespaces where the "
        "kernel allows (auto), always (namespaces: creates fail where they cannot), or none "
        "(docs/isolation.md)"
    ),
    "header_timeout": "seconds a new connection has to send a whole request head",
    "keepalive_timeout": "seconds an idle connection may wait for its next request",
    "body_timeout": "seconds a request body may pause before its connection is closed",
    "max_connections": "connections kept open; past it idle unauthenticated ones are closed",
    "fd_reserve": "file descriptors idle connections may not take (kept for processes and files)",
    "zero_copy": (
        "send a reader's output straight from the log's files (sendfile): for isolated "
        "sandboxes while no unisolated one ran (auto), for every sandbox (on: their code is "
        "trusted), or never (off); $SANDBOXKIT_ZERO_COPY sets the default"
    ),
    "standby": (
        "keep a process started in each sandbox's cgroups and namespaces: a launcher that "
        "forks its commands (on; where none was built at install, as shell), the next "
        "launch, which one command takes (shell), or neither (off); $SANDBOXKIT_STANDBY "
        "sets the default"
    ),
    "spare": (
        "keep one sandbox made ahead, its launcher up, for the next create() that asks "
        "for the defaults (on: where launchers are), or none (off); $SANDBOXKIT_SPARE "
        "sets the default"
    ),
}
"""The :class:`DaemonConfig` fields ``serve`` sets from the options of the same name
(``--retention-bytes`` …), with their help; each option's default and type are the
field's."""

_CHOICES: dict[str, list[str]] = {
    "freezer": ["auto", "cgroup", "signals"],
    "isolation": ["auto", "namespaces", "none"],
    "zero_copy": list(ZERO_COPY_MODES),
    "standby": list(STANDBY_MODES),
    "spare": list(SPARE_MODES),
}
"""The options among them that take one of a few names."""


def _cmd_serve(args: argparse.Namespace) -> int:
    from sandboxkit.daemon.server import DaemonServer, UnsafeBind

    path = state_path(args)  # beside another install's daemon, if one holds it
    existing = read_state(path)
    if existing is not None and pid_alive(existing.pid) and existing.pid != os.getpid():
        print(f"a daemon is already running: {existing.url} (pid {existing.pid})", file=sys.stderr)
        return 1
    config = DaemonConfig(**{name: getattr(args, name) for name in CONFIG_OPTIONS})
    try:
        server = DaemonServer(
            config,
            bind=args.host,
            port=args.port,
            token=None if args.no_auth else "",
            state_path=path,
            allow_unauthenticated_network=args.i_understand_anyone_can_run_commands,
            envd_port=args.envd,
        )
    except UnsafeBind as exc:
        print(f"sandboxkit: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. the envd port is taken: the message names it
        print(f"sandboxkit: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"sandboxkit {__version__} serving on {server.url} (pid {os.getpid()})", flush=True)
    if server.envd is not None:
        # Like Jupyter's login URL: the token is in it, for the e2b SDK's sandbox_url.
        print(f"envd endpoint for the e2b SDK: {server.envd.url}", flush=True)
        # E2B's control plane on the same port: the SDK outside its debug mode.
        key = server.token or "any"
        print(
            f"E2B API for the e2b SDK: E2B_API_URL={server.envd.api_url} "
            f"E2B_SANDBOX_URL={server.envd.sandbox_url} E2B_API_KEY={key}",
            flush=True,
        )
    # The process is the daemon's: what it imported and built to start lives as long as
    # it does, and every full collection walked it (about 43,000 objects, 15-30 ms of a
    # pause in which nothing is served). Frozen, it is left out of them.
    gc.collect()
    gc.freeze()
    server.run()
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    path = state_path(args)
    state = read_state(path)
    if state is None or not pid_alive(state.pid):
        print("no daemon running")
        if state is not None:
            remove_state(path, state.pid)
        return 0
    os.kill(state.pid, signal.SIGTERM)
    if not _wait_gone(state.pid, args.timeout):
        os.kill(state.pid, signal.SIGKILL)
        _wait_gone(state.pid, 5.0)
    remove_state(path, state.pid)
    print(f"stopped daemon pid {state.pid}")
    return 0


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def add_serve(sub: Any, config: DaemonConfig) -> None:
    """The ``serve`` command; ``config`` gives the defaults of :data:`CONFIG_OPTIONS`."""
    serve = add_command(sub, "serve", "run a daemon in the foreground (127.0.0.1, bearer token)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    serve.add_argument(
        "--state-file",
        help="where to publish url, pid and token (default: $SANDBOXKIT_STATE_FILE, else "
        "$XDG_RUNTIME_DIR/sandboxkit/daemon.json, else ~/.sandboxkit/daemon.json)",
    )
    serve.add_argument(
        "--no-auth", action="store_true", help="accept requests without the bearer token"
    )
    serve.add_argument(
        "--i-understand-anyone-can-run-commands",
        action="store_true",
        help="allow --no-auth on a non-loopback --host (anyone who can reach it can run commands)",
    )
    serve.add_argument(
        "--envd",
        type=int,
        nargs="?",
        const=ENVD_PORT,
        default=None,
        metavar="PORT",
        help="also serve an envd-compatible endpoint for the official e2b SDK in debug mode, "
        f"and E2B's control plane under /api for the SDK outside it (default port {ENVD_PORT}, "
        "envd's; 0: any free one); see docs/e2b.md",
    )
    for name, text in CONFIG_OPTIONS.items():
        default = getattr(config, name)
        kind: dict[str, Any] = (
            {"choices": _CHOICES[name]} if name in _CHOICES else {"type": type(default)}
        )
        serve.add_argument("--" + name.replace("_", "-"), default=default, help=text, **kind)
    serve.set_defaults(func=_cmd_serve)


def add_stop(sub: Any) -> None:
    """The ``stop`` command."""
    stop = add_command(sub, "stop", "stop the local daemon; every sandbox process is killed")
    add_state_file(stop)
    stop.add_argument(
        "--timeout",
        type=float,
        default=20.0,
        help="seconds to wait for a clean shutdown before SIGKILL",
    )
    stop.set_defaults(func=_cmd_stop)
