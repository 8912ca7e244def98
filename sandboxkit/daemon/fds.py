"""The daemon's file-descriptor budget.

Every connection, every process (its pipes) and every open segment file takes a file
descriptor, and the limit is per process: the usual soft limit of 1,024 is reached by
about a thousand idle connections from any local process, or about 333 live processes. At
the limit ``accept`` fails (the kernel keeps the connection in its backlog, unanswered)
and a process start fails as if its command were bad. So the daemon raises its soft
limit to the hard limit when it starts, and keeps a reserve below it: connections that
would eat into it shed idle ones (:mod:`sandboxkit.daemon.http.connections`), and a process
start that would eat into the half of it kept for connections is refused with the
retryable :class:`~sandboxkit.errors.ResourceExhausted` (HTTP 503) before anything is
spawned; it succeeds again once descriptors are given back.

How many descriptors are open is read the cheap way: the kernel hands out the lowest free
number, so a new descriptor's number is a lower bound of how many are open.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from sandboxkit.errors import ResourceExhausted

__all__ = ["FdBudget", "exhausted", "lowest_free_fd", "raise_fd_limit"]


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; the new soft limit.
    (Sandbox processes inherit it.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):
            pass
    return soft


def lowest_free_fd() -> int:
    """The number the next descriptor would get: at least that many are open."""
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return fd


@dataclass(frozen=True)
class FdBudget:
    """Thresholds below the soft limit, from ``reserve`` descriptors (at most a quarter
    of the limit)."""

    limit: int
    reserve: int

    @classmethod
    def current(cls, reserve: int) -> FdBudget:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)
        return cls(limit, max(8, min(reserve, limit // 4)))

    @property
    def shed_at(self) -> int:
        """A new connection whose descriptor is at least this sheds idle connections."""
        return self.limit - self.reserve

    @property
    def spawn_at(self) -> int:
        """No process starts once the lowest free descriptor is at least this."""
        return self.limit - self.reserve // 2

    @property
    def refuse_at(self) -> int:
        """A new connection whose descriptor is at least this, with nothing left to shed,
        is answered 503 and closed."""
        return self.limit - self.reserve // 4

    def check_spawn(self) -> None:
        """ResourceExhausted if starting a process would eat into the connections'
        reserve."""
        try:
            free = lowest_free_fd()
        except OSError as exc:
            raise exhausted(self.limit) from exc
        if free >= self.spawn_at:
            raise exhausted(self.limit)


def exhausted(limit: int) -> ResourceExhausted:
    """The error of a request refused for want of file descriptors."""
    return ResourceExhausted(
        f"the daemon is out of file descriptors (limit {limit}): too many processes or "
        "connections are open; retry once some have ended",
        resource="file_descriptors",
        limit=limit,
    )
