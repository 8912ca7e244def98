"""sandboxkit: local sandboxes for long-lived processes whose output streams never stall.

Commands: serve (run a daemon in the foreground), status (the local daemon and its live
sandboxes), ps (sandboxes and their processes), run (start a command, in a new sandbox or
a named one), kill (kill a sandbox), pause and resume (a sandbox), logs (print or follow a
process's output from a cursor), stop (stop the local daemon), demo (the stall experiment,
on a private daemon), tour (a walk through the runtime, on a private daemon).

Without --state-file, the commands find this install's local daemon through the state
file: $SANDBOXKIT_STATE_FILE, else $XDG_RUNTIME_DIR/sandboxkit/daemon.json, else
~/.sandboxkit/daemon.json (a daemon of another sandboxkit install there is left alone).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from sandboxkit._proc import pid_alive
from sandboxkit._version import __version__
from sandboxkit.daemon.config import DaemonConfig, LabDefaults
from sandboxkit.lab_options import FANOUT_POLICIES, GHOST_KINDS
from sandboxkit.statefile import DaemonState, read_state, remove_state
from sandboxkit.vocab import ENVD_PORT

__all__ = ["main"]


_CONFIG_OPTIONS: dict[str, str] = {
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
}
"""The :class:`DaemonConfig` fields ``serve`` sets from the options of the same name
(``--retention-bytes`` …), with their help; each option's default and type are the
field's."""

_CHOICES: dict[str, list[str]] = {
    "freezer": ["auto", "cgroup", "signals"],
    "isolation": ["auto", "namespaces", "none"],
}
"""The options among them that take one of a few names."""


