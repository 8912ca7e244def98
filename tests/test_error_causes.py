"""Every error names its cause: a bad cursor is a typed InvalidArgument at ``connect``
(not a bare ValueError, not accepted until ``wait``), ``wait(timeout=)`` raises a
sandboxkit error that is still a TimeoutError, a relative ``cwd`` says what it is
relative to, a busy ``--envd`` port is named, and ``sandboxkit ps | head`` ends quietly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from freezer_support import cli_env

from sandboxkit import (
    AsyncSandbox,
    InvalidArgument,
    Sandbox,
    SandboxkitError,
    WaitTimeout,
)
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.statefile import DaemonState, write_state


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("cursor", "says"),
    [("x", "str"), (1.5, "float"), (True, "bool"), (-5, "negative"), (10**9, "head")],
    ids=["str", "float", "bool", "negative", "past-head"],
)
def test_a_bad_cursor_is_refused_at_connect(conn: dict[str, Any], cursor: Any, says: str) -> None:
    with Sandbox.create(**conn) as sbx:
        info = sbx.commands.start("echo one; sleep 30")
        with pytest.raises(InvalidArgument) as caught:
            sbx.commands.connect(info.pid, cursor=cursor)
        assert caught.value.field == "cursor"
        assert says in str(caught.value)
        sbx.commands.kill(info.pid)


@pytest.mark.timeout(30)
def test_a_good_cursor_is_still_accepted(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run("echo one; echo two", background=True)
        assert handle.wait().exit_code == 0
        again = sbx.commands.connect(handle.pid, cursor=handle.cursor)  # the head itself
        assert again.wait().stdout == ""
        assert sbx.commands.connect(handle.pid, cursor=0).wait().stdout == "one\ntwo\n"


@pytest.mark.timeout(30)
def test_wait_timeout_is_a_sandboxkit_error_and_a_timeout_error(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run("sleep 30", background=True)
        with pytest.raises(WaitTimeout) as caught:
            handle.wait(timeout=0.2)
        assert isinstance(caught.value, SandboxkitError)
        assert isinstance(caught.value, TimeoutError)
        assert caught.value.pid == handle.pid and caught.value.timeout == 0.2
        assert "runs on" in str(caught.value)
        handle.kill()  # the handle still follows it


@pytest.mark.timeout(30)
async def test_async_wait_timeout(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        handle = await sbx.commands.run("sleep 30", background=True)
        with pytest.raises(WaitTimeout):
            await handle.wait(timeout=0.2)
        await handle.kill()


@pytest.mark.timeout(30)
def test_a_relative_cwd_error_says_what_it_is_relative_to(conn: dict[str, Any]) -> None:
    with Sandbox.create(**conn) as sbx:
        with pytest.raises(InvalidArgument) as caught:
            sbx.commands.run("pwd", cwd="no/such/dir")
        assert caught.value.field == "cwd"
        message = str(caught.value)
        assert "relative to the sandbox's directory" in message
        assert sbx.info.workdir in message


@pytest.mark.timeout(60)
def test_serve_envd_on_a_busy_port_names_the_port(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        state_file = tmp_path / "daemon.json"
        env = cli_env(state_file)
        env["TMPDIR"] = str(tmp_path)
        serve = [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state_file)]
        out = subprocess.run(
            [*serve, "--envd", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 2
    assert f"127.0.0.1:{port}" in out.stderr and "envd" in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_ps_into_a_closed_pipe_ends_without_a_traceback(
    conn: dict[str, Any], daemon: DaemonServer, tmp_path: Path
) -> None:
    state_file = tmp_path / "daemon.json"
    write_state(
        state_file, DaemonState(daemon.url, os.getpid(), daemon.token or "", time.time(), "t")
    )
    sandboxes = [Sandbox.create(**conn) for _ in range(3)]
    try:
        read_end, write_end = os.pipe()
        os.close(read_end)  # `| head` that has already exited: every write gets EPIPE
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "sandboxkit", "ps", "--state-file", str(state_file)],
                env=cli_env(state_file),
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=30,
            )
        finally:
            os.close(write_end)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "BrokenPipeError" not in proc.stderr
        assert proc.returncode == 141  # as a process ended by SIGPIPE
    finally:
        for sbx in sandboxes:
            sbx.kill()
