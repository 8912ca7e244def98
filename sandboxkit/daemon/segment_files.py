"""The files of a segment store (:mod:`sandboxkit.daemon.segment_store`): opened safely,
written gathered, read back with ``pread`` through a small shared set of descriptors, and
removed off the event loop when large.

Everything here treats the files as untrusted (see that module): never opened through a
symlink, never blocking on a FIFO put in a segment's place, always a regular file.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import stat
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandboxkit.daemon.off_loop import on_executor

__all__ = [
    "READERS",
    "open_file",
    "pread",
    "pread_into",
    "remove",
    "remove_tree",
    "unlink",
    "write_all",
]

_IOV_MAX = 1024


def write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    # Gathered, not joined: a 64 KiB payload is copied once, into the page cache.
    start = 0
    while start < len(parts):
        batch = parts[start : start + _IOV_MAX]
        written = os.writev(fd, batch)
        start += len(batch)
        size = sum(len(p) for p in batch)
        if written < size:  # short write (rare on a regular file): the rest by hand
            rest = memoryview(b"".join(batch))[written:]
            while rest:
                rest = rest[os.write(fd, rest) :]


_REMOVE_IN_THREAD = 64 << 20
"""A store with more than this on disk is deleted off the event loop (~60 ms per GiB)."""


_REMOVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandboxkit-remove")
"""Deletes large stores in the background, one directory after the other (so the removal
of a directory and of the one holding it never race). Its thread starts on first use and
is joined at interpreter exit."""


def remove(directory: Path, size: int) -> None:
    if size <= _REMOVE_IN_THREAD:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        try:
            _REMOVER.submit(shutil.rmtree, directory, True)
        except RuntimeError:  # the interpreter is exiting (sandboxkit/daemon/off_loop.py)
            shutil.rmtree(directory, ignore_errors=True)


async def remove_tree(directory: str | os.PathLike[str]) -> None:
    """Delete ``directory`` and what is in it, off the event loop, after the large stores
    closed before (a sandbox's runtime directory, once its logs are closed)."""
    await on_executor(_REMOVER, functools.partial(shutil.rmtree, directory, True))


_SAFE = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK


def open_file(path: str, flags: int) -> int:
    """Open one of the store's files: never through a symlink, never blocking (a FIFO),
    and only if it is a regular file."""
    fd = os.open(path, flags | _SAFE, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _ReadFiles:
    """Files open for reading, shared by every store of the daemon: the most recently read
    :data:`_READ_FILES` of them, so a reader catching up does not open its segment for
    every batch (an open cost as much as the read), and a daemon with many logs does not
    run out of descriptors. Reads are of recent data (the page cache) and at most about a
    send batch: fast enough for the event loop."""

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        fd = open_file(path, os.O_RDONLY)
        self._fds[path] = fd
        if len(self._fds) > _READ_FILES:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def forget(self, path: str) -> None:
        """``path`` is about to be removed or renamed."""
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def forget_all(self, prefix: str) -> None:
        for path in [p for p in self._fds if p.startswith(prefix)]:
            self.forget(path)


_READ_FILES = 32
READERS = _ReadFiles()


def unlink(path: str) -> None:
    READERS.forget(path)
    with contextlib.suppress(OSError):
        os.unlink(path)


def pread_into(path: str, buffer: bytearray, size: int, offset: int) -> memoryview:
    """Read ``size`` bytes of ``path`` at ``offset`` into ``buffer``; a view of what was
    read (shorter if the file is shorter now)."""
    fd = READERS.fd(path)
    view = memoryview(buffer)[:size]
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            break
        got += n
    return view[:got]


def pread(path: str, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset`` of ``path``, or fewer if the file is shorter now."""
    fd = READERS.fd(path)
    data = os.pread(fd, size, offset)
    while len(data) < size:
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data
