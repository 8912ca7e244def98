"""Many notebook kernels have ``nest_asyncio.apply()`` in effect (other libraries call
it). sandboxkit does not need it — the sync API runs on a background loop of its own —
and must keep working where it was applied: the sync API and a widget called from inside
a running loop (as from a Jupyter cell), and the async API awaited there. In a child
process, so that the patch does not leak into this one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import child_env

import sandboxkit

REPO = Path(sandboxkit.__file__).resolve().parents[1]

CELL = r"""
import asyncio, os, sys, time
import nest_asyncio

nest_asyncio.apply()

from sandboxkit import AsyncSandbox, ResultUnavailable, Sandbox
from sandboxkit.notebook import ProcessPanel

conn = {"url": os.environ["TEST_URL"], "token": os.environ["TEST_TOKEN"]}
COUNTER = (
    "import time\n"
    "for i in range(400):\n"
    "    print(f'n {i:04d}', flush=True)\n"
    "    time.sleep(0.005)\n"  # sleep-ok: the child process's pace
)


async def cell():
    assert asyncio.get_running_loop().is_running()  # as in a Jupyter cell
    # The sync API, called from inside the running (patched) loop.
    with Sandbox.create(**conn) as sbx:
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        seen = []
        handle = sbx.commands.run([sys.executable, "-u", "-c", COUNTER], background=True,
                                  on_stdout=seen.append)
        panel = ProcessPanel(sbx, handle.pid)
        try:
            assert handle.wait().exit_code == 0
            assert seen == [f"n {i:04d}" for i in range(400)]
            deadline = time.monotonic() + 20
            while panel.line_count < 400:
                assert time.monotonic() < deadline, panel.line_count
                await asyncio.sleep(0.05)  # sleep-ok: poll interval, the loop keeps running
            assert panel.lines[-1] == "n 0399", panel.lines[-3:]
        finally:
            panel.close()
        try:
            sbx.commands.connect(999_999)
        except ResultUnavailable:
            pass
        else:
            raise AssertionError("connect(999999) returned")
    # The async API, awaited in the same loop.
    async with await AsyncSandbox.create(**conn) as asbx:
        result = await asbx.commands.run("echo async")
        assert result.stdout == "async\n"
    # And a nested asyncio.run, which nest_asyncio allows, around the async API.
    async def inner():
        async with await AsyncSandbox.create(**conn) as s:
            return (await s.commands.run("echo nested")).stdout
    assert asyncio.run(inner()) == "nested\n"


asyncio.run(cell())
print("OK")
"""


@pytest.mark.slow  # an interpreter of its own that imports the widgets: seconds
@pytest.mark.timeout(90)
def test_sync_async_and_widgets_work_under_nest_asyncio(conn: dict[str, str]) -> None:
    env = child_env()
    env.update(TEST_URL=conn["url"], TEST_TOKEN=conn["token"])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", CELL],
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "OK"
    assert "Traceback" not in result.stderr, result.stderr
