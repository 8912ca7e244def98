"""The official ``e2b`` SDK, in debug mode, drives sandboxkit through the daemon's
envd-compatible endpoint (loopback only)."""

from __future__ import annotations

import base64
import json
import os
import pwd
import struct
import tempfile
import threading
import time
from pathlib import Path

import e2b
import httpx
import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b import AsyncSandbox, CommandExitException, NotFoundException, TimeoutException
from e2b import Sandbox as E2BSandbox
from e2b.envd.rpc import handle_rpc_exception
from e2b.exceptions import (
    FileNotFoundException,
    InvalidArgumentException,
    RateLimitException,
)
from e2b.sandbox.commands.command_handle import PtySize
from support import wait_until

from sandboxkit.client.sync import Sandbox
from sandboxkit.daemon.envd.connect import from_sandboxkit
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import ConsumerKicked, ProcessNotFound, StreamStalled
from sandboxkit.lab_options import LabOptions


@pytest.fixture(scope="module")
def envd(envd_daemon: DaemonServer) -> DaemonServer:
    return envd_daemon


@pytest.fixture
def sbx(envd: DaemonServer) -> E2BSandbox:
    assert envd.envd is not None
    return E2BSandbox.create(debug=True, sandbox_url=envd.envd.url)


def test_a_login_shell_in_the_suite_reads_a_home_of_its_own(sbx: E2BSandbox) -> None:
    """The SDK starts every command as ``bash -l -c``; unisolated (the suite's default),
    a login shell runs the profile of whatever ``HOME`` says. The suite's is its own, in
    its ``TMPDIR``: the machine's login profile is not the suite's to run (this one's ran
    pyenv's rehash, whose lock a killed shell left behind, and every login shell on the
    machine then waited a minute on it)."""
    home = sbx.commands.run("echo $HOME").stdout.strip()
    assert home != pwd.getpwuid(os.getuid()).pw_dir
    assert Path(home).is_relative_to(tempfile.gettempdir()), home


