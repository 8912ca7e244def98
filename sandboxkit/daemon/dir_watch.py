"""Directory watchers on Linux's inotify: what envd's ``WatchDir`` and its polling twin
(``CreateWatcher``/``GetWatcherEvents``/``RemoveWatcher``) serve to the e2b SDK's
``files.watch_dir``.

The kernel queues the events; the event loop reads them when the inotify descriptor is
readable (``add_reader``), so a watcher costs no thread and no polling. Events are envd's
(after Go's fsnotify, which envd uses): a name relative to the watched directory and one of
``create`` (also a move into it), ``write``, ``remove``, ``rename`` (a move out of it or of
the watched entry itself) and ``chmod``. A recursive watcher also watches directories
created below it from then on; a new directory is scanned once its watch is in place, so
what a process made in it before that (``mkdir d && touch d/f``) is reported too, once
(at most :data:`MAX_SCAN` entries per new directory). A recursive watch covers at most
:data:`MAX_WATCHED_DIRS` directories. Pending events are bounded (:data:`MAX_PENDING`); past it,
or when the kernel's own queue overflowed, the watcher is *broken*: it says so rather
than deliver a history with holes in it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import os
import struct
from collections import deque
from pathlib import Path

__all__ = [
    "MAX_PENDING",
    "MAX_SCAN",
    "MAX_WATCHED_DIRS",
    "DirWatcher",
    "WatchBroken",
    "WatchEvent",
    "directories",
]

MAX_PENDING = 10_000
"""Events kept for a reader that has not taken them yet; past this the watcher breaks."""
MAX_WATCHED_DIRS = 8192
"""Directories one recursive watcher watches; a larger tree is refused at the start
(ENOSPC, as the kernel says past its own watch limit) and not followed further below."""
MAX_SCAN = 1000
"""Entries reported from a new directory's scan (what was made in it before its watch)."""

_IN_MODIFY = 0x00000002
_IN_ATTRIB = 0x00000004
_IN_MOVED_FROM = 0x00000040
_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_DELETE = 0x00000200
_IN_DELETE_SELF = 0x00000400
_IN_MOVE_SELF = 0x00000800
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000
_IN_ISDIR = 0x40000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC

_MASK = (
    _IN_MODIFY
    | _IN_ATTRIB
    | _IN_MOVED_FROM
    | _IN_MOVED_TO
    | _IN_CREATE
    | _IN_DELETE
    | _IN_DELETE_SELF
    | _IN_MOVE_SELF
    | _IN_ONLYDIR
    | _IN_DONT_FOLLOW  # a symlink swapped in for a directory is not watched through
)
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)

WatchEvent = tuple[str, str]
"""``(name relative to the watched directory, kind)``; kind is ``create``, ``write``,
``remove``, ``rename`` or ``chmod``."""


class WatchBroken(Exception):
    """The watcher lost events (its queue or the kernel's overflowed) or its directory is
    gone: start a new one."""


def directories(root: Path) -> list[Path]:
    """The directories below ``root`` (symlinks not followed), at most MAX_WATCHED_DIRS
    (ENOSPC past it). Blocking: callers on the event loop run it on a thread."""
    found: list[Path] = []
    for top, dirs, _files in os.walk(root):
        dirs.sort()
        found += [Path(top) / d for d in dirs]
        if len(found) > MAX_WATCHED_DIRS:
            raise OSError(errno.ENOSPC, f"more than {MAX_WATCHED_DIRS} directories to watch")
    return found


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _kind(mask: int) -> str | None:
    if mask & (_IN_CREATE | _IN_MOVED_TO):
        return "create"
    if mask & (_IN_DELETE | _IN_DELETE_SELF):
        return "remove"
    if mask & (_IN_MOVED_FROM | _IN_MOVE_SELF):
        return "rename"
    if mask & _IN_MODIFY:
        return "write"
    if mask & _IN_ATTRIB:
        return "chmod"
    return None


