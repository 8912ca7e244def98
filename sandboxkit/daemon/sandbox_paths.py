"""A sandbox's paths as its processes see them, and opening them without ever leaving
the sandbox or blocking: the one path model both files APIs (sandboxkit's own,
:mod:`sandboxkit.daemon.files`, and envd's, :mod:`sandboxkit.daemon.envd`) use.

**The model** (E2B's view): ``/home/user`` is the sandbox's working directory and
``/tmp`` its private temporary directory (``ManagedSandbox.tmpdir``); a relative path is
relative to ``/home/user``; an absolute host path inside either directory is accepted
too (what this API answered before it spoke sandbox paths). Anything else is
InvalidArgument "outside the sandbox's writable space", naming the path. Answers name
files by their sandbox path (``/home/user/x.txt``).

**Resolution** happens beneath the directory, in the kernel: ``openat2`` with
``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`` where the kernel has it (Linux 5.6+), else a
walk of one ``openat(O_NOFOLLOW)`` per component from a directory descriptor, reading
each symlink and refusing one that climbs out. Either way a symlink or ``..`` that
leads outside is refused *at the moment of the open*, so a sandboxed process swapping a
link under a request (TOCTOU) can make it fail but never make it reach outside.
Symlinks that stay beneath are followed.

**No blocking.** Opens carry ``O_NONBLOCK`` (a FIFO opens at once instead of waiting
for its peer) and anything but a regular file or directory — a FIFO, a socket, a device
— is refused with InvalidArgument (``reason`` ``not_regular``). The callers run this
module's functions off the event loop (:func:`off_loop`) within
:data:`FILE_OP_DEADLINE`.

**Names** that are not UTF-8 are escaped, so answers are always valid JSON and names
round-trip: each byte of an invalid sequence becomes ``\\xNN`` (two lowercase hex digits,
``80``-``ff``) and a literal backslash becomes ``\\\\``. A path given in a request is
unescaped the same way (``\\xNN`` for ``NN`` ≥ 80 and ``\\\\``; any other backslash is
literal).

**Errors**: every ``OSError`` becomes a typed error naming the sandbox path:
``ENOENT``/``ENOTDIR`` → FileNotFound; anything else (``ENAMETOOLONG``, ``ELOOP``,
``EISDIR``, ``EACCES``, ``ENOSPC`` …) → InvalidArgument with ``field="path"``, the
path, and ``reason`` the errno's name.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sandboxkit.daemon import off_loop as blocking
from sandboxkit.errors import FileNotFound, InvalidArgument, SandboxkitError

__all__ = [
    "CHUNK",
    "FILE_OP_DEADLINE",
    "HOME",
    "MAX_LIST_DEPTH",
    "MAX_LIST_ENTRIES",
    "NAME_MAX",
    "TMP",
    "Located",
    "fs_error",
    "locate",
    "off_loop",
    "outside",
    "remove_directory",
    "unescape",
    "wire_name",
]

HOME = "/home/user"
"""Where a sandbox's processes see its working directory (E2B's home)."""
TMP = "/tmp"
"""Where a sandbox's processes see its private temporary directory."""

CHUNK = 256 * 1024
"""Bytes read or written per system call when streaming a file."""
FILE_OP_DEADLINE = 30.0
"""Seconds one file operation may take off the event loop before the request fails."""
MAX_LIST_DEPTH = 64
"""Deepest level envd's ``ListDir`` descends to: a larger ``depth`` is taken as this."""
MAX_LIST_ENTRIES = 100_000
"""Entries one listing may return; a tree with more is refused (list a smaller depth)."""
NAME_MAX = 255
"""Longest path component, in bytes (Linux's, on every common file system)."""
MAX_SYMLINKS = 40
"""Symlinks followed while resolving one path (the kernel's own bound): past it, ELOOP."""

_O_PATH = getattr(os, "O_PATH", 0o10000000)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture (a post-5.1 syscall)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_HAVE_OPENAT2 = True
"""Whether to try ``openat2`` (cleared at the first ENOSYS/EPERM: an old kernel, or a
seccomp filter that forbids it)."""


# -- names -----------------------------------------------------------------------------

