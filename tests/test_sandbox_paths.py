"""The path model and resolving beneath a sandbox's directory
(``sandboxkit/daemon/sandbox_paths.py``), without a daemon: the fallback walk agrees
with ``openat2(RESOLVE_BENEATH)`` on every case, and names round-trip."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from sandboxkit.daemon import sandbox_paths
from sandboxkit.daemon.sandbox_paths import fs_error, locate, unescape, wire_name
from sandboxkit.errors import FileNotFound, InvalidArgument, SandboxkitError

CASES = [
    "a",
    "d/x",
    "d/../a",
    "d/./x",
    "..",
    "d/../../a",
    "in",  # -> a
    "dlink/x",  # -> d
    "up/x",  # -> d/.. : stays inside
    "abs",  # -> /etc
    "abs/passwd",
    "out",  # -> ../outside
    "loop",
    "loop/x",
    "a/x",
    "missing",
    "dangling",
    "n" * 256,
    "chain",  # chain -> in -> a
]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "a").write_text("a")
    (root / "d" / "x").write_text("x")
    (tmp_path / "outside").write_text("secret")
    for name, target in [
        ("in", "a"),
        ("dlink", "d"),
        ("up", "d/.."),
        ("abs", "/etc"),
        ("out", "../outside"),
        ("loop", "loop"),
        ("dangling", "nowhere"),
        ("chain", "in"),
    ]:
        os.symlink(target, root / name)
    return root


def _outcome(root: Path, path: str) -> tuple[str, object]:
    try:
        fd = locate(root, None, path).open(os.O_RDONLY)
    except SandboxkitError as exc:
        return type(exc).__name__, exc.details.get("reason")
    try:
        info = os.fstat(fd)
        return "ok", (info.st_dev, info.st_ino)
    finally:
        os.close(fd)


def test_the_fallback_walk_agrees_with_openat2(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = {path: _outcome(tree, path) for path in CASES}
    monkeypatch.setattr(sandbox_paths, "_HAVE_OPENAT2", False)
    walked = {path: _outcome(tree, path) for path in CASES}
    assert walked == kernel
    assert kernel["abs"] == ("InvalidArgument", "outside")
    assert kernel["out"] == ("InvalidArgument", "outside")
    assert kernel["loop"] == ("InvalidArgument", "ELOOP")
    assert kernel["a/x"][0] == "FileNotFound"
    assert kernel["n" * 256] == ("InvalidArgument", "ENAMETOOLONG")
    assert kernel["chain"] == kernel["in"] == kernel["a"]


def test_sandbox_paths_map_to_the_two_directories(tmp_path: Path) -> None:
    work, tmp = tmp_path / "sbx", tmp_path / "sbx.tmp"
    home = locate(work, tmp, "/home/user/sub/x.txt")
    assert (home.root, home.shown) == (work, "/home/user/sub/x.txt")
    assert locate(work, tmp, "sub//./x.txt").shown == "/home/user/sub/x.txt"
    assert locate(work, tmp, "/tmp/y").root == tmp
    assert locate(work, tmp, str(work / "z")).shown == "/home/user/z"
    assert locate(work, tmp, str(tmp / "z")).shown == "/tmp/z"
    for outside in ("/etc/passwd", "/home/user/../x", "../x", "a/../../x", "/home/userx"):
        with pytest.raises(InvalidArgument, match="outside the sandbox's writable space"):
            locate(work, tmp, outside)
    with pytest.raises(InvalidArgument):
        locate(work, tmp, "a\x00b")
    with pytest.raises(InvalidArgument):
        locate(work, tmp, "")
    work.mkdir()
    with pytest.raises(FileNotFound, match="/home/user/nope"):
        locate(work, tmp, "nope").lstat()


@pytest.mark.parametrize(
    "raw",
    [b"plain", b"caf\xc3\xa9", b"caf\xe9", b"a\\b", b"\\x41", b"\\xff", b"\xff\xfe", b"%41"],
)
def test_names_round_trip_as_valid_utf8(raw: bytes) -> None:
    shown = wire_name(raw)
    shown.encode("utf-8")  # no lone surrogates
    assert unescape(shown) == raw
    assert wire_name(os.fsdecode(raw)) == shown


@pytest.mark.parametrize(
    ("code", "cls", "reason"),
    [
        (errno.ENOENT, FileNotFound, None),
        (errno.ENOTDIR, FileNotFound, None),
        (errno.ENAMETOOLONG, InvalidArgument, "ENAMETOOLONG"),
        (errno.ELOOP, InvalidArgument, "ELOOP"),
        (errno.EISDIR, InvalidArgument, "EISDIR"),
        (errno.EACCES, InvalidArgument, "EACCES"),
        (errno.ENOSPC, InvalidArgument, "ENOSPC"),
        (errno.EDQUOT, InvalidArgument, "EDQUOT"),
        (errno.EXDEV, InvalidArgument, "outside"),
    ],
)
def test_every_errno_is_a_typed_4xx_naming_the_path(
    code: int, cls: type[SandboxkitError], reason: str | None
) -> None:
    error = fs_error(OSError(code, os.strerror(code)), "/home/user/x.txt")
    assert type(error) is cls and 400 <= error.status < 500
    assert "/home/user/x.txt" in str(error)
    assert error.details["path"] == "/home/user/x.txt"
    if reason is not None:
        assert error.details["reason"] == reason
