"""The async SDK runs on whichever event loop its caller runs: asyncio's own, or uvloop's
(an app served by uvicorn with ``uvloop``, a notebook that installed its policy). Their
transports share no base class: uvloop's are not ``asyncio.Transport`` instances."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from sandboxkit import AsyncSandbox
from sandboxkit.errors import CommandExitError

uvloop = pytest.importorskip("uvloop")

PRINTS = (
    "import sys\n"
    "for i in range(3):\n"
    "    print('line', i, flush=True)\n"
    "sys.stdout.write('x' * 300000)\n"
)


async def _everything(conn: dict[str, str | None]) -> None:
    """A sandbox's life through every client transport: unary calls (one answer larger
    than a read), a command's own stream, a reattach that replays, stdin, a kill."""
    async with await AsyncSandbox.create(**conn) as sbx:  # type: ignore[arg-type]
        assert (await sbx.commands.run(["true"])).exit_code == 0
        lines: list[str] = []
        result = await sbx.commands.run(
            [sys.executable, "-c", PRINTS], on_stdout=lines.append, keep_output=True
        )
        assert lines[:3] == ["line 0", "line 1", "line 2"]
        assert result.stdout == "line 0\nline 1\nline 2\n" + "x" * 300000
        again = await sbx.commands.connect(result.pid, cursor=0)
        assert (await again.wait()).stdout == result.stdout  # replayed from the log
        cat = await sbx.commands.start(["cat"])
        await sbx.commands.send_stdin(cat.pid, "echo\n")
        echoed = asyncio.Event()
        handle = await sbx.commands.connect(cat.pid, on_stdout=lambda _line: echoed.set())
        await asyncio.wait_for(echoed.wait(), 10)
        assert [p.pid for p in await sbx.commands.list()].count(cat.pid) == 1
        data = bytes(range(256)) * 1200  # an answer of 400 KB, many of a pool's reads
        await sbx.files.write("big.bin", data)
        assert await sbx.files.read("big.bin", format="bytes") == data
        await sbx.commands.kill(cat.pid)
        with pytest.raises(CommandExitError, match="killed by SIGTERM"):
            await handle.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_the_async_sdk_runs_on_asyncio_and_on_uvloop(
    conn: dict[str, str | None], run: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    run(_everything(conn))
