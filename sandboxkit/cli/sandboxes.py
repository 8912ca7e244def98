"""The sandboxes from the command line: ``status`` and ``ps`` show them, ``kill``,
``pause`` and ``resume`` act on one.

Each asks the running daemon over HTTP with its token (no client objects: a command is
one or two requests) and says "no sandbox ID" for one the daemon does not know.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from sandboxkit.cli.find_daemon import get, running
from sandboxkit.cli.options import add_command, add_state_file

__all__ = ["add_kill", "add_pause_resume", "add_ps", "add_status"]

_ID_HELP = "the sandbox, e.g. sbx-1a2b3c4d (see ps)"


def _cmd_status(args: argparse.Namespace) -> int:
    state = running(args)
    if state is None:
        return 1
    sandboxes = get(state, "/sandboxes")
    uptime = time.time() - state.started_at
    print(f"daemon {state.url} pid {state.pid} version {state.version} up {uptime:.0f}s")
    health = get(state, "/health")
    isolation = health.get("isolation") or {}
    if isolation.get("available"):
        print(f"  isolation: namespaces available (default {isolation.get('default')})")
    elif isolation:
        print(f"  isolation: NONE — sandboxes are not isolated: {isolation.get('reason')}")
    commands = {
        "launcher": "forked by a launcher in each sandbox",
        "shell": "each taking a shell started ahead (no launcher: none was built at install)",
        "off": "each started anew (--standby off)",
    }
    spare = {
        "ready": "ready (the next create() for the defaults takes it)",
        "pending": "made once the daemon is quiet",
        "off": "none",
    }
    for label, key, said in (("commands", "launcher", commands), ("spare sandbox", "spare", spare)):
        if health.get(key) in said:
            print(f"  {label}: {said[health[key]]}")
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
    state = running(args)
    if state is None:
        return 1
    sandboxes = [s for s in get(state, "/sandboxes") if args.all or s["state"] != "killed"]
    if not sandboxes:
        print("no live sandboxes" + ("" if args.all else " (--all shows ended ones)"))
    for s in sandboxes:
        print(f"{s['sandbox_id']}  {s['state']}")
        processes = get(state, f"/sandboxes/{s['sandbox_id']}/processes")
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

    state = running(args)
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

    state = running(args)
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


def add_status(sub: Any) -> None:
    """The ``status`` command."""
    status = add_command(
        sub, "status", "show the local daemon, its live sandboxes and how many ended"
    )
    add_state_file(status)
    status.set_defaults(func=_cmd_status)


def add_ps(sub: Any) -> None:
    """The ``ps`` command."""
    ps = add_command(sub, "ps", "list the live sandboxes and their processes")
    ps.add_argument("--all", action="store_true", help="also list ended (killed) sandboxes")
    add_state_file(ps)
    ps.set_defaults(func=_cmd_ps)


def add_kill(sub: Any) -> None:
    """The ``kill`` command."""
    kill = add_command(sub, "kill", "kill a sandbox and every process in it")
    kill.add_argument("sandbox_id", metavar="ID", help=_ID_HELP)
    add_state_file(kill)
    kill.set_defaults(func=_cmd_kill)


def add_pause_resume(sub: Any) -> None:
    """The ``pause`` and ``resume`` commands."""
    for action, what in (
        ("pause", "pause a sandbox: freeze every process in it"),
        ("resume", "resume a paused sandbox"),
    ):
        cmd = add_command(sub, action, what)
        cmd.add_argument("sandbox_id", metavar="ID", help=_ID_HELP)
        add_state_file(cmd)
        cmd.set_defaults(func=_cmd_pause_resume, command=action)
