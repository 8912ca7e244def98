"""A run of whole ``data`` frames as they sit in a segment file, to be sent without
passing through Python: what a consumer behind the output cache gets instead of chunks,
when its log's files are private (issue 22, zero-copy fan-out).

A segment's frames file holds exactly the bytes a client gets (each chunk's frame head,
then its payload, back to back: :mod:`~sandboxkit.daemon.segment_store`), so the frames
of chunks ``first_seq .. end_seq - 1`` are the file's bytes ``position ..
position + size``, sent with ``os.sendfile`` (:mod:`~sandboxkit.daemon.sendfile_writer`).

Why the daemon may send bytes it does not look at, and what happens when the file
changes anyway:

* Spans are only made for logs whose files no sandboxed process can reach: a sandbox in
  its namespaces sees an empty tmpfs where the daemon's runtime directory is
  (``docs/isolation.md``). What is left is the disk: the store checks every frame (its
  CRC, its header) the first time a reader reaches it after it left the log's memory
  cache, with one copy shared by all readers (``Segment.verified``), before any span
  covers it. A frame still in the cache was written moments ago by the daemon, which
  still holds its bytes, to a file no one else writes: it is sent unchecked (reading it
  back to check it cost as much as the copy that ``sendfile`` saves, and readers that
  keep up would pay it for nothing). After the check, the bytes can change only if
  someone writes the file, which no one can. A sandbox without isolation runs as the
  daemon's user and could overwrite a checked frame in place, of its own log or any
  other's: once one has run (:func:`unisolated_ran`), every log is served by the copy
  path, which checks every byte it sends (``OutputLog.zero_copy``,
  :func:`files_private`), unless the operator vouches for every sandbox's code
  (``DaemonConfig.zero_copy = "on"``).
* A span holds its own descriptor of the file (:attr:`fd`, a ``dup``), so the segment
  may be evicted while it is being sent: the store then unlinks the file instead of
  writing the next segment over it (``Segment.pins``), and the span goes on reading the
  old file, unchanged.
* Shrinking a file under ``sendfile`` is harmless to the daemon (``sendfile`` returns a
  short count, never ``SIGBUS``: nothing is mapped). The store checks the file's size
  when it makes a span; a file shrunk after that makes the send stop short, and the
  writer then ends the connection instead of letting a torn frame through (the client
  reattaches from its cursor, and the next read finds the damage and reports an exact
  gap, :class:`~sandboxkit.daemon.segment_store.SegmentDamaged`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "SPAN_MIN",
    "ZERO_COPY_MODES",
    "FileSpan",
    "Pin",
    "files_private",
    "unisolated_ran",
    "zero_copy_check",
]

SPAN_MIN = 256 * 1024
"""A reader in the log's memory cache gets a span only for this much output or more:
``sendfile`` costs the kernel what a copy does for a 64 KiB chunk, and half of it from
1 MiB on (loopback, measured), while a span costs more Python than chunks: a reader
that keeps up (a chunk per wake) is served from memory, one behind from the files."""

ZERO_COPY_MODES = ("auto", "on", "off")
"""``DaemonConfig.zero_copy``: ``auto`` (the logs of isolated sandboxes, while no
sandbox without isolation ever ran in the daemon), ``on`` (every log: for a daemon
whose sandboxes all run trusted code) or ``off``."""

_unisolated = False


def unisolated_ran() -> None:
    """A sandboxed process runs without isolation, as the daemon's user, seeing the
    daemon's files: from now on no log of this daemon process may be sent unchecked (it
    could write any sandbox's segment files, whichever sandbox it belongs to)."""
    global _unisolated
    _unisolated = True


def files_private() -> bool:
    """No sandboxed process of this daemon process ever ran where it could reach the
    segment files (every one in its namespaces)."""
    return not _unisolated


def _trusted() -> bool:
    return True


def zero_copy_check(mode: str, isolated: bool) -> Callable[[], bool] | None:
    """What a log's ``zero_copy`` is, for a process of a sandbox (``isolated`` or not)
    under the daemon's ``zero_copy`` mode (:data:`ZERO_COPY_MODES`)."""
    if mode == "on":
        return _trusted
    return files_private if mode == "auto" and isolated else None


class Pin(Protocol):
    """What a span keeps from being written over while it is sent (its segment)."""

    pins: int


@dataclass(slots=True, eq=False)
class FileSpan:
    """Frames of chunks ``first_seq .. end_seq - 1``: ``size`` bytes of the file ``fd``
    from ``position`` on, holding ``payload`` bytes of output that end at byte offset
    ``end_offset`` of the process's output."""

    fd: int
    position: int
    size: int
    first_seq: int
    count: int
    payload: int
    end_offset: int
    pin: Pin

    def __len__(self) -> int:
        return self.size

    @property
    def end_seq(self) -> int:
        return self.first_seq + self.count

    def read(self) -> bytes | None:
        """The span's bytes, copied (for a transport that cannot ``sendfile``); ``None``
        if the file no longer holds them all (shrunk): nothing of it may be sent."""
        data = os.pread(self.fd, self.size, self.position)
        while len(data) < self.size:
            more = os.pread(self.fd, self.size - len(data), self.position + len(data))
            if not more:
                return None
            data += more
        return data

    def close(self) -> None:
        """Let go of the file (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.pin.pins -= 1