def _cmd_serve(args: argparse.Namespace) -> int:
    from sandboxkit.daemon.server import DaemonServer, UnsafeBind

    state_path = _state_path(args)  # beside another install's daemon, if one holds it
    existing = read_state(state_path)
    if existing is not None and pid_alive(existing.pid) and existing.pid != os.getpid():
        print(f"a daemon is already running: {existing.url} (pid {existing.pid})", file=sys.stderr)
        return 1
    config = DaemonConfig(**{name: getattr(args, name) for name in _CONFIG_OPTIONS})
    try:
        server = DaemonServer(
            config,
            bind=args.host,
            port=args.port,
            token=None if args.no_auth else "",
            state_path=state_path,
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
    server.run()
    return 0


def _state_path(args: argparse.Namespace) -> Path:
    from sandboxkit.client.local import local_state_path

    return Path(args.state_file) if args.state_file else local_state_path()


def _running(args: argparse.Namespace) -> DaemonState | None:
    from sandboxkit.client.local import probe

    state = read_state(_state_path(args))
    if state is None or not probe(state):
        print("no daemon running")
        return None
    return state


def _get(state: DaemonState, path: str) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {state.token}"}
    response = httpx.get(state.url + path, headers=headers, timeout=10)
    response.raise_for_status()
    return response.json()


def _cmd_status(args: argparse.Namespace) -> int:
    state = _running(args)
    if state is None:
        return 1
    sandboxes = _get(state, "/sandboxes")
    uptime = time.time() - state.started_at
    print(f"daemon {state.url} pid {state.pid} version {state.version} up {uptime:.0f}s")
    health = _get(state, "/health")
    isolation = health.get("isolation") or {}
    if isolation.get("available"):
        print(f"  isolation: namespaces available (default {isolation.get('default')})")
    elif isolation:
        print(f"  isolation: NONE — sandboxes are not isolated: {isolation.get('reason')}")
    if health.get("root_missing"):
        print(
            f"  warning: the daemon's root {health.get('root')} was removed from outside the "
            "daemon; it can create no sandbox (restart it: sandboxkit stop)"
        )
    live = [s for s in sandboxes if s["state"] != "killed"]
    for s in live:
        timeout = "never" if s.get("timeout") is None else f"{s['timeout']:g}s"
        print(
            f"  {s['sandbox_id']}  {s['state']:8}  processes={s['processes']}  "
            f"timeout={timeout} then {s.get('on_timeout', 'kill')}  "
            f"isolation={s.get('isolation', 'none')}"
        )
    if not live:
        print("  no live sandboxes")
    ended = len(sandboxes) - len(live)
    if ended:
        print(f"  ({ended} ended sandbox{'es' if ended != 1 else ''} not shown)")
    return 0


def _cmd_ps(args: argparse.Namespace) -> int:
    state = _running(args)
    if state is None:
        return 1
    sandboxes = [s for s in _get(state, "/sandboxes") if args.all or s["state"] != "killed"]
    if not sandboxes:
        print("no live sandboxes" + ("" if args.all else " (--all shows ended ones)"))
    for s in sandboxes:
        print(f"{s['sandbox_id']}  {s['state']}")
        processes = _get(state, f"/sandboxes/{s['sandbox_id']}/processes")
        if not processes:
            print("    (no processes)")
        for p in processes:
            spec = p.get("spec") or {}
            command = spec.get("cmd") or " ".join(spec.get("argv") or [])
            command = command.replace("\n", "\\n")
            if len(command) > 60:
                command = command[:57] + "..."
            exit_code = "" if p.get("exit_code") is None else f" exit={p['exit_code']}"
            print(
                f"    pid {p['pid']:<7} {p['state']:8}{exit_code}  head={p.get('head', 0)}  "
                f"consumers={p.get('consumers', 0)}  {command}"
            )
    return 0


def _cmd_kill(args: argparse.Namespace) -> int:
    import httpx

    state = _running(args)
    if state is None:
        return 1
    headers = {"Authorization": f"Bearer {state.token}"}
    response = httpx.delete(f"{state.url}/sandboxes/{args.sandbox_id}", headers=headers, timeout=30)
    if response.status_code == 404:
        print(f"no sandbox {args.sandbox_id}", file=sys.stderr)
        return 1
    response.raise_for_status()
    print(f"killed sandbox {args.sandbox_id}")
    return 0


def _cmd_pause_resume(args: argparse.Namespace) -> int:
    import httpx

    state = _running(args)
    if state is None:
        return 1
    headers = {"Authorization": f"Bearer {state.token}"}
    action = args.command  # "pause" or "resume"
    url = f"{state.url}/sandboxes/{args.sandbox_id}/{action}"
    response = httpx.post(url, headers=headers, timeout=30)
    if response.status_code == 404:
        print(f"no sandbox {args.sandbox_id}", file=sys.stderr)
        return 1
    if response.status_code >= 400:
        try:
            message = str(response.json()["message"])
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {response.status_code}: {response.text[:200]}"
        print(f"error: {message}", file=sys.stderr)
        return 1
    print(f"sandbox {args.sandbox_id} is {response.json()['state']}")
    return 0


def _cmd_logs(args: argparse.Namespace) -> int:
    import asyncio

    state = _running(args)
    if state is None:
        return 1
    try:
        return asyncio.run(
            _stopped_by_sigterm(_logs(state, args.sandbox_id, args.pid, args.cursor, args.follow))
        )
    except KeyboardInterrupt:  # Ctrl-C on --follow: _logs printed where to resume
        return 130


async def _stopped_by_sigterm(work: Coroutine[Any, Any, int]) -> int:
    """Run ``work``; SIGTERM cancels it as Ctrl-C does (so its ``finally`` says where to
    resume) and ends with 143, as a process SIGTERM ended."""
    import asyncio

    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        return 128 + signal.SIGTERM
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _cmd_run(args: argparse.Namespace) -> int:
    import asyncio

    from sandboxkit.errors import SandboxkitError

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("sandboxkit run: no command given (sandboxkit run -- CMD ...)", file=sys.stderr)
        return 2
    if args.sandbox is not None:
        state = _running(args)
        if state is None:
            return 1
    else:
        from sandboxkit.client.local import ensure_local_daemon

        try:  # a new sandbox needs no daemon running yet: start the local one, as Python does
            state = ensure_local_daemon(Path(args.state_file) if args.state_file else None)
        except SandboxkitError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    try:
        return asyncio.run(_stopped_by_sigterm(_run(state, args, command)))
    except KeyboardInterrupt:  # Ctrl-C on --follow: the process runs on; _logs said so
        return 130


async def _run(state: DaemonState, args: argparse.Namespace, command: list[str]) -> int:
    """Start ``command`` (one word: a shell command line; more: an argv, no shell) in the
    named sandbox or a new one; say which sandbox and pid; with ``--follow``, stream its
    output and end with its exit code."""
    from sandboxkit.client.api import ApiClient
    from sandboxkit.errors import SandboxkitError, SandboxNotFound

    api = ApiClient(state.url, state.token)
    try:
        sandbox_id = args.sandbox
        if sandbox_id is None:
            body: dict[str, Any] = {"metadata": {"created_by": "sandboxkit run"}}
            if args.timeout is not None:
                body.update(timeout=args.timeout, on_timeout="kill")
            sandbox_id = (await api.call("POST", "/sandboxes", json=body))["sandbox_id"]
        spec: dict[str, Any] = {"cmd": command[0]} if len(command) == 1 else {"argv": command}
        try:
            started = await api.call("POST", f"/sandboxes/{sandbox_id}/processes", json=spec)
        except SandboxNotFound:
            print(f"no sandbox {sandbox_id}", file=sys.stderr)
            return 1
    except SandboxkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        await api.aclose()
    pid = int(started["pid"])
    said = f"sandbox {sandbox_id} pid {pid}"
    if not args.follow:
        print(said)
        print(f"# follow it: sandboxkit logs {sandbox_id} {pid} --follow", file=sys.stderr)
        return 0
    print(f"# {said}", file=sys.stderr, flush=True)
    return await _logs(state, sandbox_id, pid, 0, True, exit_code=True)


async def _logs(
    state: DaemonState,
    sandbox_id: str,
    pid: int,
    cursor: int | None,
    follow: bool,
    *,
    exit_code: bool = False,
) -> int:
    """Write the process's output byte for byte (stdout to stdout, stderr to stderr) from
    ``cursor``; without ``follow`` up to the output there is now. Ends by telling on
    stderr the cursor to resume from. With ``follow``, a status line on stderr
    (``# pid N · paused · sandbox paused · cursor C``) each time the process's or the
    sandbox's state changes, whoever changed it: the daemon says so at once. ``exit_code``:
    end with the process's exit code (128 + the signal for one a signal ended), not 0."""
    from sandboxkit.client.api import ApiClient
    from sandboxkit.errors import SandboxkitError
    from sandboxkit.wire import FrameKind

    api = ApiClient(state.url, state.token)
    path = f"/sandboxes/{sandbox_id}/processes/{pid}"
    ended = False
    shown: tuple[object, object] | None = None

    def status(meta: dict[str, object]) -> None:
        nonlocal shown
        states = (meta.get("process_state"), meta.get("sandbox_state"))
        if not follow or states == shown or states[0] is None:
            return
        shown = states
        print(
            f"# pid {pid} · {states[0]} · sandbox {states[1]} · cursor {cursor}",
            file=sys.stderr,
            flush=True,
        )

    try:
        head = int((await api.call("GET", path))["head"])
        if not follow and cursor is not None and cursor >= head:
            return 0  # nothing new; the finally clause says where to resume
        async with api.stream(path + "/stream", cursor=cursor, name="cli-logs") as frames:
            async for frame in frames:
                if frame.kind is FrameKind.START:
                    cursor = int(frame.meta["cursor"])
                    status(frame.meta)
                    if not follow and cursor >= head:
                        break
                elif frame.kind is FrameKind.KEEPALIVE:
                    status(frame.meta)
                elif frame.kind is FrameKind.DATA:
                    out = sys.stderr if frame.meta.get("stream") == "stderr" else sys.stdout
                    out.buffer.write(frame.payload)
                    out.buffer.flush()
                    cursor = int(frame.meta["seq"]) + 1
                    if not follow and cursor >= head:
                        break
                elif frame.kind is FrameKind.GAP:
                    why = (
                        "not replayed: the sandbox's lab fan-out delivers new output only"
                        if frame.meta.get("reason") == "not_replayed"
                        else "evicted by the daemon before this reader read them"
                    )
                    print(
                        f"# {frame.meta['bytes_lost']} bytes lost: {why} (cursor "
                        f"{frame.meta['cursor']}–{frame.meta['first_available']})",
                        file=sys.stderr,
                    )
                    cursor = int(frame.meta["first_available"])
                elif frame.kind is FrameKind.END:
                    ended = True
                    code = frame.meta.get("exit_code")
                    print(f"# process {pid} exited with code {code}", file=sys.stderr)
                    if exit_code and isinstance(code, int):
                        return code if code >= 0 else 128 - code
                    break
                elif frame.kind is FrameKind.ERROR:
                    raise frame.error()
    except SandboxkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        await api.aclose()
        if not ended and cursor is not None:  # also on Ctrl-C (a cancellation here)
            print(
                f"# resume with: sandboxkit logs {sandbox_id} {pid} --cursor {cursor}",
                file=sys.stderr,
            )
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    state_path = _state_path(args)
    state = read_state(state_path)
    if state is None or not pid_alive(state.pid):
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
        client=args.client,
    )


