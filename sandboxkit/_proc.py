"""Whether a process is running, by pid: the one answer the command line, the client and
the daemon share.

Kept out of ``daemon/`` so the client can ask without importing the daemon, and free of
third-party imports so asking costs one ``kill(pid, 0)`` and one small read.
"""

from __future__ import annotations

import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a running process: it exists and is not a zombie.

    ``kill(pid, 0)`` alone says yes to a zombie (an exited process nobody has reaped yet),
    which would keep a dead daemon "running" until its parent waits for it; the process's
    state in ``/proc`` tells them apart. A process of another user (``EPERM``) exists; one
    that ``/proc`` will not describe (``hidepid``) is taken to run.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False  # gone between the two looks
    except OSError:
        return True
    # The state follows the command name, which may itself contain spaces and ')'.
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X", b"x")
