"""Daemon settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DaemonConfig"]


@dataclass
class DaemonConfig:
    """Every knob of the daemon, with defaults fit for a notebook on a laptop."""

    root_dir: Path | None = None
    """Where sandboxes get their working directories (default: a fresh temp dir)."""
    retention_bytes: int = 8 * 1024 * 1024
    """Output kept per process; the oldest chunks are evicted first."""
    result_ttl: float = 900.0
    """How long an exited process's output and exit status stay available."""
    stall_timeout: float = 10.0
    """A consumer whose send makes no progress this long while data is pending is kicked."""
    keepalive_interval: float = 2.0
    """Idle streams carry a keepalive frame this often."""
    kill_grace: float = 3.0
    """SIGTERM, then SIGKILL after this many seconds."""
    exit_drain: float = 1.0
    """After a process exits, wait at most this long for its pipes to close (a grandchild may
    hold them) before recording the exit."""
    shutdown_drain: float = 5.0
    """On daemon shutdown, bound on waiting for streams to finish before processes are killed."""
    read_chunk: int = 64 * 1024
    """Largest single output chunk."""
    send_batch: int = 256 * 1024
    """Largest number of bytes a consumer hands its transport in one send."""
    journal_size: int = 20_000
    """Events kept in the journal."""
    freezer: str = "auto"
    """Process-tree freezer backend: ``auto``, ``cgroup`` or ``signals``."""
    housekeeping_interval: float = 0.05
    """How often idle timeouts and result TTLs are checked."""
