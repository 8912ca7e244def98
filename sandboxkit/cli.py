"""The command line: ``sandboxkit serve | status | stop | demo``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from sandboxkit._version import __version__
from sandboxkit.statefile import default_state_path, read_state, remove_state

__all__ = ["main"]


def _cmd_serve(args: argparse.Namespace) -> int:
    from sandboxkit.daemon.config import DaemonConfig
    from sandboxkit.daemon.server import DaemonServer

    state_path = Path(args.state_file) if args.state_file else default_state_path()
    existing = read_state(state_path)
    if existing is not None and _alive(existing.pid) and existing.pid != os.getpid():
        print(f"a daemon is already running: {existing.url} (pid {existing.pid})", file=sys.stderr)
        return 1
    config = DaemonConfig(
        retention_bytes=args.retention_bytes,
        result_ttl=args.result_ttl,
        stall_timeout=args.stall_timeout,
        keepalive_interval=args.keepalive_interval,
        freezer=args.freezer,
    )
    server = DaemonServer(
        config,
        bind=args.host,
        port=args.port,
        token=None if args.no_auth else "",
        state_path=state_path,
    )
    print(f"sandboxkit {__version__} serving on {server.url} (pid {os.getpid()})", flush=True)
    server.run()
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from sandboxkit.client.local import probe

    state_path = Path(args.state_file) if args.state_file else default_state_path()
    state = read_state(state_path)
    if state is None or not probe(state):
        print("no daemon running")
        return 1
    import httpx

    headers = {"Authorization": f"Bearer {state.token}"}
    sandboxes = httpx.get(state.url + "/sandboxes", headers=headers, timeout=5).json()
    uptime = time.time() - state.started_at
    print(f"daemon {state.url} pid {state.pid} version {state.version} up {uptime:.0f}s")
    for s in sandboxes:
        print(f"  {s['sandbox_id']}  {s['state']:8}  processes={s['processes']}")
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    state_path = Path(args.state_file) if args.state_file else default_state_path()
    state = read_state(state_path)
    if state is None or not _alive(state.pid):
        print("no daemon running")
        if state is not None:
            remove_state(state_path, state.pid)
        return 0
    os.kill(state.pid, signal.SIGTERM)
    if not _wait_gone(state.pid, args.timeout):
        os.kill(state.pid, signal.SIGKILL)
        _wait_gone(state.pid, 5.0)
    remove_state(state_path, state.pid)
    print(f"stopped daemon pid {state.pid}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from sandboxkit.demo import run_experiment

    return run_experiment(
        cycles=args.cycles,
        policies=args.policies,
        ghosts=args.ghost,
        out=Path(args.out),
        deadline=args.deadline,
        kick_grace=args.kick_grace,
        progress=not args.no_progress,
    )


def _cmd_tour(args: argparse.Namespace) -> int:
    from sandboxkit.demo import run_tour

    return run_tour(lines=args.lines)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandboxkit", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--state-file", help="where to publish url/pid/token")
    serve.add_argument("--no-auth", action="store_true", help="accept requests without token")
    serve.add_argument("--retention-bytes", type=int, default=8 * 1024 * 1024)
    serve.add_argument("--result-ttl", type=float, default=900.0)
    serve.add_argument("--stall-timeout", type=float, default=10.0)
    serve.add_argument("--keepalive-interval", type=float, default=2.0)
    serve.add_argument("--freezer", choices=["auto", "cgroup", "signals"], default="auto")
    serve.set_defaults(func=_cmd_serve)

    status = sub.add_parser("status", help="show the local daemon and its sandboxes")
    status.add_argument("--state-file")
    status.set_defaults(func=_cmd_status)

    stop = sub.add_parser("stop", help="stop the local daemon (kills its sandboxes)")
    stop.add_argument("--state-file")
    stop.add_argument("--timeout", type=float, default=20.0)
    stop.set_defaults(func=_cmd_stop)

    demo = sub.add_parser(
        "demo", help="the stall experiment: policies x ghosts, stall table, CSV and PNG"
    )
    demo.add_argument("--cycles", type=int, default=6)
    demo.add_argument(
        "--policies",
        nargs="+",
        default=["blocking", "kick", "cursor"],
        choices=["blocking", "kick", "cursor"],
    )
    demo.add_argument(
        "--ghost",
        nargs="+",
        default=["pause-snapshot"],
        choices=["pause-snapshot", "leaky", "frozen", "none"],
    )
    demo.add_argument("--out", default="demo-output", help="folder for the CSV and PNG")
    demo.add_argument("--deadline", type=float, default=3.0, help="seconds per refresh")
    demo.add_argument("--kick-grace", type=float, default=None, help="kick policy's grace")
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(func=_cmd_demo)

    tour = sub.add_parser("tour", help="a walk through the runtime: consumers, pause, reattach")
    tour.add_argument("--lines", type=int, default=120)
    tour.set_defaults(func=_cmd_tour)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sandboxkit`` command."""
    args = _parser().parse_args(argv)
    result: int = args.func(args)
    return result
