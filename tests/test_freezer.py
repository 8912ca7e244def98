"""The freezer (sandboxkit.daemon.freezer): freezing, thawing and signalling every process
of a sandbox, with either backend."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from freezer_support import process_is_frozen
from support import poll

from sandboxkit._proc import pid_alive
from sandboxkit.daemon.freezer import (
    CgroupFreezer,
    Freezer,
    SignalFreezer,
    cgroup_v2_available,
    cgroupfs,
    make_freezer,
)
from sandboxkit.daemon.freezer import base as freezer_base
from sandboxkit.daemon.freezer import signals as signals_freezer
from sandboxkit.daemon.freezer.daemon_cgroup import daemon_cgroup_path
from sandboxkit.daemon.freezer.proc import send_to
from sandboxkit.daemon.isolation import probe

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


_NAMESPACES = probe()
BWRAP = [
    str(_NAMESPACES.bwrap),
    "--unshare-user",
    "--unshare-pid",
    "--ro-bind", "/", "/",
    "--proc", "/proc",
    "--dev", "/dev",
]  # fmt: skip
"""A launch in namespaces of its own, as sandboxkit's isolated sandboxes are."""
needs_namespaces = pytest.mark.skipif(
    not _NAMESPACES.available and not os.environ.get("CI"),
    reason=f"no namespaces here: {_NAMESPACES.reason}",
)

# Deadlines are failure bounds, not expected times: a loaded machine (the suite runs
# beside other work on 2 cores) takes seconds to start a Python process, and a test
# that passes returns as soon as its condition holds.
DEADLINE = 20.0
"""Seconds before a wait in these tests gives up."""


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
    await poll(lambda: (read_int(path) or 0) > start, timeout=DEADLINE, what=f"{path} to grow")


async def stays_constant(path: Path) -> None:
    """Assert the counter in ``path`` does not change over ~0.3 s."""
    before = read_int(path)
    # Deliberate observation window, not synchronisation.
    await asyncio.sleep(0.3)  # sleep-ok: deliberate pace
    assert read_int(path) == before


class Sandbox:
    """Spawns processes into a Freezer and tracks pids for cleanup."""

    def __init__(self, tree: Freezer, tmp: Path) -> None:
        self.tree = tree
        self.tmp = tmp
        self.procs: list[asyncio.subprocess.Process] = []
        self.known: set[int] = set()

    async def spawn(
        self, script: str, launch: str | None = None, *, contained: bool = False
    ) -> asyncio.subprocess.Process:
        """Start ``sh -c script`` as a new leader, as the daemon does: in a session of its
        own, with the freezer's owner mark in its environment; ``contained``: in a PID
        namespace of its own, under bubblewrap, as an isolated sandbox's launch is."""
        launch = launch or f"launch-{len(self.procs)}"
        wrap = [*BWRAP, "--bind", str(self.tmp), str(self.tmp), "--"] if contained else []
        proc = await asyncio.create_subprocess_exec(
            *self.tree.launch_prefix(),
            *wrap,
            "/bin/sh",
            "-c",
            script,
            start_new_session=True,
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, **self.tree.launch_env(launch)},
        )
        self.tree.add(proc.pid, launch, contained=contained)
        self.procs.append(proc)
        self.known.add(proc.pid)
        return proc

    def counter_cmd(self, name: str) -> tuple[str, Path]:
        """Shell command running the counter program writing to ``tmp/name``."""
        script = self.tmp / "counter.py"
        if not script.exists():
            # Written once, and whole: rewriting it while a counter started before is
            # still reading it gave that counter an empty script (it never wrote its pid).
            partial = self.tmp / "counter.py.new"
            partial.write_text(COUNTER)
            partial.replace(script)
        out = self.tmp / name
        return f"{sys.executable} {script} {out}", out

    async def counter_pid(self, out: Path) -> int:
        """Wait for a counter process to report its pid."""
        pidfile = Path(f"{out}.pid")
        await poll(lambda: read_int(pidfile) is not None, timeout=DEADLINE, what=f"{pidfile}")
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
            await asyncio.wait_for(proc.wait(), DEADLINE)
        await poll(lambda: all(is_gone(p) for p in self.known), timeout=DEADLINE, what="cleanup")
        self.tree.close()


@contextlib.asynccontextmanager
async def sandbox(backend: str, tmp: Path) -> AsyncIterator[Sandbox]:
    """A Sandbox whose processes are always killed and whose tree is closed."""
    # (A freeze that is not complete by ``freeze_timeout`` gives up with a warning; the
    # default 2 s is for a daemon, not for a loaded test machine.)
    sb = Sandbox(make_freezer(f"test-{backend}", backend, freeze_timeout=DEADLINE), tmp)
    try:
        yield sb
    finally:
        await sb.cleanup()


