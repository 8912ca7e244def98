"""A root daemon on a hybrid host holds a sandbox's limits in v1 cgroups of its own
(sandboxkit/daemon/limits.py): they go with the sandbox, also when a process in them is
still on its way out as the sandbox is killed, and what could not go then goes once it
can, by the daemon's end at the latest."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from support import daemon_cgroups, fast_config, poll

from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.limits import Limits

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="v1 limit cgroups are a root daemon's")


async def _limited_process(host: Host) -> tuple[ManagedSandbox, list[Path]]:
    """A sandbox with v1 limit cgroups (or the test skips) and the cgroups of a process
    running in it."""
    sandbox = await host.create_sandbox(limits=Limits(memory="64M", pids=64))
    enforced = sandbox.limits.enforced() if sandbox.limits is not None else {}
    if "cgroup-v1" not in enforced.values():
        pytest.skip(f"no v1 limit cgroups here: {enforced}")
    process = await sandbox.start_process(ProcessSpec(cmd="exec sleep 60"))
    cgroup = Path(f"/proc/{process.pid}/cgroup")
    return sandbox, await poll(lambda: daemon_cgroups(cgroup.read_text(), v2=False))


async def test_the_v1_cgroups_of_a_sandbox_that_ran_out_of_memory_go_with_it() -> None:
    """Past the memory limit the kernel's OOM killer ends a process, and what is left in
    the cgroup leaves it slowly (reclaiming at the limit, bubblewrap's namespace init
    tearing its namespaces down): the sandbox's kill waits for it rather than leave the
    cgroups behind. Seen in CI: one memory cgroup left per run of the OOM test."""
    async with Host(fast_config(isolation="namespaces")) as host:
        for _ in range(5):  # a kill raced the leaving in most runs of three
            sandbox, dirs = await _limited_process(host)
            hog = await sandbox.start_process(
                ProcessSpec(cmd="python3 -c 'b = bytearray(512 * 1024 * 1024)'")
            )
            assert await hog.wait(10) == -9
            await sandbox.kill()
            assert [d for d in dirs if d.exists()] == []


async def test_a_v1_cgroup_still_held_at_the_kill_goes_once_it_can() -> None:
    """A process the kill did not end (one put there from outside) keeps the cgroup past
    the kill; it goes by the host's close, once that process is gone."""
    async with Host(fast_config()) as host:
        sandbox, dirs = await _limited_process(host)
        outsider = await asyncio.create_subprocess_exec("sleep", "60")
        try:
            for directory in dirs:
                (directory / "cgroup.procs").write_text(str(outsider.pid))
            await sandbox.kill()
            assert all(d.exists() for d in dirs), "removed while a process was in it"
        finally:
            outsider.kill()
            await outsider.wait()
    assert [d for d in dirs if d.exists()] == []
    assert [d.parent for d in dirs if d.parent.exists()] == [], "the daemon's own"
