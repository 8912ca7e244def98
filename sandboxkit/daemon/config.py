"""Daemon settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from sandboxkit.daemon.file_span import ZERO_COPY_MODES
from sandboxkit.daemon.isolation import ISOLATION_ENV
from sandboxkit.lab_options import GHOST_BUFFER

__all__ = ["SPARE_MODES", "STANDBY_MODES", "DaemonConfig", "LabDefaults"]


STANDBY_MODES: Final = ("on", "shell", "off")
"""What :attr:`DaemonConfig.standby` takes."""

SPARE_MODES: Final = ("on", "off")
"""What :attr:`DaemonConfig.spare` takes."""


@dataclass(frozen=True)
class LabDefaults:
    """What a lab sandbox's unset :class:`~sandboxkit.lab_options.LabOptions` fields take."""

    kick_queue: int = 64
    """Per-consumer queue length (chunks) of the ``kick`` policy (the envd fix's 64)."""
    blocking_queue: int = 1
    """Per-consumer queue length (chunks) of the ``blocking`` policy (a near-unbuffered
    channel, as shipped before the fix)."""
    kick_grace: float = 5.0
    """How long the ``kick`` policy's shared loop waits on a full queue before kicking."""
    ghost_buffer: int = GHOST_BUFFER
    """Socket buffer of a pause-snapshot ghost: small, like a socket restored from a snapshot."""


