"""What a new user meets first: what ``on_stdout`` receives, what an error says, what a
closed sandbox does, ``connect`` on an unknown pid, a killed process's ``wait()``, the
cursor ``disconnect()`` hands back, and a sandbox's lifetime (``timeout``/``set_timeout``)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from support import poll

from sandboxkit import (
    AsyncSandbox,
    CommandExitError,
    ResultUnavailable,
    Sandbox,
    SandboxClosed,
    SandboxkitError,
    SandboxNotFound,
)
from sandboxkit.daemon.server import DaemonServer

# Two writes that split a line in the middle, and a last line with no newline.
SPLIT_LINES = "printf 'a\\nbb'; sleep 0.2; printf 'b\\nc'"  # sleep-ok: two separate writes


async def test_on_stdout_gets_whole_lines_without_their_newline(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        lines: list[str] = []
        result = await sbx.commands.run(SPLIT_LINES, on_stdout=lines.append)
        assert result.stdout == "a\nbbb\nc"
        assert lines == ["a", "bbb", "c"]


async def test_lines_false_gives_raw_chunks(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        chunks: list[str] = []
        result = await sbx.commands.run(SPLIT_LINES, on_stdout=chunks.append, lines=False)
        assert "".join(chunks) == result.stdout == "a\nbbb\nc"
        assert len(chunks) >= 2 and chunks[0] == "a\nbb", chunks


def test_sync_on_stdout_print_prints_each_line_once(
    conn: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with Sandbox.create(**conn) as sbx:
        sbx.commands.run(SPLIT_LINES, on_stdout=print)
    assert capsys.readouterr().out == "a\nbbb\nc\n"


async def test_command_exit_error_says_the_code_and_the_end_of_stderr(
    conn: dict[str, str],
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        with pytest.raises(CommandExitError) as info:
            await sbx.commands.run(
                "for i in $(seq 30); do echo noise $i >&2; done; echo 'the real reason' >&2; exit 3"
            )
        message = str(info.value)
        assert "exit code 3" in message
        assert "the real reason" in message
        assert "noise 1\n" not in message  # only the last lines
        with pytest.raises(CommandExitError) as missing:
            await sbx.commands.run("nonexistent-binary-xyz")
        assert "exit code 127" in str(missing.value)
        assert "not found" in str(missing.value)


async def _closed_calls(sbx: AsyncSandbox, pid: int) -> dict[str, Callable[[], Awaitable[Any]]]:
    return {
        "get_info": sbx.get_info,
        "pause": sbx.pause,
        "resume": sbx.resume,
        "kill": sbx.kill,
        "set_timeout": lambda: sbx.set_timeout(60),
        "events": sbx.events,
        "consumers": sbx.consumers,
        "run": lambda: sbx.commands.run("echo hi"),
        "start": lambda: sbx.commands.start("echo hi"),
        "list": sbx.commands.list,
        "get": lambda: sbx.commands.get(pid),
        "kill_pid": lambda: sbx.commands.kill(pid),
        "connect": lambda: sbx.commands.connect(pid),
        "send_stdin": lambda: sbx.commands.send_stdin(pid, "x"),
    }


@pytest.mark.parametrize("how", ["close", "kill"])
async def test_every_call_on_a_closed_sandbox_raises_sandbox_closed(
    conn: dict[str, str], daemon: DaemonServer, how: str
) -> None:
    sbx = await AsyncSandbox.create(**conn)
    handle = await sbx.commands.run("sleep 30", background=True)
    await (sbx.close() if how == "close" else sbx.kill())
    for name, call in (await _closed_calls(sbx, handle.pid)).items():
        with pytest.raises(SandboxClosed) as info:
            await call()
        assert sbx.sandbox_id in str(info.value), name
        assert ("killed" if how == "kill" else "close()") in str(info.value), name
    if how == "close":
        with pytest.raises(SandboxClosed, match=r"close\(\)"):
            await handle.wait()
    else:  # the process was killed with its sandbox, and its stream read the end
        with pytest.raises(CommandExitError, match="killed by SIGTERM"):
            await handle.wait()
    if how == "close":  # the sandbox itself lives on: reattach and end it
        again = await AsyncSandbox.connect(sbx.sandbox_id, **conn)
        assert (await again.commands.get(handle.pid)).state == "running"
        await again.kill()
    else:
        with pytest.raises(SandboxNotFound):
            await AsyncSandbox.connect(sbx.sandbox_id, **conn)


def test_sync_calls_on_a_killed_sandbox_raise_sandbox_closed(conn: dict[str, str]) -> None:
    sbx = Sandbox.create(**conn)
    handle = sbx.commands.run("sleep 30", background=True)
    sbx.kill()
    for call in (
        sbx.get_info,
        sbx.pause,
        sbx.kill,
        sbx.events,
        lambda: sbx.commands.run("echo hi"),
        lambda: sbx.commands.connect(handle.pid),
    ):
        with pytest.raises(SandboxClosed, match="killed"):
            call()
    with pytest.raises(CommandExitError, match="killed by SIGTERM"):
        handle.wait()


async def test_a_sandbox_killed_elsewhere_says_so(conn: dict[str, str]) -> None:
    sbx = await AsyncSandbox.create(**conn)
    other = await AsyncSandbox.connect(sbx.sandbox_id, **conn)
    await other.kill()
    for call in (sbx.pause, sbx.resume, lambda: sbx.commands.run("echo hi")):
        with pytest.raises(SandboxNotFound, match="killed"):
            await call()
    await sbx.close()


async def test_connect_to_an_unknown_pid_raises_before_it_returns(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        with pytest.raises(ResultUnavailable):
            await sbx.commands.connect(999_999)
    with Sandbox.create(**conn) as sync_sbx, pytest.raises(ResultUnavailable):
        sync_sbx.commands.connect(999_999)


async def test_wait_on_a_killed_process_raises_command_exit_error_sync_and_async(
    conn: dict[str, str],
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        handle = await sbx.commands.run("sleep 30", background=True)
        assert await handle.kill()
        with pytest.raises(CommandExitError) as info:
            await handle.wait()
        assert info.value.exit_code is not None and info.value.exit_code != 0
        assert "killed" in str(info.value)

    def sync_side() -> SandboxkitError:
        with Sandbox.create(**conn) as s:
            h = s.commands.run("sleep 30", background=True)
            h.kill()
            with pytest.raises(CommandExitError) as sync_info:
                h.wait()
            return sync_info.value

    sync_error = await asyncio.to_thread(sync_side)
    assert type(sync_error) is type(info.value)
    assert str(sync_error).replace(str(sync_error.pid), "") == str(info.value).replace(  # type: ignore[attr-defined]
        str(info.value.pid), ""
    )


async def test_disconnect_returns_the_cursor_to_resume_from(conn: dict[str, str]) -> None:
    script = (
        "import time\n"
        "for i in range(60):\n"
        "    print(f'line {i:03d}', flush=True)\n"
        "    time.sleep(0.01)\n"  # sleep-ok: the child's pace
    )
    async with await AsyncSandbox.create(**conn) as sbx:
        first: list[str] = []
        handle = await sbx.commands.run(
            [sys.executable, "-u", "-c", script], background=True, on_stdout=first.append
        )
        await poll(lambda: len(first) >= 10, 10, "ten lines")
        cursor = await handle.disconnect()
        assert cursor is not None and cursor == handle.cursor
        second: list[str] = []
        again = await sbx.commands.connect(handle.pid, cursor=cursor, on_stdout=second.append)
        await again.wait()
        assert first + second == [f"line {i:03d}" for i in range(60)]


async def test_a_line_cut_by_a_disconnect_arrives_whole_after_the_reattach(
    conn: dict[str, str],
) -> None:
    """The process has written half a line when the handle disconnects: the cursor carries
    it, so the continuation delivers the line whole, not two pieces (or an empty line when
    the cut fell just before the newline)."""
    script = (
        "import sys\n"
        "for end in ('\\n', 'ef\\nlast\\n'):\n"
        "    sys.stdout.write('abcd' if end == '\\n' else '')\n"
        "    sys.stdout.flush()\n"
        "    sys.stdin.readline()\n"
        "    sys.stdout.write(end)\n"
        "    sys.stdout.flush()\n"
    )
    async with await AsyncSandbox.create(**conn) as sbx:
        for cut_before_newline in (True, False):
            first: list[str] = []
            handle = await sbx.commands.run(
                [sys.executable, "-u", "-c", script], background=True, on_stdout=first.append
            )
            await poll(lambda h=handle: h.stdout == "abcd", 10, "half a line")
            if cut_before_newline:
                cursor = await handle.disconnect()
                await handle.send_stdin("go\n")  # writes the newline, then waits again
            else:
                await handle.send_stdin("go\n")
                await poll(lambda h=handle: h.stdout == "abcd\n", 10, "the newline")
                cursor = await handle.disconnect()
            second: list[str] = []
            again = await sbx.commands.connect(handle.pid, cursor=cursor, on_stdout=second.append)
            await again.send_stdin("go\n")
            await again.wait()
            assert first + second == ["abcd", "ef", "last"], (cut_before_newline, first, second)


async def test_wait_after_disconnect_names_the_cursor(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        handle = await sbx.commands.run("sleep 30", background=True)
        cursor = await handle.disconnect()
        with pytest.raises(ResultUnavailable, match=f"cursor={cursor}"):
            await handle.wait()


# -- lifetime ------------------------------------------------------------------------------


async def test_default_timeout_is_e2bs_300_seconds_then_kill(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        assert (sbx.info.timeout, sbx.info.on_timeout) == (300, "kill")


@pytest.mark.timeout(30)
async def test_set_timeout_shortens_a_forgotten_sandboxs_life(
    conn: dict[str, str], daemon: DaemonServer
) -> None:
    sbx = await AsyncSandbox.create(**conn)
    info = await sbx.commands.start("sleep 30")
    await sbx.set_timeout(0.3)
    assert sbx.info.timeout == 0.3
    await sbx.close()  # forgotten: nobody holds it any more
    core = daemon.host.sandboxes[sbx.sandbox_id]
    await poll(lambda: core.state == "killed", 10, "the timeout to kill the sandbox")
    assert not core.processes[info.pid].running


@pytest.mark.slow
@pytest.mark.timeout(30)
async def test_a_watched_sandbox_is_not_idle(conn: dict[str, str], daemon: DaemonServer) -> None:
    script = (
        "import time\nfor i in range(30):\n    print(i, flush=True)\n    "
        "time.sleep(0.05)\n"  # sleep-ok: the child process's pace
    )
    async with await AsyncSandbox.create(timeout=0.3, **conn) as sbx:
        started = time.monotonic()
        result = await sbx.commands.run([sys.executable, "-u", "-c", script])
        # The stream was attached for ~1.5 s, five times the idle timeout, and no other
        # request named the sandbox: the attached stream kept it alive.
        assert time.monotonic() - started > 1.0
        assert result.exit_code == 0
        assert daemon.host.sandboxes[sbx.sandbox_id].state == "running"
