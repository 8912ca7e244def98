"""Sandbox and process lifecycle: pause/resume of whole trees, idle timeouts, kill,
process deadlines, PTY and stdin — through the client SDK against an in-process daemon,
and at the core level where that is simpler."""

from __future__ import annotations

import asyncio
import shlex
import sys
import time

import psutil
import pytest
from freezer_support import process_is_frozen
from support import fast_config, poll

from sandboxkit import AsyncSandbox, SandboxPaused
from sandboxkit.daemon import isolation
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.freezer import cgroup_v2_available
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.server import DaemonServer

BACKENDS = [
    pytest.param(
        "cgroup",
        marks=pytest.mark.skipif(not cgroup_v2_available(), reason="no cgroup v2 freezer"),
    ),
    "signals",
]

# A counter printed every 10 ms by a python that is a grandchild of the leader: the leader
# shell backgrounds an inner shell, which backgrounds the python.
TICKER = (
    "import itertools, time\n"
    "for i in itertools.count():\n"
    "    print(i, flush=True)\n"
    "    time.sleep(0.01)\n"  # sleep-ok: the child's pace
)
INNER = f"{shlex.quote(sys.executable)} -u -c {shlex.quote(TICKER)} & wait"
GRANDCHILD_CMD = f"sh -c {shlex.quote(INNER)} & wait"

# Prints "ready" once SIGTERM is ignored (inherited by the sleeps), then loops forever.
IGNORES_TERM = "trap '' TERM; echo ready; while :; do sleep 0.05; done"


@pytest.fixture
def freezer() -> str:
    return "auto"


@pytest.fixture
def daemon_config(daemon_config: DaemonConfig, freezer: str) -> DaemonConfig:
    """The conftest's fast settings, with the freezer backend under test."""
    daemon_config.freezer = freezer
    return daemon_config


def gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (absent, or a zombie awaiting its reaper)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def find_ticker(leader: int) -> psutil.Process | None:
    try:
        children = psutil.Process(leader).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            argv = child.cmdline()
            if argv[:1] == [sys.executable] and "itertools" in " ".join(argv):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


# -- 1. pause freezes the whole tree -------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("freezer", BACKENDS)
async def test_pause_freezes_grandchild_and_resume_thaws_it(
    conn: dict[str, str], daemon: DaemonServer, freezer: str
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        assert sbx.info.freezer == freezer
        handle = await sbx.commands.run(GRANDCHILD_CMD, background=True)
        await poll(lambda: handle.stdout.count("\n") >= 5, what="ticks before pause")
        await poll(lambda: find_ticker(handle.pid) is not None, what="the grandchild")
        ticker = find_ticker(handle.pid)
        assert ticker is not None
        assert ticker.ppid() != handle.pid, "the ticker must be a grandchild, not a child"
        assert not process_is_frozen(ticker.pid)

        await sbx.pause()
        assert sbx.info.state == "paused"
        await asyncio.sleep(0.1)  # sleep-ok: let output written before the freeze land
        frozen_at = len(handle.stdout)
        await asyncio.sleep(0.4)  # sleep-ok: observation window: output must not grow
        assert len(handle.stdout) == frozen_at, "a paused grandchild kept writing"
        assert process_is_frozen(ticker.pid)
        assert process_is_frozen(handle.pid)
        listed = {p.pid: p for p in await sbx.commands.list()}
        assert listed[handle.pid].state == "paused"
        assert daemon.host.sandboxes[sbx.sandbox_id].state == "paused"

        await sbx.resume()
        assert sbx.info.state == "running"
        await poll(lambda: len(handle.stdout) > frozen_at + 20, what="ticks after resume")
        assert not process_is_frozen(ticker.pid)
        listed = {p.pid: p for p in await sbx.commands.list()}
        assert listed[handle.pid].state == "running"
        kinds = [(e["kind"], e["reason"]) for e in await sbx.raw_events()]
        assert ("sandbox.paused", "user") in kinds
        assert ("sandbox.resumed", "user") in kinds
        await handle.disconnect()
    assert gone(ticker.pid)


# -- 2. idle timeout -------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_idle_timeout_pauses_and_next_request_auto_resumes(
    conn: dict[str, str], daemon: DaemonServer
) -> None:
    async with await AsyncSandbox.create(
        timeout=0.3, on_timeout="pause", auto_resume=True, **conn
    ) as sbx:
        core = daemon.host.sandboxes[sbx.sandbox_id]
        started = time.monotonic()
        info = await sbx.commands.start(IGNORES_TERM)  # the last request naming it
        # No request names the sandbox while we wait: those would restart its idle timer.
        await poll(lambda: core.state == "paused", what="idle pause")
        assert time.monotonic() - started >= 0.3, "paused before the idle timeout ran out"
        await poll(lambda: process_is_frozen(info.pid), what="frozen leader")

        await sbx.commands.list()  # a read: not activity, the sandbox stays paused
        assert core.state == "paused"
        assert process_is_frozen(info.pid)
        assert (await sbx.commands.run("echo on")).stdout == "on\n"  # resumes it first
        assert not process_is_frozen(info.pid)
        events = await sbx.events()
        mine = events[events["kind"].isin(["sandbox.paused", "sandbox.resumed"])]
        pairs = list(zip(mine["kind"], mine["reason"], strict=True))
        assert pairs[:2] == [("sandbox.paused", "timeout"), ("sandbox.resumed", "auto")]


