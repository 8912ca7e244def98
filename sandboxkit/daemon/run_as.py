"""Which account a process runs as: the ``user`` an envd client names (E2B's
``commands.run(..., user=...)``), mapped onto this host's accounts.

The rule (``docs/e2b.md``):

* no user, or the daemon's own user → the daemon's user;
* ``"user"`` — the e2b SDK's default, sent even when the caller named nobody — when this
  host has no such account → the daemon's user;
* a daemon running as root and an existing account → that account: its uid, gid and
  groups, and ``HOME``/``USER``/``LOGNAME`` from its passwd entry;
* anything else (no such account; another account while the daemon is not root) → a
  typed :class:`~sandboxkit.errors.InvalidArgument`, with nothing started.
"""

from __future__ import annotations

import os
import pwd
import sys
from dataclasses import dataclass

from sandboxkit.errors import InvalidArgument

__all__ = ["SDK_DEFAULT_USER", "RunAs", "resolve_user"]

SDK_DEFAULT_USER = "user"
"""The user the e2b SDK names when its caller names none."""

# argv: uid gid groups cmd...; no site, no imports beyond os and sys: a few ms.
_DROP = (
    "import os,sys;"
    "os.setgroups([int(g) for g in sys.argv[3].split(',') if g]);"
    "os.setgid(int(sys.argv[2]));os.setuid(int(sys.argv[1]));"
    "os.execvp(sys.argv[4],sys.argv[4:])"
)


@dataclass(frozen=True)
class RunAs:
    """Another account to run a process as (the daemon is root)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def argv_prefix(self) -> list[str]:
        """An argv prefix that drops to this account, then ``exec``s the rest (same pid).

        Not ``subprocess``'s ``user=``: that changes the uid before the freezer's launch
        wrapper runs, and the wrapper must join the sandbox's cgroup as root."""
        groups = ",".join(str(g) for g in self.groups)
        return [sys.executable, "-I", "-S", "-c", _DROP, str(self.uid), str(self.gid), groups]

    def env(self) -> dict[str, str]:
        """What a login would set."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


def resolve_user(name: str | None) -> RunAs | None:
    """The account to run as for ``name`` (``None``: the daemon's own); raises
    InvalidArgument for a user this daemon cannot run a process as."""
    if not name:
        return None
    euid = os.geteuid()
    try:
        own = pwd.getpwuid(euid).pw_name
    except KeyError:  # a uid with no passwd entry (some containers)
        own = str(euid)
    if name == own:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if name == SDK_DEFAULT_USER:
            return None
        raise InvalidArgument(f"there is no user {name!r} on this host", field="user") from None
    if entry.pw_uid == euid:
        return None
    if euid != 0:
        raise InvalidArgument(
            f"the daemon runs as {own!r}, not as root, so it cannot run a process as {name!r}",
            field="user",
        )
    groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return RunAs(entry.pw_name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)
