"""Tests for sandboxkit.daemon.tree: freezing whole sandbox process trees."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psutil
import pytest

from sandboxkit.daemon import tree as tree_mod
from sandboxkit.daemon.tree import (
    CgroupProcessTree,
    ProcessTree,
    SignalProcessTree,
    cgroup_v2_available,
    make_process_tree,
    process_is_frozen,
)

# Writes its pid to <file>.pid, then an incrementing counter to <file> every 10 ms.
COUNTER = (
    "import os, sys, time\n"
    "p = sys.argv[1]\n"
    "open(p + '.tmp', 'w').write(str(os.getpid()))\n"
    "os.replace(p + '.tmp', p + '.pid')\n"
    "i = 0\n"
    "while True:\n"
    "    i += 1\n"
    "    open(p + '.new', 'w').write(str(i))\n"
    "    os.replace(p + '.new', p)\n"
    "    time.sleep(0.01)  # sleep-ok: the child counts at a steady rate\n"
)

BACKENDS = [
    pytest.param(
        "cgroup",
        marks=pytest.mark.skipif(not cgroup_v2_available(), reason="no cgroup v2 freezer"),
    ),
    "signals",
]


async def wait_for(
    predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until true or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)  # sleep-ok: poll interval


def read_int(path: Path) -> int | None:
    """Read an integer file, None if absent or being replaced."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def is_gone(pid: int) -> bool:
    """True if the process no longer runs (absent or zombie)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_quietly(pids: list[int]) -> None:
    """SIGKILL leftover processes, ignoring those already gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def grows(path: Path) -> None:
    """Wait until the counter in ``path`` increases."""
    start = read_int(path) or 0
    await wait_for(lambda: (read_int(path) or 0) > start, what=f"{path} to grow")


async def stays_constant(path: Path) -> None:
    """Assert the counter in ``path`` does not change over ~0.3 s."""
    before = read_int(path)
    # Deliberate observation window, not synchronisation.
    await asyncio.sleep(0.3)  # sleep-ok: deliberate pace
    assert read_int(path) == before


class Sandbox:
    """Spawns processes into a ProcessTree and tracks pids for cleanup."""

    def __init__(self, tree: ProcessTree, tmp: Path) -> None:
        self.tree = tree
        self.tmp = tmp
        self.procs: list[asyncio.subprocess.Process] = []
        self.known: set[int] = set()

    async def spawn(self, script: str) -> asyncio.subprocess.Process:
        """Start ``sh -c script`` as a new leader of the tree."""
        proc = await asyncio.create_subprocess_exec(
            *self.tree.launch_prefix(),
            "/bin/sh",
            "-c",
            script,
            start_new_session=True,
            stdin=asyncio.subprocess.DEVNULL,
        )
        self.tree.add(proc.pid)
        self.procs.append(proc)
        self.known.add(proc.pid)
        return proc

    def counter_cmd(self, name: str) -> tuple[str, Path]:
        """Shell command running the counter program writing to ``tmp/name``."""
        script = self.tmp / "counter.py"
        script.write_text(COUNTER)
        out = self.tmp / name
        return f"{sys.executable} {script} {out}", out

    async def counter_pid(self, out: Path) -> int:
        """Wait for a counter process to report its pid."""
        pidfile = Path(f"{out}.pid")
        await wait_for(lambda: read_int(pidfile) is not None, what=f"{pidfile}")
        pid = read_int(pidfile)
        assert pid is not None
        self.known.add(pid)
        return pid

    async def cleanup(self) -> None:
        """Kill everything that might still run, reap leaders, close the tree."""
        self.known.update(self.tree.pids())
        self.tree.signal(signal.SIGKILL)
        kill_quietly(sorted(self.known))
        for proc in self.procs:
            await asyncio.wait_for(proc.wait(), 5)
        await wait_for(lambda: all(is_gone(p) for p in self.known), what="cleanup")
        self.tree.close()