@pytest.mark.timeout(30)
async def test_paused_sandbox_without_auto_resume_refuses_new_processes(
    conn: dict[str, str], daemon: DaemonServer
) -> None:
    async with await AsyncSandbox.create(
        timeout=0.3, on_timeout="pause", auto_resume=False, **conn
    ) as sbx:
        core = daemon.host.sandboxes[sbx.sandbox_id]
        await poll(lambda: core.state == "paused", what="idle pause")
        with pytest.raises(SandboxPaused):
            await sbx.commands.run("echo never")
        assert core.state == "paused", "a refused request must not resume the sandbox"
        assert core.processes == {}
        assert [(e["kind"], e["reason"]) for e in await sbx.raw_events()].count(
            ("sandbox.resumed", "auto")
        ) == 0
        await sbx.resume()
        result = await sbx.commands.run("echo now")
        assert result.stdout == "now\n"


@pytest.mark.timeout(30)
async def test_idle_timeout_kill_kills_sandbox_and_its_processes(
    conn: dict[str, str], daemon: DaemonServer
) -> None:
    async with await AsyncSandbox.create(timeout=0.3, on_timeout="kill", **conn) as sbx:
        info = await sbx.commands.start("sleep 30")
        core = daemon.host.sandboxes[sbx.sandbox_id]
        await poll(lambda: core.state == "killed", what="idle kill")
        await poll(lambda: gone(info.pid), what="process gone")
        assert (await sbx.get_info()).state == "killed"
        events = await sbx.raw_events()
        assert [e["reason"] for e in events if e["kind"] == "sandbox.killed"] == ["timeout"]
        exited = [e for e in events if e["kind"] == "process.exited"]
        assert [e["pid"] for e in exited] == [info.pid]
        assert "timeout" in exited[0]["reason"]
        assert not core.workdir.exists()


# -- 3. kill -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_kill_escalates_to_sigkill_for_a_process_ignoring_sigterm(host: Host) -> None:
    sandbox = await host.create_sandbox()
    process = await sandbox.start_process(ProcessSpec(cmd=IGNORES_TERM))
    await poll(lambda: process.log.head > 0, what="trap installed")
    started = time.monotonic()
    await sandbox.kill()
    elapsed = time.monotonic() - started
    assert sandbox.state == "killed"
    assert process.log.exit_code == -9, "only SIGKILL can end it"
    assert elapsed >= host.config.kill_grace * 0.9, "SIGTERM should have been ignored"
    assert elapsed < host.config.kill_grace + 2.0, "SIGKILL must follow the grace at once"
    assert gone(process.pid)
    kinds = [(e.kind, e.reason) for e in host.journal.since(sandbox_id=sandbox.sandbox_id)]
    assert ("sandbox.killed", "user") in kinds
    assert [
        e.pid
        for e in host.journal.since(sandbox_id=sandbox.sandbox_id)
        if e.kind == "process.exited"
    ] == [process.pid]


