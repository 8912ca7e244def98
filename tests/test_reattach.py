"""Reattach (F3, restart, daemon lifecycle): output produced while nobody is attached is
kept and replayed byte-exact from any cursor; restart links old → new; a second client
process finds the daemon through the state file and continues from its cursor."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from support import end_process, wait_until
from support import poll as _poll

from sandboxkit import AsyncSandbox, CommandExitError, Sandbox
from sandboxkit.client.api import ApiClient
from sandboxkit.client.local import probe
from sandboxkit.statefile import read_state
from sandboxkit.wire import Frame, FrameKind


async def _read_frames(api: ApiClient, path: str, **query: Any) -> tuple[Frame, list[Frame], Frame]:
    """Read one stream to its end: (start frame, data frames, end frame)."""
    start: Frame | None = None
    data: list[Frame] = []
    async with api.stream(path, **query) as frames:
        async for frame in frames:
            if frame.kind is FrameKind.START:
                start = frame
            elif frame.kind is FrameKind.DATA:
                data.append(frame)
            elif frame.kind is FrameKind.GAP:
                raise AssertionError(f"unexpected gap: {frame.meta}")
            elif frame.kind is FrameKind.ERROR:
                raise frame.error()
            elif frame.kind is FrameKind.END:
                assert start is not None
                return start, data, frame
    raise AssertionError("stream ended without an end frame")


def _payload(frames: list[Frame], stream: str) -> bytes:
    return b"".join(f.payload for f in frames if f.meta["stream"] == stream)


# Output with bytes that are not UTF-8, on stdout and stderr, in many writes.
BINARY_WRITER = """
import sys, time
out, err = sys.stdout.buffer, sys.stderr.buffer
for i in range(400):
    out.write(b"line %d \\xff\\xfe\\x80 " % i + bytes(range(256)) * 4 + b"\\n")
    if i % 50 == 0:
        out.flush()
        err.write(b"err %d \\xc3\\x28\\n" % i)
        err.flush()
        time.sleep(0.002)  # sleep-ok: pacing (child script or poll)
out.flush()
"""


def _binary_expected() -> tuple[bytes, bytes]:
    stdout = b"".join(
        b"line " + str(i).encode() + b" \xff\xfe\x80 " + bytes(range(256)) * 4 + b"\n"
        for i in range(400)
    )
    stderr = b"".join(b"err " + str(i).encode() + b" \xc3\x28\n" for i in range(0, 400, 50))
    return stdout, stderr


@pytest.mark.timeout(30)
async def test_unattended_output_is_replayed_byte_exact_from_any_cursor(
    conn: dict[str, str],
) -> None:
    expected_out, expected_err = _binary_expected()
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        try:
            # Start without following: nobody is attached while it writes and exits.
            info = await sbx.commands.start([sys.executable, "-c", BINARY_WRITER])
            pid = info.pid

            async def exited() -> bool:
                return (await sbx.commands.get(pid)).state == "exited"

            await _poll(exited, 10, "the writer to exit")
            assert await api.call("GET", f"/sandboxes/{sbx.sandbox_id}/consumers") == []
            done = await sbx.commands.get(pid)
            assert done.total_bytes == len(expected_out) + len(expected_err)

            # Replay from 0 through raw frames: every byte, including the non-UTF-8 ones.
            path = f"/sandboxes/{sbx.sandbox_id}/processes/{pid}/stream"
            start, data, end = await _read_frames(api, path, cursor=0)
            assert start.meta["cursor"] == 0
            assert end.meta["exit_code"] == 0
            assert _payload(data, "stdout") == expected_out
            assert _payload(data, "stderr") == expected_err
            seqs = [f.meta["seq"] for f in data]
            assert seqs == list(range(done.head))
            sizes = [len(f.payload) for f in data]
            assert [f.meta["offset"] for f in data] == [sum(sizes[:i]) for i in range(len(data))]
            assert len(data) >= 4, "need several chunks to test a mid-log cursor"

            # Reattach from a mid cursor k: exactly chunks k.. — no duplicate, no loss.
            for k in (1, len(data) // 2, len(data) - 1, len(data)):
                start_k, data_k, end_k = await _read_frames(api, path, cursor=k)
                assert start_k.meta["cursor"] == k
                assert [f.meta["seq"] for f in data_k] == seqs[k:]
                assert [(f.meta["stream"], f.payload) for f in data_k] == [
                    (f.meta["stream"], f.payload) for f in data[k:]
                ]
                if data_k:
                    assert data_k[0].meta["offset"] == sum(sizes[:k])
                assert end_k.meta["exit_code"] == 0

            # The SDK's replay decodes the same bytes (invalid sequences replaced).
            seen: list[str] = []
            handle = await sbx.commands.connect(pid, cursor=0, on_stdout=seen.append, lines=False)
            result = await asyncio.wait_for(handle.wait(), 10)
            assert result.stdout == expected_out.decode("utf-8", "replace")
            assert "".join(seen) == result.stdout
            assert result.stderr == expected_err.decode("utf-8", "replace")
        finally:
            await api.aclose()


# Two phases of numbered lines; the second only after a line on stdin.
PHASED_WRITER = """
import sys
for i in range(0, 300):
    print("n%05d" % i, flush=True)