@pytest.mark.asyncio
@pytest.mark.timeout(90)
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
        # One that escapes parentage and session: the cgroup holds it, the owner mark
        # finds it.
        cmd3, escaped_out = sb.counter_cmd("escaped")
        await sb.spawn(f"( setsid {cmd3} >/dev/null 2>&1 & ) ; exit 0")
        outs = [child_out, orphan_out, escaped_out]

        pids = [await sb.counter_pid(out) for out in outs]
        assert await asyncio.wait_for(orphan_parent.wait(), DEADLINE) == 0
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
        assert await asyncio.wait_for(leader.wait(), DEADLINE) == -signal.SIGKILL
        await poll(lambda: all(is_gone(p) for p in pids), timeout=DEADLINE, what="processes to die")
        await poll(lambda: tree.pids() == [], timeout=DEADLINE, what="tree to be empty")

        tree.close()
        tree.close()  # idempotent
        assert tree.closed
        if isinstance(tree, CgroupFreezer):
            assert not tree.path.exists()


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_freeze_catches_processes_forked_while_freezing(backend: str, tmp_path: Path) -> None:
    async with sandbox(backend, tmp_path) as sb:
        # Continuously forks short-lived children.
        await sb.spawn("while :; do sleep 0.001 & sleep 0.001; done")
        await poll(lambda: len(sb.tree.pids()) >= 2, timeout=DEADLINE, what="children to appear")

        await sb.tree.freeze()
        frozen_pids = sb.tree.pids()
        sb.known.update(frozen_pids)
        assert frozen_pids
        assert all(process_is_frozen(p) for p in frozen_pids)
        # Deliberate observation window: nothing may be forked meanwhile.
        await asyncio.sleep(0.3)  # sleep-ok: deliberate pace
        assert sb.tree.pids() == frozen_pids

        await sb.tree.thaw()
        await poll(
            lambda: sb.tree.pids() != frozen_pids, timeout=DEADLINE, what="forking to resume"
        )


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_signal_term_and_close_thaws(backend: str, tmp_path: Path) -> None:
    async with sandbox(backend, tmp_path) as sb:
        proc = await sb.spawn("sleep 60 & sleep 60 & wait")
        await poll(lambda: len(sb.tree.pids()) == 3, timeout=DEADLINE, what="sleeps to start")
        children = sb.tree.pids()
        sb.known.update(children)

        # close() of a frozen tree thaws it and does not kill anything.
        await sb.tree.freeze()
        assert all(process_is_frozen(p) for p in children)
        sb.tree.close()
        assert not sb.tree.frozen
        await poll(
            lambda: not any(process_is_frozen(p) for p in children),
            timeout=DEADLINE,
            what="thaw on close",
        )
        assert proc.returncode is None
        # Once closed, the tree does nothing more.
        with pytest.raises(RuntimeError):
            sb.tree.launch_prefix()
        kill_quietly(children)
        await asyncio.wait_for(proc.wait(), DEADLINE)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_sigterm_reaches_all(backend: str, tmp_path: Path) -> None:
    async with sandbox(backend, tmp_path) as sb:
        proc = await sb.spawn("sleep 60 & sleep 60 & wait")
        await poll(lambda: len(sb.tree.pids()) == 3, timeout=DEADLINE, what="sleeps to start")
        pids = sb.tree.pids()
        sb.known.update(pids)
        sb.tree.signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), DEADLINE)
        await poll(lambda: all(is_gone(p) for p in pids), timeout=DEADLINE, what="SIGTERM")
        assert sb.tree.pids() == []


