"""A sandbox's processes from the command line: ``run`` starts one (in a new sandbox or a
named one), ``logs`` prints one's output from a cursor, byte for byte.

Both stream frames with the client's :class:`~sandboxkit.client.api.ApiClient` and end by
saying on stderr where to resume (``sandboxkit logs ID PID --cursor C``) however they
end: the process exited, Ctrl-C, or SIGTERM (which stops a follow as Ctrl-C does).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from sandboxkit.cli.find_daemon import running
from sandboxkit.cli.options import add_command, add_state_file
from sandboxkit.statefile import DaemonState

__all__ = ["add_logs", "add_run"]


def _cmd_logs(args: argparse.Namespace) -> int:
    import asyncio

    state = running(args)
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
        state = running(args)
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


def add_logs(sub: Any) -> None:
    """The ``logs`` command."""
    logs = add_command(sub, "logs", "print a process's output from a cursor, byte for byte")
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
    add_state_file(logs)
    logs.set_defaults(func=_cmd_logs)


def add_run(sub: Any) -> None:
    """The ``run`` command."""
    run = add_command(
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
    add_state_file(run)
    run.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help="the command: one word is a shell command line (`-- 'make && make test'`), "
        "more are an argv run without a shell (`-- python train.py --epochs 3`)",
    )
    run.set_defaults(func=_cmd_run)
