"""The spare sandbox (sandboxkit/daemon/spare.py): made ahead once the daemon is quiet,
its launcher up, given to the next create() that asks for the defaults, whose first
command is then a fork of that launcher; invisible until taken; ended with the host."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from freezer_support import alive, served
from support import ended, fast_config, is_launcher, poll, wait_until

from sandboxkit.daemon import isolation
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.launcher_slot import LauncherSlot
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.daemon.spare import Spare
from sandboxkit.errors import InvalidArgument
from sandboxkit.lab_options import LabOptions
from sandboxkit.limits import Limits


@pytest.fixture(params=["none", "namespaces"])
async def host(request: pytest.FixtureRequest) -> Host:
    if request.param == "namespaces" and not isolation.probe().available:
        pytest.skip("no namespaces here")
    async with Host(fast_config(isolation=request.param)) as made:
        if made.spare is None:
            pytest.skip("no launcher was built here: no spare")
        yield made


def _spare(host: Host) -> Spare:
    assert host.spare is not None
    return host.spare


async def _made(host: Host) -> ManagedSandbox:
    sandbox: ManagedSandbox = await poll(lambda: _spare(host).sandbox, what="the spare made")
    return sandbox


def _launcher_pid(sandbox: ManagedSandbox) -> int:
    """The pid of its launcher (inside its namespaces, where it is bubblewrap's child)."""
    slot = sandbox.standby
    assert isinstance(slot, LauncherSlot) and slot.running is not None
    (pid,) = (p for p in sandbox.tree.pids() if is_launcher(p))
    return pid


def _parent(pid: int) -> int:
    return psutil.Process(pid).ppid()


async def test_a_create_for_the_defaults_gets_the_spare_and_its_first_command_is_a_fork(
    host: Host,
) -> None:
    spare = await _made(host)
    launcher = _launcher_pid(spare)
    sandbox = await host.create_sandbox(envs={"GREETING": "hi"}, metadata={"who": "me"})
    assert sandbox is spare and host.sandboxes == {sandbox.sandbox_id: sandbox}
    # Its working directory (its home) and, isolated, its /tmp, made empty for it.
    listing = "ls -A; ls -A /tmp" if sandbox.plan is not None else "ls -A"
    process = await sandbox.start_process(
        ProcessSpec(cmd=f'echo "$GREETING $MORE"; pwd; {listing}; cat', envs={"MORE": "x"})
    )
    assert _parent(process.pid) == launcher  # a fork, not a launch through bubblewrap
    process.close_stdin()
    home = "/home/user" if sandbox.plan is not None else str(sandbox.workdir)
    assert await ended(process) == (0, f"hi x\n{home}\n".encode(), b"")
    assert sandbox.to_json()["metadata"] == {"who": "me"}
    # Its story starts at the create: nothing of it was heard while it was the spare.
    events = [e for e in host.journal.since(0) if e.sandbox_id == sandbox.sandbox_id]
    assert [e.kind for e in events][:2] == ["sandbox.created", "process.started"]


async def test_the_spare_is_no_sandbox_of_the_hosts_until_taken(host: Host) -> None:
    spare = await _made(host)
    assert host.sandboxes == {}
    assert all(e.sandbox_id != spare.sandbox_id for e in host.journal.since(0))
    assert spare.state == "running" and spare.workdir.is_dir()


@pytest.mark.parametrize(
    "asked",
    [
        {"limits": Limits(pids=64)},
        {"allow_internet_access": False},
        {"lab": LabOptions()},
        {"isolation": "other"},
    ],
    ids=["limits", "no-internet", "lab", "other-isolation"],
)
async def test_a_create_asking_for_more_than_the_defaults_gets_a_new_sandbox(
    host: Host, asked: dict[str, object]
) -> None:
    spare = await _made(host)
    if asked.get("isolation") == "other":
        if host.config.isolation == "none":
            if not isolation.probe().available:
                pytest.skip("no namespaces here")
            asked = {"isolation": "namespaces"}
        else:
            asked = {"isolation": "none"}
    sandbox = await host.create_sandbox(**asked)  # type: ignore[arg-type]
    assert sandbox is not spare
    assert _spare(host).sandbox is spare and _launcher_pid(spare)  # still there, still up


async def test_a_refused_create_leaves_the_spare(host: Host) -> None:
    spare = await _made(host)
    with pytest.raises(InvalidArgument):
        await host.create_sandbox(timeout=-1)
    assert host.sandboxes == {} and _spare(host).sandbox is spare


async def test_the_next_spare_is_made_once_quiet_not_during_a_burst(host: Host) -> None:
    first = await _made(host)
    taken = [await host.create_sandbox() for _ in range(5)]
    assert taken[0] is first
    # The burst's creates never waited for a spare, nor was one made among them.
    assert all(s.sandbox_id in host.sandboxes for s in taken)
    assert _spare(host).sandbox is None or _spare(host).sandbox not in taken
    second = await _made(host)
    assert second not in taken and second.sandbox_id not in host.sandboxes


async def test_a_spare_whose_launcher_died_is_ended_not_given(host: Host) -> None:
    spare = await _made(host)
    os.kill(_launcher_pid(spare), signal.SIGKILL)
    slot = spare.standby
    assert isinstance(slot, LauncherSlot)
    await poll(lambda: slot.running is None, what="the launcher seen gone")
    sandbox = await host.create_sandbox()
    assert sandbox is not spare
    await poll(lambda: spare.state == "killed", what="the dead spare ended")
    assert not spare.workdir.exists()
    process = await sandbox.start_process(ProcessSpec(argv=("echo", "fine")))
    assert await ended(process) == (0, b"fine\n", b"")


@pytest.mark.parametrize("when", ["made", "being made"])
async def test_closing_the_host_ends_the_spare(when: str) -> None:
    host = Host(fast_config())
    await host.start()
    spare = host.spare
    if spare is None:
        await host.close()
        pytest.skip("no launcher was built here: no spare")
    if when == "made":
        made = await _made(host)
        launcher = _launcher_pid(made)
    else:
        assert spare._fill() is not None  # now, not once quiet: close() meets it half made
        await poll(
            lambda: any(p.name.startswith("sbx-") for p in host.root.iterdir()),
            what="the spare being made",
        )
        launcher = None
    await host.close()
    assert spare.sandbox is None
    if launcher is not None:
        assert not psutil.pid_exists(launcher) or psutil.Process(launcher).status() == "zombie"
    # Nothing of it stays: no directory besides the root's (the host removed the root).
    assert not host.root.exists()


async def test_no_spare_when_turned_off() -> None:
    async with Host(fast_config(spare="off")) as host:
        assert host.spare is None
        sandbox = await host.create_sandbox()
        assert sandbox.sandbox_id in host.sandboxes


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_sigkilled_daemons_spare_is_removed_by_the_next_daemon(tmp_path: Path) -> None:
    """The spare is the daemon's like its sandboxes, in its root and cgroups: a daemon
    that dies leaves it to the next one that starts, which removes it (its launcher
    ends by itself when the daemon's end of its socket closes)."""
    with served(tmp_path) as dead:
        root = Path(httpx.get(f"{dead.url}/health", headers=dead.headers).json()["root"])
        spare = wait_until(
            lambda: [p for p in root.iterdir() if p.name.startswith("sbx-")], what="the spare"
        )
        dead.proc.send_signal(signal.SIGKILL)
        dead.proc.wait(10)
    # Any daemon that starts on this machine reclaims it (the suite's other worker's,
    # maybe, before this one's): the dead daemon's root, its spare in it, goes.
    with DaemonServer(fast_config()):
        wait_until(lambda: not any(p.exists() for p in spare), what="the dead daemon's spare to go")
        wait_until(lambda: not root.exists(), what="the dead daemon's root to go")


async def test_a_spare_that_could_not_be_made_is_tried_again_after_the_next_create(
    host: Host,
) -> None:
    """A spare that failed (here: the disk refused its directory) costs the creates
    nothing; the next create makes its own sandbox and asks for a spare again."""
    spare = _spare(host)
    first = await _made(host)
    make, tries = spare._make, list[None]()

    async def failing() -> ManagedSandbox:
        tries.append(None)
        raise OSError(28, "No space left on device")

    spare._make = failing
    assert await host.create_sandbox() is first  # and the next spare is asked for
    await poll(lambda: tries, what="the next spare tried")
    assert spare.sandbox is None
    spare._make = make
    second = await host.create_sandbox()  # its own, and a spare is asked for again
    assert second is not first and second.sandbox_id in host.sandboxes
    assert await _made(host) not in (first, second)


async def test_a_host_closed_as_the_interpreter_exits_still_kills_every_sandbox(
    host: Host,
) -> None:
    """An in-process daemon stopped by ``atexit`` (a notebook kernel's) finds the thread
    pool closed: every ``to_thread`` raises RuntimeError. Every sandbox's processes are
    killed all the same. (The spare's end, run first, once raised there and left the
    sandboxes alive: a notebook's processes outlived its kernel.)"""
    sandbox = await host.create_sandbox()
    process = await sandbox.start_process(ProcessSpec(argv=("sleep", "60")))
    launcher = _launcher_pid(await _made(host))
    closed = ThreadPoolExecutor()
    closed.shutdown()
    asyncio.get_running_loop().set_default_executor(closed)
    # What needs a thread after the kills (the daemon's cgroup, its root) is left to the
    # next daemon, which reclaims a dead daemon's root (daemon/recovery.py).
    with contextlib.suppress(RuntimeError):
        await host.close()
    assert not alive(process.pid) and not alive(launcher)