_ESCAPE_IN = re.compile(r"\\\\|\\x([89a-f][0-9a-f])")


def wire_name(raw: bytes | str) -> str:
    """A file name or path as answers carry it: UTF-8 text, each byte of an invalid
    sequence as ``\\xNN``, a backslash as ``\\\\``. ``str`` input is taken as decoded
    with ``surrogateescape`` (what ``os`` returns)."""
    text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
    text = text.replace("\\", "\\\\")
    return "".join(f"\\x{ord(c) - 0xDC00:02x}" if "\udc80" <= c <= "\udcff" else c for c in text)


def unescape(path: str) -> bytes:
    """The bytes a path given in a request names (the inverse of :func:`wire_name`)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "\\\\":
            return "\\"
        return chr(0xDC00 + int(match.group(1), 16))

    try:
        return _ESCAPE_IN.sub(one, path).encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise InvalidArgument(
            f"{path!r} is not a valid path (lone surrogates)", field="path", reason="encoding"
        ) from None


# -- the model -------------------------------------------------------------------------


@dataclass(frozen=True)
class Located:
    """A path resolved to one of the sandbox's directories, not yet opened."""

    root: Path
    """The host directory: the sandbox's working directory or its tmpdir."""
    base: str
    """Its sandbox path: :data:`HOME` or :data:`TMP`."""
    parts: tuple[bytes, ...]
    """The components beneath ``root`` (``..`` kept: the kernel resolves them)."""

    @property
    def shown(self) -> str:
        """The sandbox path, as answers and error messages name it."""
        if not self.parts:
            return self.base
        return self.base + "/" + "/".join(wire_name(p) for p in self.parts)

    @property
    def name(self) -> str:
        """The last component (the base's own name for the root)."""
        return wire_name(self.parts[-1]) if self.parts else self.base.rsplit("/", 1)[-1]

    @property
    def is_root(self) -> bool:
        """Whether this names the directory itself."""
        return not self.parts

    def child(self, name: bytes) -> Located:
        """An entry of this directory."""
        return Located(self.root, self.base, (*self.parts, name))

    def parent(self) -> Located:
        """The directory holding this entry (callers check :attr:`is_root` first)."""
        return Located(self.root, self.base, self.parts[:-1])

    # -- operations (blocking: run them off the event loop) -----------------------------

    def open(self, flags: int, mode: int = 0o666, *, named: str | None = None) -> int:
        """A descriptor for this path opened with ``flags`` (``O_CLOEXEC`` and
        ``O_NONBLOCK`` added), resolved beneath the root; typed errors naming ``named``
        (default: this path)."""
        try:
            root = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise fs_error(exc, self.base) from None
        # openat2 refuses O_PATH with any flag but these (open(2) ignores the rest).
        extra = os.O_CLOEXEC if flags & _O_PATH else os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = _open_beneath(root, self.parts, flags | extra, mode)
            if flags & os.O_CREAT:
                _adopt(root, fd=fd)
            return fd
        except OSError as exc:
            raise fs_error(exc, named or self.shown) from None
        finally:
            os.close(root)

    def open_parent(self) -> int:
        """The directory holding this entry, opened (errors name this path)."""
        return self.parent().open(_O_PATH | os.O_DIRECTORY, named=self.shown)

    def lstat(self) -> os.stat_result:
        """This path's own status (a symlink's, not its target's)."""
        if self.is_root or self.parts[-1] in (b".", b".."):
            fd = self.open(_O_PATH)
            try:
                return os.fstat(fd)
            finally:
                os.close(fd)
        parent = self.open_parent()
        try:
            return os.stat(self.parts[-1], dir_fd=parent, follow_symlinks=False)
        except OSError as exc:
            raise fs_error(exc, self.shown) from None
        finally:
            os.close(parent)

    def stat(self) -> os.stat_result:
        """This path's status, following symlinks that stay beneath the root."""
        fd = self.open(_O_PATH)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def readlink(self) -> str:
        """A symlink's target, escaped as names are."""
        parent = self.open_parent()
        try:
            return wire_name(os.readlink(self.parts[-1], dir_fd=parent))
        except OSError as exc:
            raise fs_error(exc, self.shown) from None
        finally:
            os.close(parent)

    def open_regular(self, flags: int, mode: int = 0o666) -> int:
        """:meth:`open`, refusing a directory (EISDIR) and anything that is not a regular
        file — a FIFO, a socket, a device (``reason`` ``not_regular``)."""
        try:
            fd = self.open(flags, mode)
        except InvalidArgument as exc:
            if exc.reason == "ENXIO":  # a FIFO opened for writing with no reader
                raise self.not_regular("a FIFO or socket") from None
            raise
        try:
            kind = os.fstat(fd).st_mode
            if stat.S_ISDIR(kind):
                raise InvalidArgument(
                    f"{self.shown} is a directory", field="path", path=self.shown, reason="EISDIR"
                )
            if not stat.S_ISREG(kind):
                raise self.not_regular(_kind_name(kind))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def not_regular(self, what: str) -> InvalidArgument:
        """The error for a path that is not a regular file."""
        return InvalidArgument(
            f"{self.shown} is {what}, not a regular file: the files API reads and writes "
            "regular files only",
            field="path",
            path=self.shown,
            reason="not_regular",
        )

    def make_parents(self) -> None:
        """Create the directories above this path that are missing (``mkdir -p``)."""
        for depth in range(1, len(self.parts)):
            Located(self.root, self.base, self.parts[:depth]).make_dir(exist_ok=True)

    def make_dir(self, *, exist_ok: bool) -> bool:
        """Create this directory (its parent must exist); False if it already was one."""
        if self.is_root or self.parts[-1] in (b".", b".."):
            return False
        parent = self.open_parent()
        try:
            os.mkdir(self.parts[-1], 0o777, dir_fd=parent)
            _adopt(parent, name=self.parts[-1])
            return True
        except FileExistsError:
            if not exist_ok:
                raise fs_error(FileExistsError(errno.EEXIST, "File exists"), self.shown) from None
            if not stat.S_ISDIR(self.stat().st_mode):
                not_dir = NotADirectoryError(errno.ENOTDIR, "Not a directory")
                raise fs_error(not_dir, self.shown) from None
            return False
        except OSError as exc:
            raise fs_error(exc, self.shown) from None
        finally:
            os.close(parent)

    def remove(self) -> None:
        """Remove this file, symlink or directory tree. Iterative and without holding a
        descriptor per level, so no tree is too deep for it; every directory is opened
        afresh beneath the root, so a symlink swapped in is removed, never followed."""
        stack = [self]
        # A process that keeps making directories must not keep this thread forever.
        deadline = time.monotonic() + FILE_OP_DEADLINE
        while stack:
            if time.monotonic() > deadline:
                raise InvalidArgument(
                    f"{self.shown}: not removed within {FILE_OP_DEADLINE:g} s",
                    field="path",
                    path=self.shown,
                    reason="deadline",
                )
            current = stack[-1]
            try:
                if not stat.S_ISDIR(current.lstat().st_mode):
                    current.unlink(directory=False)
                    stack.pop()
                    continue
                entries = list(current.scandir())
            except FileNotFound:
                stack.pop()  # gone already
                continue
            below = [current.child(n) for n, own in entries if stat.S_ISDIR(own.st_mode)]
            if below:
                stack += below
                continue
            for name, _own in entries:
                current.child(name).unlink(directory=False)
            try:
                current.unlink(directory=True)
            except InvalidArgument as exc:
                if exc.reason == "ENOTEMPTY":
                    continue  # a process added to it meanwhile: empty it again
                raise
            stack.pop()

    def unlink(self, *, directory: bool) -> None:
        """``unlink`` (or ``rmdir``) this entry in its parent."""
        parent = self.open_parent()
        try:
            if directory:
                os.rmdir(self.parts[-1], dir_fd=parent)
            else:
                os.unlink(self.parts[-1], dir_fd=parent)
        except FileNotFoundError:
            pass  # gone already: what was asked
        except OSError as exc:
            raise fs_error(exc, self.shown) from None
        finally:
            os.close(parent)

    def scandir(self) -> Iterator[tuple[bytes, os.stat_result]]:
        """A directory's entries (name, own status), by name."""
        fd = self.open(os.O_RDONLY | os.O_DIRECTORY)
        try:
            names = sorted(os.fsencode(n) for n in os.listdir(fd))
            for name in names:
                try:
                    yield name, os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed since the listing
                except OSError as exc:
                    raise fs_error(exc, self.child(name).shown) from None
        except OSError as exc:
            raise fs_error(exc, self.shown) from None
        finally:
            os.close(fd)