def test_run_foreground_with_envs_cwd_and_callbacks(sbx: E2BSandbox, tmp_path: object) -> None:
    out: list[str] = []
    err: list[str] = []
    result = sbx.commands.run(
        'echo "$GREETING"; pwd; echo oops >&2',
        envs={"GREETING": "hello"},
        cwd="/tmp",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert result.exit_code == 0
    assert result.stdout == "hello\n/tmp\n"
    assert "".join(out) == result.stdout
    assert result.stderr == "oops\n" == "".join(err)


def test_nonzero_exit_is_command_exit_exception(sbx: E2BSandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo partial; exit 7")
    assert info.value.exit_code == 7
    assert info.value.stdout == "partial\n"


def test_output_is_byte_exact_across_chunks(sbx: E2BSandbox) -> None:
    # "©" is 0xc2 0xa9: its two bytes arrive in separate writes (separate chunks).
    script = "printf 'ab\\302'; sleep 0.05; printf '\\251cd'; seq 1 20000"
    result = sbx.commands.run(script)
    expected = "ab©cd" + "".join(f"{i}\n" for i in range(1, 20001))
    assert result.stdout == expected


def test_timeout_is_timeout_exception(sbx: E2BSandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 20", timeout=0.5)


def test_background_connect_list_stdin_kill(sbx: E2BSandbox) -> None:
    handle = sbx.commands.run("echo ready; cat", background=True, stdin=True)
    assert handle.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(handle.pid, b"one\n")
    # A second reader of the running process: replayed from sandboxkit's log.
    again = sbx.commands.connect(handle.pid)
    sbx.commands.send_stdin(handle.pid, "two\n")
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "ready\none\ntwo\n"
    assert again.wait().stdout == "ready\none\ntwo\n"

    sleeper = sbx.commands.run("sleep 30", background=True)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as info:
        sleeper.wait()
    assert info.value.exit_code == -1
    assert info.value.error == "signal: killed"
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]


def test_stream_input(sbx: E2BSandbox) -> None:
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(handle.pid, [b"a", "b", b"\n"])
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "ab\n"


def test_pty_carries_raw_bytes(sbx: E2BSandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(handle.pid, b"printf '\\377\\376raw'; exit 3\n")
    got: list[bytes] = []
    with pytest.raises(CommandExitException) as info:
        handle.wait(on_pty=got.append)
    assert info.value.exit_code == 3
    assert b"\xff\xferaw" in b"".join(got)  # not UTF-8: passed through untouched


def test_unknown_process_is_not_found(sbx: E2BSandbox) -> None:
    with pytest.raises(NotFoundException):
        sbx.commands.connect(999_999)
    assert sbx.commands.kill(999_999) is False


def test_files_write_read(sbx: E2BSandbox) -> None:
    data = b"\xff\x00binary\n"
    info = sbx.files.write("sub/dir/blob.bin", data)
    assert info.path.endswith("sub/dir/blob.bin")
    assert sbx.files.read("sub/dir/blob.bin", format="bytes") == data
    sbx.files.write("script.py", "print('hi from a file')\n")
    assert sbx.commands.run("python3 script.py").stdout == "hi from a file\n"
    with pytest.raises(FileNotFoundException):
        sbx.files.read("missing.txt")
    with pytest.raises(InvalidArgumentException):
        sbx.files.write("/etc/sandboxkit-escape.txt", b"x")  # outside the sandbox


def test_files_list_stat_make_dir_rename_remove(sbx: E2BSandbox) -> None:
    sbx.files.write("fs/a.txt", "abc")
    assert sbx.files.make_dir("fs/sub") is True
    assert sbx.files.make_dir("fs/sub") is False  # already there
    listed = {e.name: e for e in sbx.files.list("fs", depth=2)}
    assert sorted(listed) == ["a.txt", "sub"]
    assert (listed["a.txt"].type.value, listed["a.txt"].size) == ("file", 3)
    assert listed["sub"].type.value == "dir"
    info = sbx.files.get_info("fs/a.txt")
    assert (info.size, info.permissions[0]) == (3, "-")
    assert sbx.files.rename("fs/a.txt", "fs/sub/b.txt").name == "b.txt"
    assert sbx.files.exists("fs/sub/b.txt") and not sbx.files.exists("fs/a.txt")
    assert sbx.files.read("fs/sub/b.txt") == "abc"
    sbx.files.remove("fs")
    assert not sbx.files.exists("fs")
    with pytest.raises(FileNotFoundException):
        sbx.files.list("fs")
    with pytest.raises(InvalidArgumentException):
        sbx.files.remove(".")  # the sandbox's own directory stays


async def test_async_sdk(envd: DaemonServer) -> None:
    assert envd.envd is not None
    sbx = await AsyncSandbox.create(debug=True, sandbox_url=envd.envd.url)
    chunks: list[str] = []
    result = await sbx.commands.run("echo async; exit 0", on_stdout=chunks.append)
    assert result.stdout == "async\n" == "".join(chunks)
    handle = await sbx.commands.run("sleep 0.2; echo late", background=True)
    connected = await sbx.commands.connect(handle.pid)
    assert (await connected.wait()).stdout == "late\n"
    with pytest.raises(CommandExitException) as info:
        await sbx.commands.run("exit 4")
    assert info.value.exit_code == 4


def test_token_is_required(envd: DaemonServer) -> None:
    assert envd.envd is not None and envd.token
    bare = envd.envd.url.removesuffix(f"/k/{envd.token}")
    sbx = E2BSandbox.create(debug=True, sandbox_url=bare)
    with pytest.raises(e2b.AuthenticationException):
        sbx.commands.run("echo no")
    assert httpx.get(f"{bare}/health", headers={"X-Access-Token": envd.token}).status_code == 204


# -- the wire, where the SDK cannot reach ---------------------------------------------


def _events(body: bytes) -> list[tuple[int, dict[str, object]]]:
    out = []
    pos = 0
    while pos < len(body):
        flags, size = struct.unpack_from(">BI", body, pos)
        out.append((flags, json.loads(body[pos + 5 : pos + 5 + size])))
        pos += 5 + size
    return out


def _start(
    envd: DaemonServer, cmd: str, interval: str, **headers: str
) -> list[tuple[int, dict[str, object]]]:
    assert envd.envd is not None
    message = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}}).encode()
    response = httpx.post(
        f"{envd.envd.url}/process.Process/Start",
        content=struct.pack(">BI", 0, len(message)) + message,
        headers={
            "content-type": "application/connect+json",
            "keepalive-ping-interval": interval,
            **headers,
        },
        timeout=10,
    )
    assert response.status_code == 200
    return _events(response.content)


@pytest.mark.slow
def test_keepalives_at_the_requested_interval_and_zero_is_none(envd: DaemonServer) -> None:
    events = _start(envd, "sleep 0.5; printf '\\377'", "0.05")
    keepalives = [e for f, e in events if e.get("event") == {"keepalive": {}}]
    assert len(keepalives) >= 4
    assert events[-1] == (2, {})
    data = [e["event"] for _, e in events if "data" in e.get("event", {})]  # type: ignore[operator]
    assert data == [{"data": {"stdout": base64.b64encode(b"\xff").decode()}}]
    for interval in ("0", "-1", "junk"):
        events = _start(envd, "sleep 0.3", interval)
        assert not [e for _, e in events if e.get("event") == {"keepalive": {}}]
        assert events[-1] == (2, {})


def test_deadline_ends_the_stream_with_deadline_exceeded(envd: DaemonServer) -> None:
    started = time.monotonic()
    events = _start(envd, "echo before; sleep 20", "0", **{"connect-timeout-ms": "400"})
    assert time.monotonic() - started < 10
    flags, end = events[-1]
    assert flags == 2 and end["error"]["code"] == "deadline_exceeded"  # type: ignore[index]
    out = [e["event"] for _, e in events if "data" in e.get("event", {})]  # type: ignore[operator]
    assert out == [{"data": {"stdout": base64.b64encode(b"before\n").decode()}}]


