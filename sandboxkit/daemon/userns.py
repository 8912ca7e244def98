"""A root daemon's user namespace: the one its isolated launches join, in which ``user``
(uid and gid 1000) is the host's ``nobody`` and nothing else is mapped.

Why: a root daemon must not run sandboxed code as host root (a process whose host uid is
0 passes owner checks on root's files even inside a user namespace), so each launch used
to drop to ``nobody`` with ``setpriv`` and have bubblewrap make a user namespace of its
own — one exec (1.1 ms) more per launch than bubblewrap alone. Joining a user namespace
made once (``bwrap --userns``) needs neither: bubblewrap, started as root, makes the
launch's other namespaces in it, switches to ``user`` and drops every capability before
the command runs.

What sharing it would share, and how that is closed: a user namespace keeps some things
per user, and all of a root daemon's sandboxes run as the same user in it. The kernel's
keyrings are the one that carries data (``@u``); every isolated process is refused them
(:mod:`~sandboxkit.daemon.seccomp`, as Docker and Flatpak do). The rest are counters the
host's ``nobody`` already shares (inotify instances, processes), and each launch's PID,
mount, IPC, UTS and network namespaces stay its own, so no sandbox can name another's
processes, files or sockets. The namespace's descriptor, which bubblewrap passes on to
the command, cannot be joined from inside: that takes ``CAP_SYS_ADMIN`` in it.

Made by ``unshare --user`` (util-linux, as ``setpriv`` is), whose maps the daemon writes
as root, and which exits once the namespace's descriptor is open; made when the first
isolated sandbox is, and checked once with bubblewrap. Where it cannot be had (no
``unshare``, a bubblewrap that will not join it, a daemon that is not root, a machine
whose keyring calls the filter does not know), launches keep the ``setpriv`` path.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

from sandboxkit.daemon.isolation import SANDBOX_HOST_UID, USER_UID, probe
from sandboxkit.daemon.off_loop import off_loop
from sandboxkit.daemon.seccomp import keyring_filter

__all__ = ["DaemonUserns", "make_userns"]


def make_userns() -> int | None:
    """A new user namespace in which :data:`USER_UID` is :data:`SANDBOX_HOST_UID`, held by
    the descriptor returned; None where it cannot be made (not root, no ``unshare``).
    Blocking: a few milliseconds."""
    if os.geteuid() != 0 or (unshare := shutil.which("unshare")) is None:
        return None
    try:
        maker = subprocess.Popen(
            [unshare, "--user", "/bin/sh", "-c", "echo; read done"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return None
    fd: int | None = None
    try:
        assert maker.stdout is not None
        if maker.stdout.readline() == b"\n":  # it runs in its new user namespace
            ids = f"{USER_UID} {SANDBOX_HOST_UID} 1\n"
            Path(f"/proc/{maker.pid}/uid_map").write_text(ids)
            Path(f"/proc/{maker.pid}/setgroups").write_text("deny")
            Path(f"/proc/{maker.pid}/gid_map").write_text(ids)
            fd = os.open(f"/proc/{maker.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        fd = None
    finally:
        maker.communicate(timeout=10)  # its stdin closed: it exits
    return fd


def _joined(fd: int) -> bool:
    """Whether bubblewrap runs a command as ``user`` in the namespace ``fd``."""
    bwrap = probe().bwrap
    if bwrap is None:
        return False
    ids = ["--uid", str(USER_UID), "--gid", str(USER_UID)]
    check = [bwrap, "--userns", str(fd), "--unshare-pid", *ids, "--ro-bind", "/", "/", "--",
             "/bin/sh", "-c", "exit 0"]  # fmt: skip
    try:
        done = subprocess.run(check, pass_fds=(fd,), capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


class DaemonUserns:
    """The daemon's user namespace, made (off the loop) when first asked for, closed with
    the daemon."""

    def __init__(self) -> None:
        self._asked: asyncio.Task[int | None] | None = None

    async def get(self) -> int | None:
        """Its descriptor, or None where it cannot be had (then launches keep
        ``setpriv``)."""
        if self._asked is None:
            self._asked = asyncio.get_running_loop().create_task(off_loop(_made))
        return await asyncio.shield(self._asked)

    async def close(self) -> None:
        """Close it (after it is made, if that is under way: a thread is not cancelled)."""
        if self._asked is not None:
            fd = (await asyncio.gather(self._asked, return_exceptions=True))[0]
            if isinstance(fd, int):
                os.close(fd)
        self._asked = None


def _made() -> int | None:
    if keyring_filter() is None:
        # No filter for this architecture (sandboxkit/daemon/seccomp.py): sandboxes that
        # shared the namespace would share its keyrings. Each launch keeps its own.
        return None
    fd = make_userns()
    if fd is not None and not _joined(fd):
        os.close(fd)
        return None
    return fd