def _adopt(directory: int, *, fd: int | None = None, name: bytes | None = None) -> None:
    """Give what the files API just made to the owner of the directory it was made in.

    A root daemon runs isolated sandboxes as another account (``docs/isolation.md``) and
    makes their directories that account's: a file it writes for them must be theirs
    too, or their processes could read it but never change it. For any other daemon this
    is the daemon's own account already: nothing to do."""
    if os.geteuid() != 0:
        return
    owner = os.fstat(directory)
    if fd is not None:
        os.fchown(fd, owner.st_uid, owner.st_gid)
    elif name is not None:
        os.chown(name, owner.st_uid, owner.st_gid, dir_fd=directory, follow_symlinks=False)


def locate(root: Path, tmpdir: Path | None, path: str | None) -> Located:
    """Where ``path`` (a sandbox path, relative, or a host path inside ``root`` or
    ``tmpdir``) leads; InvalidArgument for none, NUL, or a path outside both."""
    if not path or not isinstance(path, str):
        raise InvalidArgument("path is required", field="path")
    if "\x00" in path:
        raise InvalidArgument(f"{path!r} contains NUL", field="path", path=path)
    raw = unescape(path)
    parts = tuple(p for p in raw.split(b"/") if p not in (b"", b"."))
    if not raw.startswith(b"/"):
        return _beneath(Located(root, HOME, parts), path)
    bases: list[tuple[tuple[bytes, ...], Path, str]] = [
        (_split(HOME), root, HOME),
        (_split(str(root)), root, HOME),
    ]
    if tmpdir is not None:
        bases += [(_split(TMP), tmpdir, TMP), (_split(str(tmpdir)), tmpdir, TMP)]
    for prefix, directory, base in sorted(bases, key=lambda b: -len(b[0])):
        if parts[: len(prefix)] == prefix:
            return _beneath(Located(directory, base, parts[len(prefix) :]), path)
    raise outside(path)


