"""Daemon settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DaemonConfig"]


@dataclass
class DaemonConfig:
    """Every knob of the daemon, with defaults fit for a notebook on a laptop."""

    root_dir: Path | None = None
    """Where sandboxes get their working directories (default: a fresh temp dir)."""
    retention_bytes: int = 8 * 1024 * 1024
    """Memory for output kept per process; the oldest chunks are evicted first. Each chunk
    is charged what it costs (its payload, frame header and ~220 bytes of bookkeeping), so
    this bounds memory whatever the write pattern: for large writes it is about the
    payload kept, for 1-byte writes far less payload."""
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
    stdin_buffer: int = 1024 * 1024
    """Bytes of stdin the daemon holds for a process that does not read it; a batch beyond
    it waits (``stdin_wait``), then gets 429 ``stdin_busy`` and is not written."""
    stdin_wait: float = 5.0
    """How long a stdin batch waits for room in the buffer before ``stdin_busy``."""
    stdin_session_ttl: float = 3600.0
    """A stdin session unused this long is forgotten (its exactly-once window)."""
    stdin_sessions: int = 100_000
    """Live stdin sessions per process; past it new sessions get ``stdin_busy``."""
    event_loop: str = field(
        default_factory=lambda: os.environ.get("SANDBOXKIT_EVENT_LOOP", "asyncio")
    )
    """``asyncio`` (default), ``uvloop``, or ``auto`` (uvloop when installed: ``pip install
    'sandboxkit[fast]'``); ``$SANDBOXKIT_EVENT_LOOP`` sets the default. Not uvloop by
    default: under it a pty process's stdin and an env key with a lone surrogate fail
    (tests/test_lifecycle.py, tests/test_validation.py), and it was no faster here
    (benchmarks/compare.py measures both)."""
    http: str = field(default_factory=lambda: os.environ.get("SANDBOXKIT_HTTP", "auto"))
    """uvicorn's HTTP implementation: ``auto`` (httptools when installed, as with
    ``sandboxkit[fast]``), ``h11`` or ``httptools``; ``$SANDBOXKIT_HTTP`` sets the default."""
    max_body: int = 4 * 1024 * 1024
    """Largest request body accepted (bytes); larger ones get 413 ``payload_too_large``."""
