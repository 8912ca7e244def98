"""The public surface: ``on_end=`` and ``handle.error`` (async and sync), the sandbox's and
the process's described fields, and what the top-level package loads."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import sandboxkit
from sandboxkit import AsyncCommandHandle, AsyncSandbox, CommandHandle, InvalidArgument, Sandbox
from sandboxkit.client.options import FollowOptions
from sandboxkit.client.stream import ProcessStream

HANG = 10.0


@pytest.mark.timeout(30)
async def test_on_end_after_the_last_line_with_the_exit(conn: dict[str, str]) -> None:
    seen: list[Any] = []
    ended = asyncio.Event()

    def on_end(handle: AsyncCommandHandle) -> None:
        seen.append((handle, handle.done, handle.exit_code, handle.error, list(lines)))
        ended.set()

    lines: list[str] = []
    async with await AsyncSandbox.create(**conn) as sbx:
        # The last line has no newline: it is delivered at the end, before on_end.
        handle = await sbx.commands.run(
            "printf 'one\\ntwo'; exit 3",
            background=True,
            on_stdout=lines.append,
            on_end=on_end,
        )
        await asyncio.wait_for(ended.wait(), HANG)
        assert seen == [(handle, True, 3, None, ["one", "two"])]

        # Foreground: on_end is called before run() returns (here: raises).
        calls: list[int | None] = []
        with pytest.raises(Exception, match="exit code 4"):
            await sbx.commands.run("exit 4", on_end=lambda h: calls.append(h.exit_code))
        assert calls == [4]


@pytest.mark.timeout(30)
async def test_on_end_on_disconnect_and_on_error_and_async(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        info = await sbx.commands.start(["sh", "-c", "printf 'partial'; sleep 30"])
        lines: list[str] = []
        seen: list[tuple[Any, ...]] = []
        got_partial = asyncio.Event()

        def on_stdout(chunk: str) -> None:
            lines.append(chunk)

        handle = await sbx.commands.connect(
            info.pid,
            on_stdout=on_stdout,
            on_end=lambda h: seen.append((h.done, h.exit_code, h.error, list(lines))),
            on_stdout_bytes=lambda b: got_partial.set(),
        )
        await asyncio.wait_for(got_partial.wait(), HANG)
        assert seen == []
        cursor = await handle.disconnect()
        # Disconnected: neither an exit nor an error; the unfinished line goes on with the
        # cursor, for the handle that continues from it.
        assert seen == [(True, None, None, [])]
        assert cursor is not None and cursor.stdout_line == "partial"

        # A stream that ends with an error: on_end sees it in handle.error (async callback).
        head = (await sbx.commands.get(info.pid)).head
        errors: list[BaseException | None] = []
        ended = asyncio.Event()

        async def on_end(h: AsyncCommandHandle) -> None:
            await asyncio.sleep(0)  # sleep-ok: a real await inside the callback
            errors.append(h.error)
            ended.set()

        # connect() opens the stream before a handle exists: the daemon refuses a cursor
        # past the head there. A reader that attaches only later (as a provider's may)
        # gets that refusal as the error that ends its stream.
        with pytest.raises(InvalidArgument, match="cursor"):
            await sbx.commands.connect(info.pid, cursor=head + 1)
        commands = sbx.backend.commands

        async def later(pid: int, cursor: int | None, options: FollowOptions) -> ProcessStream:
            return ProcessStream(commands.api, commands.sandbox_id, pid, cursor, options)

        commands.follow_reader = later  # type: ignore[method-assign]
        bad = await sbx.commands.connect(info.pid, cursor=head + 1, on_end=on_end)
        await asyncio.wait_for(ended.wait(), HANG)
        assert len(errors) == 1 and isinstance(errors[0], InvalidArgument)
        assert bad.error is errors[0]
        await sbx.commands.kill(info.pid)


@pytest.mark.timeout(30)
def test_sync_on_end_gets_the_same_handle_on_the_loop_thread(conn: dict[str, str]) -> None:
    seen: list[tuple[CommandHandle, int | None, bool]] = []
    ended = threading.Event()

    def on_end(handle: CommandHandle) -> None:
        seen.append((handle, handle.exit_code, threading.current_thread() is caller))
        ended.set()

    caller = threading.current_thread()
    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run("echo hi", background=True, on_end=on_end)
        assert ended.wait(HANG)
        assert seen == [(handle, 0, False)]
        assert handle.error is None and handle.done

        ended.clear()
        again = sbx.commands.connect(handle.pid, on_end=on_end)
        assert ended.wait(HANG)
        assert seen[-1][0] is again


@pytest.mark.timeout(30)
async def test_info_fields_say_what_the_daemon_reports(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        info = await sbx.get_info()
        raw = info.raw
        assert info.freezer == raw["freezer"] and info.freezer in {"cgroup", "signals"}
        assert info.fanout == raw["fanout"] == "cursor"
        assert info.lab is None  # a production sandbox
        assert info.workdir == raw["workdir"]
        process = await sbx.commands.start(["true"], timeout=30, tag="t")
        assert (process.timeout, process.tag, process.kill_reason) == (30, "t", None)


def test_importing_the_package_loads_no_client() -> None:
    # The daemon shares the package: importing it (and the lab's and the widgets' packages)
    # must not import httpx or pandas; a client name then loads on first use.
    code = (
        "import sys, sandboxkit, sandboxkit.lab, sandboxkit.notebook, sandboxkit.daemon.http\n"
        "print(sorted(m for m in ('httpx', 'pandas', 'ipywidgets') if m in sys.modules))\n"
        "from sandboxkit import Sandbox, CommandResult\n"
        "import sandboxkit.client.results as r\n"
        "assert CommandResult is r.CommandResult\n"
        "print('httpx' in sys.modules, 'Sandbox' in dir(sandboxkit))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\n")
    assert out[:2] == ["[]", "True True"]


REPO = Path(sandboxkit.__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"


def _layout_table() -> list[tuple[str, str]]:
    text = ARCHITECTURE.read_text()
    assert "\n## Where each concept lives\n" in text, "docs/architecture.md has no layout table"
    section = text.split("\n## Where each concept lives\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [
        (concept.strip(), where.strip())
        for concept, where in (row.strip().strip("|").split("|") for row in rows)
    ]


def test_architecture_layout_names_every_module_and_only_real_ones() -> None:
    # docs/architecture.md's "where each concept lives" table: every path in it exists, and
    # every module of the package is in it (the subpackages of daemon/ as folders).
    named: set[Path] = set()
    base = REPO
    for concept, where in _layout_table():
        if concept.startswith("**"):  # a layer: its own package is the base of what follows
            packages = re.findall(r"`(sandboxkit/(?:[\w/]+/)?)`", concept)
            base = REPO / packages[0] if packages else REPO
            continue
        for token in re.findall(r"`([\w./]+(?:\.py|\.js|/))`", where):
            path = (REPO if token.startswith("sandboxkit/") else base) / token
            assert path.exists(), (
                f"docs/architecture.md's layout names {token}, which does not exist"
            )
            named.add(path.resolve())
    package = REPO / "sandboxkit"
    modules = [
        m
        for m in package.glob("*.py")
        if m.name not in {"__init__.py", "__main__.py", "_version.py"}
    ]
    for sub in ("daemon", "client", "providers", "notebook", "lab", "cli"):
        for module in [*(package / sub).glob("*.py"), *(package / sub).glob("*.js")]:
            if module.name != "__init__.py":
                modules.append(module)
    modules += [p for p in (package / "daemon").iterdir() if (p / "__init__.py").exists()]
    for module in modules:
        assert module.resolve() in named, (
            f"docs/architecture.md's layout lacks {module.relative_to(package)}"
        )


# A path as docs/architecture.md names one: a file of the package or the repository, or a
# folder; not a runtime path (`$TMPDIR/…`, `<root>/sbx-…/`) and not an extension (`.py`).
_PATH = re.compile(r"`(\w[\w./-]*(?:\.(?:py|js|md|sh|json)|/))`")
# Where a bare name (`app.py`, `static/VERSIONS.md`) is looked for: the repository, then the
# packages whose text mentions it.
_SEARCH = [
    "",
    "sandboxkit",
    *(
        f"sandboxkit/{p}"
        for p in ("daemon", "client", "providers", "notebook", "lab", "daemon/freezer")
    ),
]


def test_architecture_names_only_paths_that_exist() -> None:
    """Every module, file or folder docs/architecture.md names in code spans exists, so a
    module that is moved or renamed fails here until the page follows it."""
    text = ARCHITECTURE.read_text()
    names = set(_PATH.findall(text))
    assert len(names) > 30, sorted(names)  # the page names modules; the pattern finds them
    missing = [
        name for name in sorted(names) if not any((REPO / d / name).exists() for d in _SEARCH)
    ]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
