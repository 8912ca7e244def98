"""``sbx.files`` in sandboxkit's own client (E2B-shaped): put a script in, run it, read
its result back — the first README snippet's ``worker.py`` problem."""

from __future__ import annotations

import pytest

from sandboxkit.client.sandbox import AsyncSandbox
from sandboxkit.client.sync import Sandbox
from sandboxkit.errors import FileNotFound, InvalidArgument


def test_write_run_read_list(conn: dict[str, str | None]) -> None:
    with Sandbox.create(**conn) as sbx:  # type: ignore[arg-type]
        script = "open('out.bin', 'wb').write(bytes(range(256)))\n"
        info = sbx.files.write("worker.py", script)
        assert info.name == "worker.py" and info.type == "file"
        sbx.commands.run("python3 worker.py")
        assert sbx.files.read("out.bin", format="bytes") == bytes(range(256))
        assert sbx.files.read("worker.py").startswith("open(")
        sbx.files.write("sub/dir/note.txt", b"\xff\xfe")
        names = {(e.name, e.type, e.size) for e in sbx.files.list()}
        assert {("worker.py", "file", len(script)), ("out.bin", "file", 256)} <= names
        assert ("sub", "dir") in {(e.name, e.type) for e in sbx.files.list()}
        assert [e.name for e in sbx.files.list("sub/dir")] == ["note.txt"]
        assert sbx.files.read("sub/dir/note.txt") == "\ufffd\ufffd"


def test_errors_are_typed(conn: dict[str, str | None]) -> None:
    with Sandbox.create(**conn) as sbx:  # type: ignore[arg-type]
        with pytest.raises(FileNotFound):
            sbx.files.read("missing.txt")
        with pytest.raises(FileNotFound):
            sbx.files.list("missing-dir")
        with pytest.raises(InvalidArgument):
            sbx.files.read(".")  # a directory
        with pytest.raises(InvalidArgument):
            sbx.files.write("", "x")
        # The files API reaches only the sandbox's own directory.
        for outside in ("../escape.txt", "/etc/sandboxkit-escape.txt", "sub/../../x"):
            with pytest.raises(InvalidArgument, match="outside"):
                sbx.files.write(outside, "x")
        sbx.commands.run("ln -s / root-link")
        with pytest.raises(InvalidArgument, match="outside"):
            sbx.files.read("root-link/etc/hostname")
        sbx.commands.run("rm root-link")
        # The daemon keeps serving, unchanged.
        assert sbx.files.list() == []


async def test_async_files(conn: dict[str, str | None]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:  # type: ignore[arg-type]
        await sbx.files.write("a.txt", "héllo")
        assert await sbx.files.read("a.txt") == "héllo"
        assert await sbx.files.read("a.txt", format="bytes") == "héllo".encode()