def _cmd_tour(args: argparse.Namespace) -> int:
    from sandboxkit.demo import run_tour

    return run_tour(lines=args.lines)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


_STATE_FILE_HELP = (
    "the daemon's state file (url, pid, token); default: this install's local daemon, "
    "found through $SANDBOXKIT_STATE_FILE, else $XDG_RUNTIME_DIR/sandboxkit/daemon.json, "
    "else ~/.sandboxkit/daemon.json"
)


class _HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already names it (or
    it is an off-by-default flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        if action.default == argparse.SUPPRESS:
            return text
        if isinstance(action.default, list):
            return text + " (default: " + " ".join(map(str, action.default)) + ")"
        return text + " (default: %(default)s)"


def _sub(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=help[0].upper() + help[1:] + ".",
        formatter_class=_HelpWithDefaults,
    )
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandboxkit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    config = DaemonConfig()  # the defaults of the options that set its fields
    serve = _sub(sub, "serve", "run a daemon in the foreground (127.0.0.1, bearer token)")
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
    for name, text in _CONFIG_OPTIONS.items():
        default = getattr(config, name)
        kind: dict[str, Any] = (
            {"choices": _CHOICES[name]} if name in _CHOICES else {"type": type(default)}
        )
        serve.add_argument("--" + name.replace("_", "-"), default=default, help=text, **kind)
    serve.set_defaults(func=_cmd_serve)

    status = _sub(sub, "status", "show the local daemon, its live sandboxes and how many ended")
    status.add_argument("--state-file", help=_STATE_FILE_HELP)
    status.set_defaults(func=_cmd_status)

    ps = _sub(sub, "ps", "list the live sandboxes and their processes")
    ps.add_argument("--all", action="store_true", help="also list ended (killed) sandboxes")
    ps.add_argument("--state-file", help=_STATE_FILE_HELP)
    ps.set_defaults(func=_cmd_ps)

    kill = _sub(sub, "kill", "kill a sandbox and every process in it")
    kill.add_argument("sandbox_id", metavar="ID", help="the sandbox, e.g. sbx-1a2b3c4d (see ps)")
    kill.add_argument("--state-file", help=_STATE_FILE_HELP)
    kill.set_defaults(func=_cmd_kill)

    for action, what in (
        ("pause", "pause a sandbox: freeze every process in it"),
        ("resume", "resume a paused sandbox"),
    ):
        cmd = _sub(sub, action, what)
        cmd.add_argument("sandbox_id", metavar="ID", help="the sandbox, e.g. sbx-1a2b3c4d (see ps)")
        cmd.add_argument("--state-file", help=_STATE_FILE_HELP)
        cmd.set_defaults(func=_cmd_pause_resume, command=action)

    logs = _sub(sub, "logs", "print a process's output from a cursor, byte for byte")
    logs.add_argument("sandbox_id", metavar="ID", help="the sandbox (see ps)")
    logs.add_argument("pid", type=int, metavar="PID", help="the process (see ps)")
    logs.add_argument(
        "--cursor",
        type=int,
        default=None,
        help="the chunk to start from, as printed by an earlier `logs` (default: the oldest "
        "output kept)",
    )
    logs.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep printing new output until the process exits (Ctrl-C or SIGTERM stops, "
        "printing the cursor to resume from)",
    )
    logs.add_argument("--state-file", help=_STATE_FILE_HELP)
    logs.set_defaults(func=_cmd_logs)

    run = _sub(
        sub,
        "run",
        "start a command in a new sandbox (or --sandbox ID) and print the sandbox id and pid",
    )
    run.add_argument(
        "--sandbox",
        metavar="ID",
        default=None,
        help="run in this sandbox (see ps) instead of a new one (default: a new sandbox, "
        "starting the local daemon if none runs)",
    )
    run.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="stream its output and exit with its exit code (Ctrl-C or SIGTERM stops "
        "following; the process runs on)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="a new sandbox's idle timeout in seconds, then kill (see docs/protocol.md, what "
        "keeps a sandbox alive; default: none, until sandboxkit kill ID)",
    )
    run.add_argument("--state-file", help=_STATE_FILE_HELP)
    run.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help="the command: one word is a shell command line (`-- 'make && make test'`), "
        "more are an argv run without a shell (`-- python train.py --epochs 3`)",
    )
    run.set_defaults(func=_cmd_run)

    stop = _sub(sub, "stop", "stop the local daemon; every sandbox process is killed")
    stop.add_argument("--state-file", help=_STATE_FILE_HELP)
    stop.add_argument(
        "--timeout",
        type=float,
        default=20.0,
        help="seconds to wait for a clean shutdown before SIGKILL",
    )
    stop.set_defaults(func=_cmd_stop)

    demo = _sub(
        sub,
        "demo",
        "the stall experiment on a private daemon: policies x ghosts, stall table, CSV and PNG",
    )
    demo.add_argument(
        "--cycles", type=int, default=6, help="pause/resume/reattach cycles per policy"
    )
    demo.add_argument(
        "--policies",
        nargs="+",
        default=list(FANOUT_POLICIES),
        choices=FANOUT_POLICIES,
        help="fan-out policies to compare",
    )
    demo.add_argument(
        "--ghost",
        nargs="+",
        default=["pause-snapshot"],
        choices=GHOST_KINDS,
        help="what a stream open at a pause becomes",
    )
    demo.add_argument("--out", default="demo-output", help="folder for the CSV and PNG files")
    demo.add_argument(
        "--deadline",
        type=float,
        default=3.0,
        help="seconds a refresh may take before it counts as stalled",
    )
    demo.add_argument(
        "--kick-grace",
        type=float,
        default=None,
        help="seconds the kick policy waits on a full queue (default: the daemon's, "
        f"{LabDefaults().kick_grace:g})",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument(
        "--client",
        choices=["sandboxkit", "e2b"],
        default="sandboxkit",
        help="who reattaches: sandboxkit's client, or the official e2b SDK through the "
        "daemon's envd endpoint (needs pip install e2b)",
    )
    demo.set_defaults(func=_cmd_demo)

    tour = _sub(
        sub,
        "tour",
        "a walk through the runtime on a private daemon: two consumers, pause/resume, "
        "reattach by cursor",
    )
    tour.add_argument("--lines", type=int, default=120, help="lines the example process prints")
    tour.set_defaults(func=_cmd_tour)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sandboxkit`` command."""
    args = _parser().parse_args(argv)
    try:
        result: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`sandboxkit ps | head`): stop quietly, as a process that
        # SIGPIPE ended would. Python ignores SIGPIPE, so the write raised instead; point
        # stdout at /dev/null so the interpreter's last flush has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    return result