sys.stdin.readline()
for i in range(300, 900):
    print("n%05d" % i, flush=True)
"""


@pytest.mark.timeout(30)
async def test_reattach_from_cursor_of_a_disconnected_stream_gets_exactly_the_rest(
    conn: dict[str, str],
) -> None:
    phase1 = "".join(f"n{i:05d}\n" for i in range(300))
    phase2 = "".join(f"n{i:05d}\n" for i in range(300, 900))
    async with await AsyncSandbox.create(**conn) as sbx:
        info = await sbx.commands.start([sys.executable, "-c", PHASED_WRITER])
        pid = info.pid

        first = await sbx.commands.connect(pid, cursor=0)
        await _poll(_async(lambda: first.stdout == phase1), 10, "phase 1 on the first stream")
        await first.disconnect()
        cursor = first.cursor
        assert cursor is not None and cursor > 0
        assert first.stdout == phase1

        async def detached() -> bool:
            rows = await sbx.consumers()
            return bool((rows["pid"] == pid).any()) and rows["closed_at"].notna().all()

        await _poll(detached, 10, "the first consumer to detach")

        # Phase 2 is written while nobody is attached.
        await sbx.commands.send_stdin(pid, "go\n")

        async def exited() -> bool:
            return (await sbx.commands.get(pid)).state == "exited"

        await _poll(exited, 10, "the writer to exit")
        assert (await sbx.commands.get(pid)).consumers == 0

        second = await sbx.commands.connect(pid, cursor=cursor)
        result = await asyncio.wait_for(second.wait(), 10)
        assert result.stdout == phase2  # exactly the rest: no duplicate, no loss
        assert result.exit_code == 0
        assert first.stdout + result.stdout == phase1 + phase2


def _async(predicate: Any) -> Any:
    async def check() -> Any:
        return predicate()

    return check


@pytest.mark.timeout(30)
async def test_restart_runs_the_same_spec_as_a_new_linked_process(conn: dict[str, str]) -> None:
    cmd = "echo run pid=$$; exec sleep 30"
    async with await AsyncSandbox.create(**conn) as sbx:
        old = await sbx.commands.start(cmd)
        first = await sbx.commands.connect(old.pid, cursor=0)
        await _poll(_async(lambda: f"run pid={old.pid}\n" in first.stdout), 10, "first run")

        new = await sbx.commands.restart(old.pid)

        assert new.pid != old.pid
        assert new.cmd == cmd and new.argv == old.argv
        assert new.state == "running"
        assert new.restarted_from == old.pid and new.restarted_to is None

        # The old one is exited (killed), its stream ended; the OS process is gone.
        old_now = await sbx.commands.get(old.pid)
        assert old_now.state == "exited" and old_now.exit_code != 0
        assert old_now.restarted_to == new.pid
        with pytest.raises(CommandExitError):
            await asyncio.wait_for(first.wait(), 10)
        assert first.exit_code == old_now.exit_code
        assert not _alive(old.pid)

        # The new one really runs the spec: its own output, with its own pid.
        second = await sbx.commands.connect(new.pid, cursor=0)
        await _poll(
            _async(lambda: second.stdout == f"run pid={new.pid}\n"), 10, "the restarted run"
        )
        assert _alive(new.pid)
        await second.disconnect()

        events = await sbx.raw_events()
        restarted = [e for e in events if e["kind"] == "process.restarted"]
        assert len(restarted) == 1
        assert restarted[0]["data"]["old_pid"] == old.pid
        assert restarted[0]["data"]["new_pid"] == new.pid
        assert restarted[0]["pid"] == new.pid
        kinds = [(e["kind"], e["pid"]) for e in events]
        assert kinds.index(("process.exited", old.pid)) < kinds.index(
            ("process.restarted", new.pid)
        )

        listed = {p.pid: p for p in await sbx.commands.list()}
        assert listed[old.pid].restarted_to == new.pid
        assert listed[new.pid].restarted_from == old.pid


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- a second client process finds the daemon through the state file -----------------

# One write per line (print+flush, not -u, which writes the text and the newline apart),
# so chunk boundaries fall between lines.
# Each number and its newline are two writes (as print() makes them unbuffered, under
# PYTHONUNBUFFERED=1), so a disconnect may fall between them: the first client then
# stops mid-line, and the second continues with the rest of that line.
COUNTER = """
import itertools, os, time
for i in itertools.count():
    os.write(1, str(i).encode())
    time.sleep(0.001)  # sleep-ok: pacing (child script or poll)
    os.write(1, b"\\n")
    time.sleep(0.001)  # sleep-ok: pacing (child script or poll)