@pytest.mark.timeout(120)
async def test_a_command_killed_as_it_is_born_gets_sigterm_not_the_grace() -> None:
    # An isolated command is born 2-3 ms after its launch is spawned (bubblewrap makes its
    # namespaces first). Killed in between, the SIGTERM went to bubblewrap alone; the
    # command, born after it, ran on until SIGKILL at the end of the grace (3 s: a daemon
    # stopped just after a start took that long). 3 kills in 20 took the grace before.
    if not isolation.probe().available:
        pytest.skip("no namespaces here")
    config = fast_config(isolation="namespaces", spare="off", kill_grace=6.0)
    async with Host(config) as host:
        for _ in range(30):
            sandbox = await host.create_sandbox()
            process = await sandbox.start_process(ProcessSpec(argv=("sleep", "60")))
            started = time.monotonic()
            await sandbox.kill()
            assert time.monotonic() - started < config.kill_grace / 2, "it waited the grace"
            assert gone(process.pid)


@pytest.mark.timeout(30)
async def test_kill_a_paused_sandbox(conn: dict[str, str], daemon: DaemonServer) -> None:
    sbx = await AsyncSandbox.create(**conn)
    try:
        handle = await sbx.commands.run(IGNORES_TERM, background=True)
        await poll(lambda: "ready" in handle.stdout, what="trap installed")
        await sbx.pause()
        await poll(lambda: process_is_frozen(handle.pid), what="frozen")
        core = daemon.host.sandboxes[sbx.sandbox_id]
    finally:
        await sbx.kill()
    assert core.state == "killed"
    await poll(lambda: gone(handle.pid), what="process gone")
    assert core.processes[handle.pid].log.exit_code == -9


# -- 4. process deadlines (F10) -----------------------------------------------------------


@pytest.mark.timeout(30)
async def test_process_deadline_only_when_asked(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        free = await sbx.commands.start("sleep 30")
        started = time.monotonic()
        bounded = await sbx.commands.start("sleep 30", timeout=0.5)
        info = bounded
        while info.state != "exited":
            assert time.monotonic() - started < 10, "the 0.5 s deadline never fired"
            await asyncio.sleep(0.02)  # sleep-ok: poll interval
            info = await sbx.commands.get(bounded.pid)
        assert time.monotonic() - started >= 0.45
        assert info.kill_reason == "timeout"
        assert info.exit_code is not None and info.exit_code != 0
        other = await sbx.commands.get(free.pid)
        assert other.state == "running"
        assert other.kill_reason is None
        assert other.timeout is None
        exits = [e for e in await sbx.raw_events() if e["kind"] == "process.exited"]
        assert [(e["pid"], e["reason"]) for e in exits] == [(bounded.pid, "timeout")]


# -- 5. PTY --------------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_pty_process_sees_a_tty_and_reads_stdin(conn: dict[str, str]) -> None:
    probe = [sys.executable, "-c", "import sys; print(sys.stdout.isatty(), sys.stdin.isatty())"]
    async with await AsyncSandbox.create(**conn) as sbx:
        with_pty = await sbx.commands.run(probe, pty=True)
        assert with_pty.stdout.strip() == "True True"
        without = await sbx.commands.run(probe)
        assert without.stdout.strip() == "False False"

        shout = "import sys; print('got:' + sys.stdin.readline().strip().upper())"
        handle = await sbx.commands.run([sys.executable, "-c", shout], background=True, pty=True)
        await sbx.commands.send_stdin(handle.pid, "hello pty\n")
        result = await handle.wait()
        assert "got:HELLO PTY" in result.stdout
        assert result.exit_code == 0


# -- 6. stdin ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_stdin_reaches_cat_and_close_makes_it_exit(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        handle = await sbx.commands.run("cat", background=True)
        await sbx.commands.send_stdin(handle.pid, "ping\n")
        await poll(lambda: handle.stdout == "ping\n", what="first echo")
        await handle.send_stdin(b"pong\n")
        await poll(lambda: handle.stdout == "ping\npong\n", what="second echo")
        assert not handle.done, "cat must keep running while stdin is open"
        await sbx.commands.close_stdin(handle.pid)
        result = await asyncio.wait_for(handle.wait(), 10)
        assert result.exit_code == 0
        assert result.stdout == "ping\npong\n"