@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_process_is_frozen_plain_sigstop() -> None:
    proc = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        assert not process_is_frozen(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        await poll(lambda: process_is_frozen(proc.pid), timeout=DEADLINE, what="SIGSTOP")
        os.kill(proc.pid, signal.SIGCONT)
        await poll(lambda: not process_is_frozen(proc.pid), timeout=DEADLINE, what="SIGCONT")
    finally:
        kill_quietly([proc.pid])
        await asyncio.wait_for(proc.wait(), DEADLINE)
    assert not process_is_frozen(proc.pid)  # reaped: no such process


@pytest.mark.timeout(90)
def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOXKIT_FREEZER", "signals")
    t = make_freezer("sel")
    try:
        assert isinstance(t, SignalFreezer)
        assert t.backend == "signals"
        assert t.launch_prefix() == []
    finally:
        t.close()

    with pytest.raises(ValueError):
        make_freezer("sel", "bogus")
    monkeypatch.setenv("SANDBOXKIT_FREEZER", "bogus")
    with pytest.raises(ValueError):
        make_freezer("sel")

    monkeypatch.setenv("SANDBOXKIT_FREEZER", "auto")
    t = make_freezer("sel")
    try:
        expected = "cgroup" if cgroup_v2_available() else "signals"
        assert t.backend == expected
    finally:
        t.close()

    if not cgroup_v2_available():
        with pytest.raises(RuntimeError):
            make_freezer("sel", "cgroup")
        monkeypatch.setenv("SANDBOXKIT_FREEZER", "cgroup")
        with pytest.raises(RuntimeError):
            make_freezer("sel")


@pytest.mark.timeout(90)
@pytest.mark.skipif(not cgroup_v2_available(), reason="no cgroup v2 freezer")
def test_cgroup_layout_and_stale_cleanup() -> None:
    base = cgroupfs.cgroup_base()
    assert base is not None
    # A cgroup named like an unlocked daemon's of old (with an empty sandbox cgroup
    # inside): that no process of this pid runs here proves nothing (another pid namespace
    # may hold it), so it is left alone — only a dead daemon's root lock names a cgroup
    # to reclaim (tests/test_ownership.py).
    dead = psutil.Popen(["true"])
    dead.wait()
    assert not psutil.pid_exists(dead.pid)
    stale = base / f"sandboxkit-{dead.pid}"
    own = daemon_cgroup_path()
    assert own is not None and own.name.startswith(f"sandboxkit-{os.getpid()}-")
    (stale / "sb-old").mkdir(parents=True)
    try:
        assert cgroupfs.rmdir_tree(own)
        t = make_freezer("a/b c", "cgroup")
        t2 = make_freezer("a/b c", "cgroup")
        try:
            assert isinstance(t, CgroupFreezer)
            assert isinstance(t2, CgroupFreezer)
            assert (stale / "sb-old").is_dir()
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


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_launch_members_are_what_one_leader_started(backend: str, tmp_path: Path) -> None:
    """A launch is its leader, what is below it and what escaped it; another launch of the
    same sandbox is not part of it, and signalling a launch leaves the other running."""
    async with sandbox(backend, tmp_path) as sb:
        cmd, out = sb.counter_cmd("escaped")
        first = await sb.spawn(f"( setsid {cmd} >/dev/null 2>&1 & ) ; exec sleep 60", "one")
        other = await sb.spawn("sleep 60 & wait", "two")
        escaped = await sb.counter_pid(out)
        await poll(
            lambda: os.getsid(escaped) == escaped, timeout=DEADLINE, what="the escapee's setsid"
        )
        await poll(
            lambda: len(sb.tree.launch_members("two")) == 2, timeout=DEADLINE, what="the other"
        )
        assert set(sb.tree.launch_members("one")) == {first.pid, escaped}
        others = set(sb.tree.launch_members("two"))
        assert other.pid in others and not others & {first.pid, escaped}

        sb.tree.signal_launch("one", signal.SIGKILL)
        assert await asyncio.wait_for(first.wait(), DEADLINE) == -signal.SIGKILL
        await poll(lambda: is_gone(escaped), timeout=DEADLINE, what="the escapee to die")
        assert all(not is_gone(pid) for pid in others)


@pytest.mark.timeout(90)
def test_pid_alive_says_no_to_a_zombie() -> None:
    """The one liveness check (CLI, client, daemon): an exited process nobody reaped yet
    is not running, though ``kill(pid, 0)`` still succeeds on it."""
    proc = subprocess.Popen(["true"])
    try:
        wait_until_zombie = time.monotonic() + 5
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < wait_until_zombie, "true did not exit"
            time.sleep(0.01)  # sleep-ok: poll interval
        os.kill(proc.pid, 0)  # the kernel still knows the pid
        assert not pid_alive(proc.pid)
    finally:
        proc.wait()
    assert not pid_alive(proc.pid)
    assert pid_alive(os.getpid())
    assert not pid_alive(0)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_signal_reaches_a_shell_before_the_command_it_waits_for(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed shell command ends by the signal (``-15``), however slowly the signals go
    out: a shell signalled after its child saw the child die and exited by itself (143 or
    0), which a loaded daemon, preempted between two ``kill()`` calls, made happen."""
    sent: list[int] = []

    def slow_send(ident: Any, sig: int) -> None:
        send_to(ident, sig)
        sent.append(ident.pid)
        time.sleep(0.1)  # sleep-ok: a daemon preempted between two signals

    async with sandbox(backend, tmp_path) as sb:
        shells = [await sb.spawn("sleep 60; exit 0", f"cmd-{i}") for i in range(4)]
        for i in range(4):
            await poll(
                lambda i=i: len(sb.tree.launch_members(f"cmd-{i}")) == 2,
                timeout=DEADLINE,
                what="the sleeps",
            )
        monkeypatch.setattr(freezer_base, "send_to", slow_send)
        for i, shell in enumerate(shells):
            sb.tree.signal_launch(f"cmd-{i}", signal.SIGTERM)
            assert await asyncio.wait_for(shell.wait(), DEADLINE) == -signal.SIGTERM, sent


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@needs_namespaces
async def test_contained_launches_are_frozen_without_a_scan_of_proc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the signals freezer, a sandbox whose launches each run in a PID namespace
    of their own is found by walking down from its leaders: nothing in a PID namespace
    leaves it, and its orphans go to its init, below the leader. Every process on the
    host is read only when something could have left (a scan costs as much as reading
    each of tens of members), and the escapees are still caught."""
    scans: list[int] = []
    scan = signals_freezer.scan_processes

    def counted() -> Any:
        scans.append(1)
        return scan()

    monkeypatch.setattr(signals_freezer, "scan_processes", counted)
    async with sandbox("signals", tmp_path) as sb:
        cmd, escaped_out = sb.counter_cmd("escaped")
        await sb.spawn(f"( setsid {cmd} >/dev/null 2>&1 & ) ; exec sleep 60", contained=True)
        cmd, child_out = sb.counter_cmd("child")
        await sb.spawn(f"{cmd} & wait", contained=True)
        outs = [escaped_out, child_out]
        pids = [await _host_pid_of_counter(sb, out) for out in outs]
        for out in outs:
            await grows(out)
        scans.clear()
        assert set(pids) <= set(sb.tree.pids())
        await sb.tree.freeze()
        assert all(process_is_frozen(pid) for pid in pids)
        for out in outs:
            await stays_constant(out)
        await sb.tree.thaw()
        for out in outs:
            await grows(out)
        assert scans == []


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@needs_namespaces
async def test_a_contained_launch_whose_leader_was_killed_is_still_frozen(
    tmp_path: Path,
) -> None:
    """The walk down from a leader holds only while the leader lives: bubblewrap's
    monitor, killed (or exited with its command while something inside lives on), leaves
    the namespace running under the host's init, which the freezer then finds by a scan."""
    async with sandbox("signals", tmp_path) as sb:
        cmd, out = sb.counter_cmd("orphaned")
        leader = await sb.spawn(f"{cmd} & wait", contained=True)
        pid = await _host_pid_of_counter(sb, out)
        await grows(out)
        assert pid in sb.tree.pids()
        leader.kill()
        await asyncio.wait_for(leader.wait(), DEADLINE)
        await grows(out)  # the namespace lives on without it
        await sb.tree.freeze()
        assert process_is_frozen(pid)
        await stays_constant(out)
        await sb.tree.thaw()
        await grows(out)


async def _host_pid_of_counter(sb: Sandbox, out: Path) -> int:
    """A counter in a PID namespace writes its pid there; the host's is the process of
    the sandbox whose ``NSpid`` ends with it."""
    inner = await sb.counter_pid(out)
    sb.known.discard(inner)

    def host_pid() -> int | None:
        for pid in psutil.pids():
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                nspid = next(ln for ln in status.splitlines() if ln.startswith("NSpid:"))
                ids = nspid.split()[1:]
                if (
                    len(ids) > 1
                    and ids[-1] == str(inner)
                    and str(out) in " ".join(psutil.Process(pid).cmdline())
                ):
                    return pid
        return None

    found = await poll(host_pid, timeout=DEADLINE, what="the counter's host pid")
    sb.known.add(found)
    return int(found)


@pytest.mark.asyncio
@pytest.mark.timeout(90)
@needs_namespaces
async def test_a_walk_takes_no_pid_that_is_no_longer_the_childs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pid read from a ``children`` list may be freed and reused by the time its stat is
    read: the process under it is a member only if its parent is still the one listing
    it (here, an outsider's pid slipped into the leader's list is left alone)."""
    outsider = await asyncio.create_subprocess_exec("sleep", "60")
    listed = signals_freezer.children_of

    def with_an_outsider(pid: int) -> list[int]:
        return [*listed(pid), outsider.pid]

    monkeypatch.setattr(signals_freezer, "children_of", with_an_outsider)
    try:
        async with sandbox("signals", tmp_path) as sb:
            cmd, out = sb.counter_cmd("inside")
            await sb.spawn(f"{cmd} & wait", contained=True)
            pid = await _host_pid_of_counter(sb, out)
            members = sb.tree.members()
            assert pid in members and outsider.pid not in members
            await sb.tree.freeze()
            assert process_is_frozen(pid) and not process_is_frozen(outsider.pid)
            await sb.tree.thaw()
    finally:
        outsider.kill()
        await outsider.wait()
