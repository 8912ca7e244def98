"""The wrapper a sandbox's launch starts with: one ``/bin/sh`` that joins the sandbox's
cgroups and applies its rlimits, then execs the rest of the argv.

Every exec before the command is paid on every ``run``: the freezer's wrapper (join the
cgroup v2), the limits' wrapper (join the v1 ``memory``/``pids``/``cpu`` cgroups) and
``prlimit`` were three programs, ``prlimit`` alone about a millisecond of CPU (its
dynamic linking and locale set-up). Here they are one shell: each ``cgroup.procs`` gets
``$$`` before anything else runs, so every descendant is born inside, then the shell's
own ``ulimit`` sets soft and hard limits alike, then ``exec``.

``ulimit`` is not one thing across shells (its units are blocks or KiB, per option and
per shell), so this host's ``/bin/sh`` is asked once (:func:`shell_ulimit`): it sets
known values and reads them back from ``/proc/self/limits``. Where it does not answer
exactly, or a limit is no whole number of the shell's units, the launch falls back to
``prlimit`` (util-linux), as before: a limit is always applied to the byte.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Mapping
from typing import Final

__all__ = ["JOIN_FAILED", "shell_ulimit", "wrapper"]

JOIN_FAILED: Final = 126
"""The wrapper's exit code when a cgroup could not be joined or a limit not set: nothing
of the command ran."""

_SH: Final = "/bin/sh"

# What the shell's ``ulimit`` flag is for each rlimit, and the unit it counts in here
# (the probe checks both; the table is dash's and POSIX's, bash's in POSIX mode too).
_FLAGS: Final = {"fsize": ("f", 512), "nofile": ("n", 1), "as": ("v", 1024), "nproc": ("p", 1)}
_PROC_NAMES: Final = {
    "fsize": "Max file size",
    "nofile": "Max open files",
    "as": "Max address space",
    "nproc": "Max processes",
}
# Probe values: large enough that ``cat`` runs under them, each a distinct number.
_PROBE: Final = {"fsize": 3 << 20, "nofile": 77, "as": 1 << 32, "nproc": 4321}


@functools.cache
def shell_ulimit() -> frozenset[str]:
    """The rlimits (``fsize``, ``nofile``, ``as``, ``nproc``) this host's ``/bin/sh``
    sets exactly, soft and hard, with :data:`_FLAGS` (a few ms, once per daemon)."""
    # Each on its own: a flag this shell lacks (bash's ``-p`` is the pipe size) leaves
    # that limit as it was, and only that one falls back.
    sets = "; ".join(f"{_ulimit(r, v)} 2>/dev/null" for r, v in _PROBE.items())
    try:
        done = subprocess.run(
            [_SH, "-c", f"{sets}; exec cat /proc/self/limits"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    if done.returncode != 0:
        return frozenset()
    exact = set()
    for line in done.stdout.decode(errors="replace").splitlines():
        for resource, name in _PROC_NAMES.items():
            if line.startswith(name + " "):
                fields = line[len(name) :].split()
                want = str(_PROBE[resource])
                if fields[:2] == [want, want]:
                    exact.add(resource)
    return frozenset(exact)


def _ulimit(resource: str, value: int) -> str:
    flag, unit = _FLAGS[resource]
    return f"ulimit -{flag} {value // unit}"


def wrapper(joins: list[str], rlimits: Mapping[str, int]) -> list[str]:
    """The argv prefix that joins each of the ``joins`` (``cgroup.procs`` files, in
    order), applies ``rlimits`` (``prlimit`` resource names: ``as``, ``nproc``,
    ``fsize``, ``nofile``) and execs what follows; ``[]`` when there is nothing to do."""
    if not joins and not rlimits:
        return []
    exact = shell_ulimit()
    inline = {
        r: v for r, v in rlimits.items() if r in exact and r in _FLAGS and v % _FLAGS[r][1] == 0
    }
    steps = [f'for f; do shift; [ "$f" = -- ] && break; echo $$ > "$f" || exit {JOIN_FAILED}; done']
    steps += [f"{_ulimit(r, v)} || exit {JOIN_FAILED}" for r, v in inline.items()]
    argv = [_SH, "-c", "; ".join([*steps, 'exec "$@"']), "sh", *joins, "--"]
    rest = {r: v for r, v in rlimits.items() if r not in inline}
    if rest:
        # A limit the shell cannot set to the byte: prlimit does, as one more exec.
        prlimit = shutil.which("prlimit") or "prlimit"
        argv += [prlimit, *(f"--{r}={v}:{v}" for r, v in rest.items()), "--"]
    return argv