@contextlib.asynccontextmanager
async def sandbox(backend: str, tmp: Path) -> AsyncIterator[Sandbox]:
    """A Sandbox whose processes are always killed and whose tree is closed."""
    sb = Sandbox(make_process_tree(f"test-{backend}", backend), tmp)
    try:
        yield sb
    finally:
        await sb.cleanup()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_freeze_thaw_kill_whole_tree(backend: str, tmp_path: Path) -> None:
    async with sandbox(backend, tmp_path) as sb:
        tree = sb.tree
        assert tree.backend == backend
        assert not tree.frozen

        # A grandchild: sh -> python counter.
        cmd, child_out = sb.counter_cmd("child")
        leader = await sb.spawn(f"{cmd} & wait")
        # A double-forked one: the subshell exits, the counter is reparented.
        cmd2, orphan_out = sb.counter_cmd("orphan")
        orphan_parent = await sb.spawn(f"( nohup {cmd2} >/dev/null 2>&1 & ) ; exit 0")
        outs = [child_out, orphan_out]
        if backend == "cgroup":
            # Even a process escaping into a new session stays in the cgroup.
            cmd3, escaped_out = sb.counter_cmd("escaped")
            await sb.spawn(f"( setsid {cmd3} >/dev/null 2>&1 & ) ; exit 0")
            outs.append(escaped_out)

        pids = [await sb.counter_pid(out) for out in outs]
        assert await asyncio.wait_for(orphan_parent.wait(), 5) == 0
        for out in outs:
            await grows(out)
        members = set(tree.pids())
        assert leader.pid in members
        assert set(pids) <= members

        await tree.freeze()
        assert tree.frozen
        for pid in pids:
            assert process_is_frozen(pid)
        assert process_is_frozen(leader.pid)
        for out in outs:
            await stays_constant(out)

        await tree.thaw()
        assert not tree.frozen
        for out in outs:
            await grows(out)
        assert not any(process_is_frozen(p) for p in pids)

        # Kill while frozen: SIGKILL must still end everything.
        await tree.freeze()
        sb.known.update(tree.pids())
        tree.signal(signal.SIGKILL)
        assert await asyncio.wait_for(leader.wait(), 5) == -signal.SIGKILL
        await wait_for(lambda: all(is_gone(p) for p in pids), what="processes to die")
        await wait_for(lambda: tree.pids() == [], what="tree to be empty")

        tree.close()
        tree.close()  # idempotent
        assert tree.closed
        if isinstance(tree, CgroupProcessTree):
            assert not tree.path.exists()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_freeze_catches_processes_forked_while_freezing(backend: str, tmp_path: Path) -> None:
    async with sandbox(backend, tmp_path) as sb:
        # Continuously forks short-lived children.
        await sb.spawn("while :; do sleep 0.001 & sleep 0.001; done")
        await wait_for(lambda: len(sb.tree.pids()) >= 2, what="children to appear")

        await sb.tree.freeze()
        frozen_pids = sb.tree.pids()
        sb.known.update(frozen_pids)
        assert frozen_pids
        assert all(process_is_frozen(p) for p in frozen_pids)
        # Deliberate observation window: nothing may be forked meanwhile.
        await asyncio.sleep(0.3)  # sleep-ok: deliberate pace
        assert sb.tree.pids() == frozen_pids

        await sb.tree.thaw()
        await wait_for(lambda: sb.tree.pids() != frozen_pids, what="forking to resume")


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_signal_term_and_close_thaws(backend: str, tmp_path: Path) -> None:
    async with sandbox(backend, tmp_path) as sb:
        proc = await sb.spawn("sleep 60 & sleep 60 & wait")
        await wait_for(lambda: len(sb.tree.pids()) == 3, what="sleeps to start")
        children = sb.tree.pids()
        sb.known.update(children)

        # close() of a frozen tree thaws it and does not kill anything.
        await sb.tree.freeze()
        assert all(process_is_frozen(p) for p in children)
        sb.tree.close()
        assert not sb.tree.frozen
        await wait_for(
            lambda: not any(process_is_frozen(p) for p in children), what="thaw on close"
        )
        assert proc.returncode is None
        # Once closed, the tree does nothing more.
        with pytest.raises(RuntimeError):
            sb.tree.launch_prefix()
        kill_quietly(children)
        await asyncio.wait_for(proc.wait(), 5)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_sigterm_reaches_all(backend: str, tmp_path: Path) -> None:
    async with sandbox(backend, tmp_path) as sb:
        proc = await sb.spawn("sleep 60 & sleep 60 & wait")
        await wait_for(lambda: len(sb.tree.pids()) == 3, what="sleeps to start")
        pids = sb.tree.pids()
        sb.known.update(pids)
        sb.tree.signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 5)
        await wait_for(lambda: all(is_gone(p) for p in pids), what="SIGTERM")
        assert sb.tree.pids() == []


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_process_is_frozen_plain_sigstop() -> None:
    proc = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        assert not process_is_frozen(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        await wait_for(lambda: process_is_frozen(proc.pid), what="SIGSTOP")
        os.kill(proc.pid, signal.SIGCONT)
        await wait_for(lambda: not process_is_frozen(proc.pid), what="SIGCONT")
    finally:
        kill_quietly([proc.pid])
        await asyncio.wait_for(proc.wait(), 5)
    assert not process_is_frozen(proc.pid)  # reaped: no such process


@pytest.mark.timeout(30)
def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXKIT_FREEZER", "signals")
    t = make_process_tree("sel")
    try:
        assert isinstance(t, SignalProcessTree)
        assert t.backend == "signals"
        assert t.launch_prefix() == []
    finally:
        t.close()

    with pytest.raises(ValueError):
        make_process_tree("sel", "bogus")
    monkeypatch.setenv("SANDBOXKIT_FREEZER", "bogus")
    with pytest.raises(ValueError):
        make_process_tree("sel")

    monkeypatch.setenv("SANDBOXKIT_FREEZER", "auto")
    t = make_process_tree("sel")
    try:
        expected = "cgroup" if cgroup_v2_available() else "signals"
        assert t.backend == expected
    finally:
        t.close()

    if not cgroup_v2_available():
        with pytest.raises(RuntimeError):
            make_process_tree("sel", "cgroup")
        monkeypatch.setenv("SANDBOXKIT_FREEZER", "cgroup")
        with pytest.raises(RuntimeError):
            make_process_tree("sel")


@pytest.mark.timeout(30)
@pytest.mark.skipif(not cgroup_v2_available(), reason="no cgroup v2 freezer")
def test_cgroup_layout_and_stale_cleanup() -> None:
    base = tree_mod._cgroup_base()
    assert base is not None
    # A dead daemon's leftover parent (with an empty sandbox cgroup inside).
    dead = psutil.Popen(["true"])
    dead.wait()
    assert not psutil.pid_exists(dead.pid)
    stale = base / f"sandboxkit-{dead.pid}"
    own = base / f"sandboxkit-{os.getpid()}"
    (stale / "sb-old").mkdir(parents=True)
    try:
        # Stale parents are removed when our own parent gets created.
        assert tree_mod._rmdir_tree(own)
        t = make_process_tree("a/b c", "cgroup")
        t2 = make_process_tree("a/b c", "cgroup")
        try:
            assert isinstance(t, CgroupProcessTree)
            assert isinstance(t2, CgroupProcessTree)
            assert not stale.exists()
            assert t.path.parent == own
            assert t.path.name == "sb-a_b_c"
            assert t2.path != t.path  # same id, distinct cgroups
            prefix = t.launch_prefix()
            assert prefix[:2] == ["/bin/sh", "-c"]
            assert prefix[-1] == str(t.path / "cgroup.procs")
        finally:
            t.close()
            t2.close()
        assert not t.path.exists()
        assert not t2.path.exists()
    finally:
        for d in (stale / "sb-old", stale):
            if d.exists():
                d.rmdir()