"""

SECOND_CLIENT = """
import json, os, sys, time
from sandboxkit import Sandbox
assert "SANDBOXKIT_URL" not in os.environ and "SANDBOXKIT_TOKEN" not in os.environ
sid, pid, cursor, want = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sbx = Sandbox.connect(sid)
handle = sbx.commands.connect(pid, cursor=cursor)
deadline = time.monotonic() + 20
while handle.stdout.count("\\n") < want:
    if time.monotonic() > deadline:
        sys.exit("timed out: " + repr(handle.stdout[-200:]))
    time.sleep(0.01)  # sleep-ok: pacing (child script or poll)
text = handle.stdout
handle.disconnect()
sbx.close()
print(json.dumps(text))
"""


def _client_env(state_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SANDBOXKIT_URL", "SANDBOXKIT_TOKEN")}
    env["SANDBOXKIT_STATE_FILE"] = str(state_path)
    return env


@pytest.mark.timeout(60)
def test_second_client_process_reattaches_through_the_state_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_path = tmp_path / "daemon.json"
    env = _client_env(state_path)
    log = open(tmp_path / "daemon.log", "wb")  # noqa: SIM115 - closed in finally
    daemon = subprocess.Popen(
        [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state_path)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    sandbox_pids: set[int] = set()
    try:
        wait_until(
            lambda: (s := read_state(state_path)) is not None and s.pid == daemon.pid and probe(s),
            timeout=30,
            what="the daemon to publish its state file",
        )
        assert stat.S_IMODE(os.stat(state_path).st_mode) == 0o600
        raw = json.loads(state_path.read_text())
        assert raw["pid"] == daemon.pid
        assert raw["url"].startswith("http://127.0.0.1:")
        assert isinstance(raw["token"], str) and len(raw["token"]) >= 16

        # This process finds the daemon through the state file alone.
        monkeypatch.delenv("SANDBOXKIT_URL", raising=False)
        monkeypatch.delenv("SANDBOXKIT_TOKEN", raising=False)
        monkeypatch.setenv("SANDBOXKIT_STATE_FILE", str(state_path))
        sbx = Sandbox.create()
        try:
            handle = sbx.commands.run([sys.executable, "-c", COUNTER], background=True)
            pid = handle.pid
            sandbox_pids = {p.pid for p in psutil.Process(daemon.pid).children(recursive=True)}
            assert pid in sandbox_pids
            wait_until(lambda: handle.stdout.count("\n") >= 50, 10, what="first 50 lines")
            handle.disconnect()
            cursor = handle.cursor
            first = handle.stdout
        finally:
            sbx.close()  # the client goes away; the sandbox and process keep running
        assert cursor is not None
        first_lines = first.split("\n")  # the last one may be cut off: ''
        assert first_lines[:-1] == [str(i) for i in range(len(first_lines) - 1)]

        state = read_state(state_path)
        assert state is not None
        headers = {"Authorization": f"Bearer {state.token}"}

        def detached() -> bool:
            rows = httpx.get(f"{state.url}/consumers", headers=headers, timeout=5).json()
            return bool(rows) and all(r["closed_at"] is not None for r in rows)

        wait_until(detached, 10, what="the first client to detach")

        want = 200
        second = subprocess.run(
            [sys.executable, "-c", SECOND_CLIENT, sbx.sandbox_id, str(pid), str(cursor), str(want)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 0, second.stderr
        second_text = json.loads(second.stdout.strip().splitlines()[-1])
        # Exactly where the first client left off, with nothing skipped or repeated (the
        # second continues a line the first stopped in).
        lines = (first + second_text).split("\n")[:-1]
        assert lines == [str(i) for i in range(len(lines))]
        assert len(lines) >= len(first_lines) - 1 + want
        after = read_state(state_path)
        assert after is not None and after.pid == daemon.pid  # no second daemon was started
        assert _alive(pid)

        stop = subprocess.run(
            [sys.executable, "-m", "sandboxkit", "stop", "--state-file", str(state_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert stop.returncode == 0, stop.stderr
        assert daemon.wait(timeout=10) is not None
        assert not state_path.exists()
        left = [p for p in sandbox_pids if _alive(p)]
        assert not left, f"sandbox processes outlived the daemon: {left}"
    finally:
        end_process(daemon)  # (the test failed early: still running)
        for p in sandbox_pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        log.close()