class DirWatcher:
    """Watches ``root`` (and, if ``recursive``, the directories below it) on the running
    event loop. Take events with :meth:`next_events`; :meth:`close` releases the
    descriptor (idempotent). Raises NotADirectoryError/FileNotFoundError for a path that
    is not a directory. ``below``: the directories under ``root`` to watch from the start,
    found off the loop (:func:`directories`); by default the watcher walks them itself."""

    def __init__(
        self, root: Path, *, recursive: bool = False, below: list[Path] | None = None
    ) -> None:
        if not root.is_dir():
            raise NotADirectoryError(f"not a directory: {root}")
        self.root = root
        self.recursive = recursive
        self._libc = _libc()
        fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self._fd = fd
        self._dirs: dict[int, Path] = {}
        self._pending: deque[WatchEvent] = deque()
        self._scanned: dict[str, None] = {}
        """Names a scan reported created whose own create event may still arrive: that
        one is dropped (no duplicates). Insertion-ordered, bounded by MAX_PENDING."""
        self._changed = asyncio.Event()
        self.broken: str | None = None
        """Why the watcher stopped delivering (``None`` while it works)."""
        self.closed = False
        self._loop = asyncio.get_running_loop()
        try:
            self._add(root)
            if recursive:
                for directory in directories(root) if below is None else below:
                    self._add(directory, missing_ok=True)
        except BaseException:
            os.close(fd)
            raise
        self._loop.add_reader(fd, self._readable)

    def _add(self, directory: Path, missing_ok: bool = False) -> None:
        if len(self._dirs) > MAX_WATCHED_DIRS:
            return  # a tree this large is watched down to here, not further
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(directory), _MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if missing_ok:
                return
            raise OSError(err, f"inotify_add_watch {directory}: {os.strerror(err)}")
        self._dirs[wd] = directory

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError as exc:
            self._break(f"reading inotify failed: {exc}")
            return
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            start = offset + _HEADER.size
            raw = data[start : start + length].split(b"\0", 1)[0]
            offset = start + length
            self._event(wd, mask, os.fsdecode(raw))
        self._changed.set()

    def _event(self, wd: int, mask: int, name: str) -> None:
        if mask & _IN_Q_OVERFLOW:
            self._break("the kernel's event queue overflowed: events were lost")
            return
        directory = self._dirs.get(wd)
        if directory is None:
            return
        if mask & _IN_IGNORED:
            del self._dirs[wd]
            if directory == self.root:
                self._break(f"the watched directory {self.root} is gone")
            return
        if mask & (_IN_DELETE_SELF | _IN_MOVE_SELF) and directory != self.root:
            return  # reported by its parent's watch, under its name there
        path = directory / name if name else directory
        kind = _kind(mask)
        if kind is None:
            return
        relative = os.path.relpath(path, self.root)
        if kind == "create" and relative in self._scanned:
            del self._scanned[relative]  # already reported by a scan
            return
        if kind in ("remove", "rename"):
            self._scanned.pop(relative, None)
        self._report(relative, kind)
        if self.recursive and mask & _IN_ISDIR and mask & (_IN_CREATE | _IN_MOVED_TO):
            self._add(path, missing_ok=True)
            if mask & _IN_CREATE:
                self._scan(path)

    def _report(self, relative: str, kind: str) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._break(f"more than {MAX_PENDING} events were not taken: events were lost")
            return
        self._pending.append((relative, kind))

    def _scan(self, directory: Path) -> None:
        """Report what a process made in a new directory before its watch was in place
        (and watch the directories among it): bounded by MAX_SCAN entries in all."""
        todo = [directory]
        budget = MAX_SCAN
        while todo and budget > 0:
            try:
                with os.scandir(todo.pop()) as entries:
                    found = sorted(entries, key=lambda e: e.name)[:budget]
            except OSError:
                continue  # gone again: its removal is reported by the parent's watch
            budget -= len(found)
            for item in found:
                relative = os.path.relpath(item.path, self.root)
                self._scanned[relative] = None
                while len(self._scanned) > MAX_PENDING:
                    del self._scanned[next(iter(self._scanned))]
                self._report(relative, "create")
                if item.is_dir(follow_symlinks=False):
                    self._add(Path(item.path), missing_ok=True)
                    todo.append(Path(item.path))

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            self._pending.clear()
        self._changed.set()

    def take(self) -> list[WatchEvent]:
        """The events queued so far (emptied); raises WatchBroken once broken."""
        if self.broken is not None:
            raise WatchBroken(self.broken)
        if self.closed:
            raise WatchBroken("the watcher was closed")
        events = list(self._pending)
        self._pending.clear()
        self._changed.clear()
        return events

    async def next_events(self) -> list[WatchEvent]:
        """Wait for at least one event and take what is queued."""
        while True:
            events = self.take()
            if events:
                return events
            await self._changed.wait()

    def close(self) -> None:
        """Stop watching and release the descriptor. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._changed.set()