def _beneath(located: Located, path: str) -> Located:
    """``located``, unless its ``..`` climb above its root as written or a component is
    longer than the kernel takes (refused before anything is created; symlinks that climb
    out are refused by the kernel at open)."""
    depth = 0
    for part in located.parts:
        if len(part) > NAME_MAX:
            too_long = OSError(errno.ENAMETOOLONG, f"a component is over {NAME_MAX} bytes")
            raise fs_error(too_long, located.shown)
        depth += -1 if part == b".." else 1
        if depth < 0:
            raise outside(path)
    return located


def remove_directory(directory: Path) -> None:
    """Remove a directory tree a sandboxed process may have shaped (its working
    directory): ``shutil.rmtree``, and where that recurses too deep for Python (a tree
    over about 1,000 levels) :meth:`Located.remove`, which is iterative."""
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        pass
    except RecursionError:
        Located(directory.parent, "", (os.fsencode(directory.name),)).remove()


def outside(path: str, *, shown: str | None = None) -> InvalidArgument:
    """The error for a path (as requested, or ``shown`` as answers name it) that leads
    outside the sandbox's directories."""
    shown = shown or wire_name(path)  # valid UTF-8 whatever the request held
    return InvalidArgument(
        f"{shown} is outside the sandbox's writable space ({HOME} and {TMP})",
        field="path",
        path=shown,
        reason="outside",
    )


def _split(path: str) -> tuple[bytes, ...]:
    return tuple(p for p in os.fsencode(path).split(b"/") if p not in (b"", b"."))


# -- errors ----------------------------------------------------------------------------