def test_error_codes_reach_sdk_users_typed() -> None:
    def shown(exc: Exception) -> Exception:
        error = from_sandboxkit(exc)  # type: ignore[arg-type]
        return handle_rpc_exception(ConnectError(Code(error.code), error.message))

    kicked = shown(ConsumerKicked("no progress", pid=1, cursor=0, blocked_for=1.0, reason="x"))
    assert not isinstance(kicked, RateLimitException)
    assert "reattach" in str(kicked)
    assert isinstance(shown(ProcessNotFound("gone", sandbox_id="s", pid=1)), NotFoundException)
    assert isinstance(shown(StreamStalled("slow")), TimeoutException)


@pytest.mark.slow
def test_reattach_after_pause_resume_with_ghosts(envd: DaemonServer) -> None:
    """The seed's F1 through the official SDK: a reader whose stream was open at a pause
    is cut at resume (its daemon-side consumer lives on as a ghost); connect(pid) after
    the resume gets every byte, and the ghost wedges nothing under the cursor policy."""
    assert envd.envd is not None
    own = Sandbox.create(lab=LabOptions(pause_ghosts=True), url=envd.url, token=envd.token)
    try:
        sbx = E2BSandbox.create(
            debug=True, sandbox_url=f"{envd.envd.url}/sandboxes/{own.sandbox_id}"
        )
        handle = sbx.commands.run(
            "for i in $(seq 1 400); do echo line-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; "
            "sleep 0.002; done",
            background=True,
        )
        seen: list[str] = []
        failure: list[BaseException] = []

        def read() -> None:
            try:
                for stdout, _, _ in handle:
                    if stdout:
                        seen.append(stdout)
            except BaseException as exc:
                failure.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        wait_until(lambda: len("".join(seen)) > 0, what="first output")
        own.pause()
        own.resume()
        reader.join(10)
        assert not reader.is_alive()
        assert failure and "pause/resume" in str(failure[0])
        ghosts = own.consumers().query("ghost and role == 'e2b'")
        assert len(ghosts) == 1  # the cut stream's consumer lives on, as after a restore
        result = sbx.commands.connect(handle.pid, timeout=30).wait()
        expected = "".join(f"line-{i}-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n" for i in range(1, 401))
        assert result.stdout == expected
    finally:
        own.kill()


@pytest.mark.slow
async def test_lab_reattach_with_the_e2b_sdk_blocking_stalls_cursor_does_not(
    envd: DaemonServer,
) -> None:
    """The seed's bisect with the official SDK as the client: pause/resume via sandboxkit,
    connect(pid) via e2b; the pause-snapshot ghost wedges ``blocking``, not ``cursor``."""
    from sandboxkit.lab.e2b_reattach import compare_e2b

    assert envd.envd is not None
    frame = await compare_e2b(
        ("blocking", "cursor"),
        1,
        url=envd.url,
        token=envd.token,
        envd_url=envd.envd.url,
        deadline=1.5,
    )
    stalled = dict(zip(frame["policy"], frame["stalled"], strict=True))
    assert stalled == {"blocking": True, "cursor": False}


def test_bad_input_gets_typed_connect_errors_and_the_endpoint_keeps_serving(
    envd: DaemonServer,
) -> None:
    assert envd.envd is not None
    base = envd.envd.url
    unary = {"content-type": "application/json"}
    cases = [
        (b"not json", "invalid_argument", 400),
        (b"[1]", "invalid_argument", 400),
        (b'{"process": {"pid": "x"}}', "invalid_argument", 400),
        (b'{"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}', "not_found", 404),
        (b'{"process": {"pid": 1}, "signal": "SIGNAL_SIGHUP"}', "invalid_argument", 400),
        (b'{"process": {}, "signal": "SIGNAL_SIGKILL"}', "invalid_argument", 400),
    ]
    for body, code, status in cases:
        response = httpx.post(f"{base}/process.Process/SendSignal", content=body, headers=unary)
        assert (response.status_code, response.json()["code"]) == (status, code), body
    # A stream's errors travel in its end-of-stream message (HTTP 200).
    for payload in (b"\x00\x00\x00\x00\x03abc", b"\x00\x00\x00\x00\x02{}", b"\x01\x00\x00\x00\x00"):
        response = httpx.post(
            f"{base}/process.Process/Start",
            content=payload,
            headers={"content-type": "application/connect+json"},
        )
        assert response.status_code == 200
        (flags, end), *_ = _events(response.content)
        assert flags == 2 and end["error"]["code"] == "invalid_argument"  # type: ignore[index]
    assert httpx.get(f"{base}/health").status_code == 204
    assert httpx.post(f"{base}/process.Process/List", content=b"{}", headers=unary).json()
