"""Read-only means read-only: looking at a sandbox — listing, info, processes, events,
metrics, file reads, ``sandboxkit ps`` and ``status`` — is not activity. It neither
restarts the idle timer nor resumes a paused ``auto_resume`` sandbox; commands, stdin,
file writes and attached streams do (docs/protocol.md, "What keeps a sandbox alive")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from freezer_support import cli_env
from support import poll

from sandboxkit import AsyncSandbox, FileNotFound
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.statefile import DaemonState, write_state

_PACE = 0.1
"""Seconds between two looks: an observer polling far faster than the timeout."""


def _readers(
    sbx: AsyncSandbox, conn: dict[str, Any], pid: int
) -> list[Callable[[], Awaitable[Any]]]:
    """Every read-only call of the client that names the sandbox or lists it."""
    return [
        sbx.get_info,
        sbx.commands.list,
        lambda: sbx.commands.get(pid),
        sbx.events,
        sbx.consumers,
        sbx.raw_events,
        lambda: AsyncSandbox.list(**conn),
        lambda: sbx.files.list("."),
        lambda: sbx.files.read("seen.txt"),
    ]


async def _until(
    predicate: Callable[[], bool], timeout: float, look: Callable[[], Awaitable[None]]
) -> float:
    """Keep looking (``look``) until ``predicate``; the seconds it took."""
    import asyncio

    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "timed out"
        await look()
        await asyncio.sleep(_PACE)  # sleep-ok: the observer's pace
    return time.monotonic() - started


@pytest.mark.timeout(30)
async def test_looking_does_not_keep_a_sandbox_alive(
    conn: dict[str, Any], daemon: DaemonServer
) -> None:
    async with await AsyncSandbox.create(timeout=1.0, on_timeout="kill", **conn) as sbx:
        await sbx.files.write("seen.txt", "x")
        pid = (await sbx.commands.start("sleep 30")).pid
        core = daemon.host.sandboxes[sbx.sandbox_id]
        readers = _readers(sbx, conn, pid)

        async def look() -> None:
            for read in readers:
                try:
                    await read()
                except FileNotFound:  # the files went with the sandbox, killed meanwhile
                    # (its directory is removed before its state says killed)
                    await poll(lambda: core.state == "killed", 5, "the kill under way")
                    return

        took = await _until(lambda: core.state == "killed", 10, look)
        assert took < 1.0 + 2.0, f"looked at it every {_PACE}s and it lived {took:.1f}s"


@pytest.mark.slow
@pytest.mark.timeout(30)
async def test_a_command_keeps_a_sandbox_alive(conn: dict[str, Any], daemon: DaemonServer) -> None:
    import asyncio

    async with await AsyncSandbox.create(timeout=1.0, on_timeout="kill", **conn) as sbx:
        core = daemon.host.sandboxes[sbx.sandbox_id]
        started = time.monotonic()
        while time.monotonic() - started < 2.5:
            await sbx.commands.run("true")
            await asyncio.sleep(0.2)  # sleep-ok: a user's pace, well inside the timeout
        assert core.state == "running"


@pytest.mark.timeout(30)
async def test_looking_never_resumes_a_paused_auto_resume_sandbox(
    conn: dict[str, Any], daemon: DaemonServer
) -> None:
    async with await AsyncSandbox.create(auto_resume=True, **conn) as sbx:
        await sbx.files.write("seen.txt", "x")
        pid = (await sbx.commands.start("sleep 30")).pid
        await sbx.pause()
        core = daemon.host.sandboxes[sbx.sandbox_id]
        for read in _readers(sbx, conn, pid):
            await read()
            assert core.state == "paused", f"{read} resumed it"
        assert "sandbox.resumed" not in [e["kind"] for e in await sbx.raw_events()]
        # A command is activity: it resumes the sandbox (auto_resume).
        assert (await sbx.commands.run("echo on")).stdout == "on\n"
        assert core.state == "running"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_ps_and_status_in_a_loop_do_not_keep_a_sandbox_alive(
    conn: dict[str, Any], daemon: DaemonServer, tmp_path: Path
) -> None:
    from sandboxkit import Sandbox

    state_file = tmp_path / "daemon.json"
    write_state(
        state_file, DaemonState(daemon.url, os.getpid(), daemon.token or "", time.time(), "test")
    )
    sbx = Sandbox.create(timeout=3.0, on_timeout="kill", **conn)
    try:
        sbx.commands.start("sleep 30")
        core = daemon.host.sandboxes[sbx.sandbox_id]
        started = time.monotonic()
        while core.state != "killed":
            assert time.monotonic() - started < 15, "ps in a loop kept the sandbox alive"
            for command in ("ps", "status"):
                out = subprocess.run(
                    [sys.executable, "-m", "sandboxkit", command, "--state-file", str(state_file)],
                    env=cli_env(state_file),
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert out.returncode == 0, out.stderr
        assert time.monotonic() - started < 3.0 + 3.0
    finally:
        sbx.kill()
