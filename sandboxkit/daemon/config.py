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
    fanout: str = "cursor"
    """Default fan-out policy: ``cursor`` (immune to F1/F2), or the lab's ``blocking``/``kick``."""
    kick_queue: int = 64
    """Per-consumer queue length (chunks) of the ``kick`` policy (the envd fix's 64)."""
    blocking_queue: int = 1
    """Per-consumer queue length (chunks) of the ``blocking`` policy (a near-unbuffered
    channel, as shipped before the fix)."""
    kick_grace: float = 5.0
    """How long the ``kick`` policy's shared loop waits on a full queue before kicking."""
    ghost_buffer: int = 4096
    """Socket buffer of a pause-snapshot ghost: small, like a socket restored from a snapshot."""
    housekeeping_interval: float = 0.05
    """How often idle timeouts and result TTLs are checked."""
