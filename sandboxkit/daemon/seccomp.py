"""The seccomp filter every isolated process runs under: the kernel's keyrings refused.

A keyring is not a namespace of its own: what a user namespace keeps per user (the ``@u``
keyring, the ``@us`` session keyring it starts with) is shared by every process of that
user in it, and a root daemon's sandboxes share one user namespace
(:mod:`~sandboxkit.daemon.userns`). Docker's default profile and Flatpak's refuse
``add_key``, ``keyctl`` and ``request_key`` for the same reason, with ``EPERM``; so does
this filter, and lets every other call through.

bubblewrap loads it (``--seccomp FD``: a classic BPF program, as libseccomp exports one,
read from a pipe each launch), just before it runs the command. It is written here by
hand, not generated: a dozen instructions, for the architectures whose numbers are below
— each with its 32-bit compatibility mode, since a 64-bit process can make 32-bit calls
(``int 0x80``) and must not get past that way. On any other architecture no filter is
loaded, and ``docs/isolation.md`` says so.
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import struct
from typing import Final

__all__ = ["KEYRING_CALLS", "filter_pipe", "keyring_filter"]

# The architectures of seccomp_data.arch (linux/audit.h) and, for each, the numbers of
# add_key, request_key and keyctl (the kernel's syscall tables).
KEYRING_CALLS: Final[dict[str, dict[int, tuple[int, int, int]]]] = {
    "x86_64": {0xC000003E: (248, 249, 250), 0x40000003: (286, 287, 288)},
    "aarch64": {0xC00000B7: (217, 218, 219), 0x40000028: (309, 310, 311)},
}
_X32_BIT: Final = 0x40000000
"""x86_64's x32 calls are its own numbers with this bit set: masked off before the test."""

# Classic BPF, as <linux/filter.h> and <linux/seccomp.h> spell it.
_LD_W_ABS: Final = 0x20
_JEQ_K: Final = 0x15
_AND_K: Final = 0x54
_RET_K: Final = 0x06
_NR: Final = 0  # offsetof(struct seccomp_data, nr)
_ARCH: Final = 4  # offsetof(struct seccomp_data, arch)
_ALLOW: Final = 0x7FFF0000
_REFUSE: Final = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@functools.cache
def keyring_filter(machine: str | None = None) -> bytes | None:
    """The filter for ``machine`` (this one's, by default), or None where its numbers are
    not known here. For each architecture in turn: if it is the calling one, refuse the
    three calls and allow the rest; an architecture not listed is allowed everything."""
    arches = KEYRING_CALLS.get(machine or platform.machine())
    if arches is None:
        return None
    program: list[bytes] = []
    for arch, calls in arches.items():
        block = [_op(_LD_W_ABS, _NR)]
        if arch == 0xC000003E:
            block.append(_op(_AND_K, ~_X32_BIT & 0xFFFFFFFF))
        for i, nr in enumerate(calls):
            # Equal: on to the refusal, past the tests left and the allow.
            block.append(_op(_JEQ_K, nr, jt=len(calls) - i, jf=0))
        block += [_op(_RET_K, _ALLOW), _op(_RET_K, _REFUSE)]
        # Another architecture: past this block, to the next test (or the last allow).
        program += [_op(_LD_W_ABS, _ARCH), _op(_JEQ_K, arch, jt=0, jf=len(block)), *block]
    program.append(_op(_RET_K, _ALLOW))
    return b"".join(program)


def filter_pipe(program: bytes) -> int:
    """A pipe's read end holding ``program`` whole (its writer closed), for bwrap's
    ``--seccomp``: the caller passes it to one launch and closes it after the spawn."""
    read, write = os.pipe2(os.O_CLOEXEC)
    try:
        os.write(write, program)  # a few hundred bytes: a pipe takes them at once
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return read
