"""The wrapper every launch starts with (sandboxkit/daemon/launch.py): one ``/bin/sh``
joins the sandbox's cgroups and sets its rlimits, each to the byte, before the command
runs; a limit the shell cannot set exactly goes through ``prlimit``; a failed join runs
nothing."""

from __future__ import annotations

import subprocess

import pytest

from sandboxkit.daemon.freezer import CgroupFreezer
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.launch import JOIN_FAILED, shell_ulimit, wrapper
from sandboxkit.daemon.process import ManagedProcess, ProcessSpec
from sandboxkit.limits import Limits

_LIMITS_NAMES = {
    "fsize": "Max file size",
    "nofile": "Max open files",
    "as": "Max address space",
    "nproc": "Max processes",
}


async def _output(process: ManagedProcess) -> str:
    assert await process.wait(10) == 0
    _, chunks = process.log.read(0, 1 << 20)
    return b"".join(bytes(c.data) for c in chunks).decode()


def _limit(limits_text: str, name: str) -> list[str]:
    for line in limits_text.splitlines():
        if line.startswith(name + " "):
            return line[len(name) :].split()[:2]
    raise AssertionError(f"{name} not in {limits_text}")


async def test_limits_take_one_wrapper_and_hold_to_the_byte(host: Host) -> None:
    disk, memory = 3 << 20, 256 << 20
    sandbox = await host.create_sandbox(
        isolation="none", limits=Limits(memory=memory, pids=64, open_files=64, disk=disk)
    )
    assert sandbox.limits is not None
    joins = sandbox.tree.cgroup_joins()
    prefix = sandbox.limits.launch_prefix(joins)
    if {"fsize", "nofile"} <= shell_ulimit():
        # The cgroup joins and every rlimit in one shell: no prlimit, no second wrapper.
        assert prefix.count("/bin/sh") == 1
        assert not any("prlimit" in arg for arg in prefix)
    process = await sandbox.start_process(
        ProcessSpec(cmd="cat /proc/self/limits; echo ---; cat /proc/self/cgroup")
    )
    limits_text, cgroups = (await _output(process)).split("---\n")
    assert _limit(limits_text, "Max open files") == ["64", "64"]
    assert _limit(limits_text, "Max file size") == [str(disk)] * 2
    how = sandbox.limits.enforced()
    if how["memory"] == "rlimit":
        assert _limit(limits_text, "Max address space") == [str(memory)] * 2
    if how["pids"] == "rlimit":
        assert _limit(limits_text, "Max processes") == ["64", "64"]
    if isinstance(sandbox.tree, CgroupFreezer):
        assert sandbox.tree.path.name in cgroups, "born in the sandbox's cgroup"


async def test_a_limit_the_shell_cannot_set_exactly_goes_through_prlimit(host: Host) -> None:
    disk = (1 << 20) + 1  # no whole number of 512-byte blocks
    sandbox = await host.create_sandbox(isolation="none", limits=Limits(disk=disk))
    assert sandbox.limits is not None
    prefix = sandbox.limits.launch_prefix(sandbox.tree.cgroup_joins())
    assert any("prlimit" in arg for arg in prefix)
    process = await sandbox.start_process(ProcessSpec(cmd="cat /proc/self/limits"))
    assert _limit(await _output(process), "Max file size") == [str(disk)] * 2


def test_the_shells_ulimit_is_trusted_only_where_it_read_back_exactly() -> None:
    exact = shell_ulimit()
    assert exact <= set(_LIMITS_NAMES)
    for resource in exact:
        # What the probe trusts, a launch sets, and /proc/self/limits shows to the unit.
        value = {"fsize": 5 << 20, "nofile": 99, "as": 3 << 30, "nproc": 999}[resource]
        argv = [*wrapper([], {resource: value}), "cat", "/proc/self/limits"]
        assert not any("prlimit" in arg for arg in argv)
        done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10)
        assert _limit(done.stdout, _LIMITS_NAMES[resource]) == [str(value)] * 2


@pytest.mark.parametrize("rlimits", [{}, {"nofile": 64}])
def test_a_join_that_fails_runs_nothing(tmp_path, rlimits: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    argv = wrapper([str(tmp_path / "gone" / "cgroup.procs")], rlimits)
    done = subprocess.run(
        [*argv, "sh", "-c", "echo ran"], capture_output=True, text=True, timeout=10
    )
    assert done.returncode == JOIN_FAILED
    assert "ran" not in done.stdout