def fs_error(exc: OSError, path: str) -> SandboxkitError:
    """The typed error for a failed file-system call on ``path`` (a sandbox path)."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, "EIO")
    why = exc.strerror or os.strerror(code)
    if code in (errno.ENOENT, errno.ENOTDIR):
        return FileNotFound(f"no such file or directory: {path} ({why})", path=path)
    if code == errno.EXDEV:  # RESOLVE_BENEATH: a symlink or '..' climbs out
        return outside(path, shown=path)
    return InvalidArgument(f"{path}: {why} ({name})", field="path", path=path, reason=name)


def _kind_name(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


# -- off the loop ----------------------------------------------------------------------

T = TypeVar("T")


async def off_loop(what: str, work: Callable[..., T], *args: Any) -> T:
    """Run blocking file work on a thread within :data:`FILE_OP_DEADLINE`; past it the
    request fails (InvalidArgument ``reason`` ``deadline``) while the thread finishes."""
    try:
        return await asyncio.wait_for(blocking.off_loop(work, *args), FILE_OP_DEADLINE)
    except asyncio.TimeoutError:
        raise InvalidArgument(
            f"{what}: the file operation did not finish within {FILE_OP_DEADLINE:g} s",
            field="path",
            path=what,
            reason="deadline",
        ) from None


# -- resolving beneath a directory -----------------------------------------------------


def _open_beneath(root: int, parts: tuple[bytes, ...], flags: int, mode: int) -> int:
    global _HAVE_OPENAT2
    if not flags & os.O_CREAT:
        mode = 0
    if _HAVE_OPENAT2:
        how = _OpenHow(flags, mode, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
        path = b"/".join(parts) or b"."
        fd = _libc.syscall(_SYS_OPENAT2, root, path, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EPERM):
            raise OSError(err, os.strerror(err))
        if err == errno.ENOSYS or _eperm_is_seccomp(root):
            _HAVE_OPENAT2 = False
        else:
            raise OSError(err, os.strerror(err))
    return _walk(root, parts, flags, mode)


def _eperm_is_seccomp(root: int) -> bool:
    """Whether openat2's EPERM was a filter refusing the call (the root always opens)."""
    how = _OpenHow(_O_PATH | os.O_CLOEXEC, 0, _RESOLVE_BENEATH)
    fd = _libc.syscall(_SYS_OPENAT2, root, b".", ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        os.close(fd)
        return False
    return True


def _walk(root: int, parts: tuple[bytes, ...], flags: int, mode: int) -> int:
    """``openat2(RESOLVE_BENEATH)`` by hand: one ``openat(O_NOFOLLOW)`` per component
    from a directory descriptor; a symlink is read and its target walked in its place
    (an absolute one, or ``..`` above the root, is EXDEV)."""
    stack = [os.dup(root)]  # the directories from the root down to the current one
    todo = list(parts)
    links = 0
    try:
        while todo:
            name = todo.pop(0)
            if name in (b"", b"."):
                continue
            if name == b"..":
                if len(stack) == 1:
                    raise OSError(errno.EXDEV, "'..' leads above the sandbox's directory")
                os.close(stack.pop())
                continue
            last = not any(p not in (b"", b".") for p in todo)
            here = stack[-1]
            try:
                own = os.stat(name, dir_fd=here, follow_symlinks=False)
            except FileNotFoundError:
                if last and flags & os.O_CREAT:
                    return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=here)
                raise
            if stat.S_ISLNK(own.st_mode) and not (last and flags & os.O_NOFOLLOW):
                links += 1
                if links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                try:
                    target = os.readlink(name, dir_fd=here)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    todo.insert(0, name)  # no longer a link (swapped meanwhile): look again
                    continue
                if target.startswith(b"/"):
                    raise OSError(errno.EXDEV, "an absolute symlink leads outside")
                todo = target.split(b"/") + todo
                continue
            # O_NOFOLLOW: a link swapped in since the stat fails here (ELOOP/ENOTDIR).
            if last:
                return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=here)
            directory = _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            stack.append(os.open(name, directory, dir_fd=here))
        return os.open(".", flags & ~os.O_CREAT, dir_fd=stack[-1])
    finally:
        for fd in stack:
            os.close(fd)
