"""sandboxkit.daemon.seccomp: the filter that refuses the kernel's keyrings to isolated
processes, run here by a small classic-BPF interpreter (every architecture's program, on
any machine) and by the kernel itself (this machine's, under bubblewrap)."""

from __future__ import annotations

import errno
import os
import platform
import shutil
import struct
import subprocess

import pytest

from sandboxkit.daemon.seccomp import KEYRING_CALLS, filter_pipe, keyring_filter

ALLOW = 0x7FFF0000
REFUSE = 0x00050000 | errno.EPERM


def run_filter(program: bytes, arch: int, nr: int) -> int:
    """What ``program`` returns for a call ``nr`` made under ``arch`` (the instructions
    the filter uses: load word, and, jump if equal, return)."""
    ops = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    data = {0: nr & 0xFFFFFFFF, 4: arch}
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ops[pc]
        if code == 0x20:
            acc = data[k]
        elif code == 0x54:
            acc &= k
        elif code == 0x15:
            pc += jt if acc == k else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
        pc += 1


@pytest.mark.parametrize("machine", sorted(KEYRING_CALLS))
def test_the_keyring_calls_are_refused_on_every_mode_and_nothing_else(machine: str) -> None:
    program = keyring_filter(machine)
    assert program is not None
    for arch, calls in KEYRING_CALLS[machine].items():
        for nr in calls:
            assert run_filter(program, arch, nr) == REFUSE, (arch, nr)
        others = set(range(512)) - set(calls)
        assert {run_filter(program, arch, nr) for nr in others} == {ALLOW}
    if machine == "x86_64":  # x32: the same numbers with bit 30 set
        assert run_filter(program, 0xC000003E, 0x40000000 | 250) == REFUSE
        assert run_filter(program, 0xC000003E, 0x40000000 | 1) == ALLOW
    assert run_filter(program, 0x12345678, 250) == ALLOW  # an architecture not known


def test_an_unknown_machine_has_no_filter() -> None:
    assert keyring_filter("pdp11") is None


@pytest.mark.skipif(
    shutil.which("bwrap") is None or platform.machine() not in KEYRING_CALLS,
    reason="bubblewrap, on a machine whose numbers are known",
)
def test_the_kernel_refuses_a_keyring_call_under_it() -> None:
    program = keyring_filter()
    assert program is not None
    keyctl = KEYRING_CALLS[platform.machine()]
    nr = next(iter(keyctl.values()))[2]
    # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING, 0): allowed, it answers an id.
    perl = f"$r = syscall({nr}, 0, -4, 0); print $r < 0 ? ($!+0) : 'id'"
    argv = ["bwrap", "--unshare-user", "--ro-bind", "/", "/", "--dev", "/dev"]
    fd = filter_pipe(program)
    try:
        refused = subprocess.run(
            [*argv, "--seccomp", str(fd), "perl", "-e", perl],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        os.close(fd)
    allowed = subprocess.run([*argv, "perl", "-e", perl], capture_output=True, text=True)
    assert (refused.stdout, allowed.stdout) == (str(errno.EPERM), "id")