@dataclass
class DaemonConfig:
    """Every knob of the daemon, with defaults fit for a notebook on a laptop."""

    root_dir: Path | None = None
    """Where sandboxes get their working directories (default: a fresh temp dir)."""
    retention_bytes: int = 64 * 1024 * 1024
    """Output kept per process, on disk: in append-only segment files under the sandbox's
    runtime directory (the daemon's own, out of the sandboxes' root), removed with the
    process's result.
    The oldest output is evicted first, a segment (an eighth of this, at most 8 MiB) at a
    time. Each chunk is charged what it takes on disk (its payload, frame header and index
    record, ~130 bytes beyond the payload), so this bounds disk whatever the write pattern:
    for large writes it is about the payload kept, for 1-byte writes far less payload.
    (Beyond it, up to a sixteenth of it in the index of evicted output, for exact gap
    sizes, and one segment file kept for reuse.) Memory is ``output_cache_bytes``, not
    this: it can be raised to gigabytes."""
    output_cache_bytes: int = 8 * 1024 * 1024
    """Memory per process for its newest output (encoded frames), from which consumers that
    keep up are served; those further behind read the segment files (checked copies,
    shared by the readers at the same place: never a mapping, which a sandbox process
    shrinking the file would turn into SIGBUS).
    What a process's output costs the daemon's memory, with some kB of bookkeeping (a
    process that wrote less holds less), and more only while its slowest consumer is at
    the cache's oldest chunk: lent from a reserve the daemon's processes share
    (``daemon/lag_reserve.py``, 64 MiB in all). 8 MiB, not 1: at full producer speed the
    consumers of a fast writer drain at their sockets' pace and fall several MiB behind
    it; with 1 MiB each re-read the same chunks from the files, 21-28 % of the daemon's
    CPU at 16 consumers (py-spy), 8-9 % with 8 MiB, and the daemon's CPU per GB fanned
    out fell by about a quarter (benchmarks/compare.py, P7, ``--variant``)."""
    output_on_disk: bool = True
    """Keep output logs in segment files (above). ``False`` keeps every retained chunk in
    memory instead, as the log did before: ``retention_bytes`` then bounds memory (each
    chunk charged its payload, frame header and ~250 bytes of bookkeeping). For a system
    without a writable disk, or to compare (``benchmarks/memory.py``)."""
    result_ttl: float = 900.0
    """How long an exited process's output and exit status stay available."""
    stall_timeout: float = 10.0
    """A consumer whose send makes no progress this long while data is pending is kicked."""
    keepalive_interval: float = 2.0
    """Idle streams carry a keepalive frame this often."""
    events_wait_max: float = 25.0
    """The longest a long poll of ``GET /events?wait=`` is held open (s); a longer
    ``wait`` is cut to this."""
    kill_grace: float = 3.0
    """SIGTERM, then SIGKILL after this many seconds."""
    exit_drain: float = 1.0
    """After a process exits, wait at most this long for its pipes to close (a grandchild may
    hold them) before recording the exit."""
    shutdown_drain: float = 5.0
    """On daemon shutdown, bound on waiting for streams to finish before processes are killed."""
    read_chunk: int = 256 * 1024
    """Largest single output chunk: a read of the process's output larger than this is
    split. As large as a pipe read gets: every chunk costs each of its consumers the same
    bookkeeping whatever its size, and 64 KiB chunks cost the daemon about a tenth more
    CPU per GB fanned out at 16 consumers (benchmarks/compare.py, P7)."""
    send_batch: int = 1024 * 1024
    """Largest number of bytes a consumer hands its transport in one send, once its peer
    drains fast (a slow one's sends stay what it drains in a quarter of the stall
    timeout). The Python cost of a send is per call: 1 MiB, not 256 KiB, took about a
    tenth off the daemon's CPU per GB fanned out at 16 consumers on uvloop
    (benchmarks/compare.py, P7)."""
    send_budget: int = 64 * 1024 * 1024
    """Bytes all consumers' sends may hold at once (each holds its chunks until its peer
    took them). Up to ``send_budget // send_batch`` consumers (64) each send up to
    ``send_batch``; past that, each consumer's sends are at most this divided by the
    consumers streaming, and never less than 64 KiB: 400 consumers send up to 160 KiB."""
    journal_size: int = 20_000
    """Events kept in the journal."""
    isolation: str = field(default_factory=lambda: os.environ.get(ISOLATION_ENV, "auto"))
    """What a sandbox created without ``isolation`` gets: ``auto`` (namespaces where the
    kernel allows, else none), ``namespaces`` or ``none`` (``docs/isolation.md``)."""
    freezer: str = "auto"
    """Process-tree freezer backend: ``auto``, ``cgroup`` or ``signals``."""
    lab: LabDefaults = field(default_factory=LabDefaults)
    """Defaults for sandboxes created with fault-lab options (:mod:`sandboxkit.daemon.faults`);
    a sandbox created without them uses none of this."""
    housekeeping_interval: float = 0.05
    """How often idle timeouts and result TTLs are checked."""
    stdin_buffer: int = 1024 * 1024
    """Bytes of stdin the daemon holds for a process that does not read it; a batch beyond
    it waits (``stdin_wait``), then gets 429 ``stdin_busy`` and is not written."""
    stdin_wait: float = 5.0
    """How long a stdin batch waits for room in the buffer before ``stdin_busy``."""
    stdin_session_ttl: float = 3600.0
    """A stdin session unused this long is forgotten (its exactly-once window). A session
    whose writer ended it (every ``send_stdin`` does) is forgotten at once."""
    stdin_sessions: int = 100_000
    """Stdin sessions remembered per process. At the cap a new session evicts the least
    recently used one idle past ``stdin_session_grace``; if none is, it gets ``stdin_busy``."""
    stdin_session_grace: float = 30.0
    """A stdin session used within this many seconds is never evicted to make room (a
    writer resending after a reconnect within it is never applied twice)."""
    event_loop: str = field(default_factory=lambda: os.environ.get("SANDBOXKIT_EVENT_LOOP", "auto"))
    """``auto`` (default: uvloop when installed, ``pip install 'sandboxkit[fast]'``, else
    asyncio's own loop), ``asyncio`` or ``uvloop``; ``$SANDBOXKIT_EVENT_LOOP`` sets the
    default. On either, the daemon's CPU per GB fanned out is within 1.2x of bare uvicorn's
    on the same loop (benchmarks/compare.py, P7); uvloop's is the lower. Once opt-in
    because a pty process's stdin failed under it (fixed: the daemon writes a pty's input
    itself, tests/test_send_path.py)."""
    zero_copy: str = field(default_factory=lambda: os.environ.get("SANDBOXKIT_ZERO_COPY", "auto"))
    """Send output from the log's files with ``sendfile``, unchecked once read back
    (``sandboxkit/daemon/file_span.py``): ``auto`` (default: for isolated sandboxes only,
    while no sandbox without isolation ever ran in the daemon, since one could rewrite
    any log's files), ``on`` (every log: a daemon whose sandboxes all run trusted code)
    or ``off``; ``$SANDBOXKIT_ZERO_COPY`` sets the default."""
    standby: str = field(default_factory=lambda: os.environ.get("SANDBOXKIT_STANDBY", "on"))
    """Keep a process started ahead in each sandbox's cgroups and namespaces, so that a
    command skips the kernel's cgroup migration and bubblewrap's set-up: ``on`` (default)
    a launcher that forks every command (``sandboxkit/daemon/launcher.py``; where none was
    built at install, as ``shell``), ``shell`` a shell that one command takes
    (``sandboxkit/daemon/standby.py``), ``off`` neither; ``$SANDBOXKIT_STANDBY`` sets the
    default. One sleeping process per sandbox (docs/performance.md)."""
    spare: str = field(default_factory=lambda: os.environ.get("SANDBOXKIT_SPARE", "on"))
    """Keep one sandbox made ahead, its launcher up, for the next ``create()`` that asks
    for the defaults (``sandboxkit/daemon/spare.py``): ``on`` (default, where launchers
    are: ``standby`` on and one built at install) or ``off``; ``$SANDBOXKIT_SPARE`` sets
    the default. Made once the daemon is quiet; one sleeping sandbox (0.2 MB)."""
    http: str = field(default_factory=lambda: os.environ.get("SANDBOXKIT_HTTP", "auto"))
    """uvicorn's HTTP implementation: ``auto`` (httptools when installed, as with
    ``sandboxkit[fast]``), ``h11`` or ``httptools``; ``$SANDBOXKIT_HTTP`` sets the default."""
    max_body: int = 4 * 1024 * 1024
    """Largest request body accepted (bytes); larger ones get 413 ``payload_too_large``."""
    header_timeout: float = 3.0
    """A new connection's first request head must be whole within this many seconds of
    the accept, or the connection is closed (bytes trickling in do not extend it)."""
    keepalive_timeout: float = 5.0
    """A connection waiting for its next request is closed after this many seconds; its
    next head must be whole within them too."""
    body_timeout: float = 10.0
    """A request body that pauses this long is abandoned and its connection closed."""
    max_connections: int = 4096
    """Connections the daemon keeps open. Past it (or within ``fd_reserve`` of the
    file-descriptor limit) idle connections that never presented the token are closed; a
    newcomer finding none is answered 503 ``resource_exhausted``."""
    fd_reserve: int = 256
    """File descriptors (at most a quarter of the limit) that idle connections may not
    take: processes and files use them. A process start refused once half of it is gone
    gets 503 ``resource_exhausted``. The daemon raises its soft limit to the hard limit."""

    def __post_init__(self) -> None:
        if self.zero_copy not in ZERO_COPY_MODES:
            raise ValueError(f"zero_copy must be one of {', '.join(ZERO_COPY_MODES)}")
        if self.standby not in STANDBY_MODES:
            raise ValueError(f"standby must be one of {', '.join(STANDBY_MODES)}")
        if self.spare not in SPARE_MODES:
            raise ValueError(f"spare must be one of {', '.join(SPARE_MODES)}")
