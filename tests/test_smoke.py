"""End-to-end: the sync and async clients against an in-process daemon."""

from __future__ import annotations

import pytest

from sandboxkit import AsyncSandbox, CommandExitError, Sandbox


async def test_async_run_collects_output(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        seen: list[str] = []
        result = await sbx.commands.run("echo hello; echo oops >&2", on_stdout=seen.append)
        assert result.stdout == "hello\n"
        assert result.stderr == "oops\n"
        assert result.exit_code == 0
        assert seen == ["hello"]  # whole lines, without their newline
        with pytest.raises(CommandExitError) as info:
            await sbx.commands.run("echo partial; exit 7")
        assert info.value.exit_code == 7
        assert info.value.result is not None and info.value.result.stdout == "partial\n"


async def test_sync_sandbox_inside_running_loop(conn: dict[str, str]) -> None:
    # An async test has a running loop, like a Jupyter kernel: the sync client must work.
    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run("for i in 1 2 3; do echo $i; done", background=True)
        assert handle.wait().stdout == "1\n2\n3\n"
        assert [p.pid for p in sbx.commands.list()] == [handle.pid]
        events = sbx.events()
        assert {"sandbox.created", "process.started", "process.exited"} <= set(events["kind"])
