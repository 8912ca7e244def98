"""Keepalives and the client watchdog (F5): idle streams carry keepalive frames with the
process and sandbox state; a stream that goes silent for ``watchdog_multiple`` keepalive
intervals is declared dead and reattached from its cursor, byte-exact; and no per-chunk
read timeout kills a healthy stream that is merely idle."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import child_env, fast_config
from support import poll as _poll

import sandboxkit
from sandboxkit import AsyncSandbox
from sandboxkit.client.api import ApiClient
from sandboxkit.client.transport import raw_unary
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.errors import CommandExitError, DaemonUnavailable
from sandboxkit.statefile import STATE_FILE_ENV, DaemonState, read_state
from sandboxkit.wire import Frame, FrameKind

KEEPALIVE = 0.2
MULTIPLE = 2.0  # ProcessStream's default watchdog_multiple
BOUND = KEEPALIVE * MULTIPLE
PROBE = 0.5  # the health probe's bound at this keepalive (ProcessStream.probe_timeout)


@pytest.fixture
def daemon_config() -> DaemonConfig:
    return fast_config(keepalive_interval=KEEPALIVE)


async def _true(value: bool) -> bool:
    return value


# -- f. keepalives carry state -----------------------------------------------------------

# Prints, waits for a line on stdin, prints again and exits with 3.
WAITER = """
import sys
print("ready", flush=True)
sys.stdin.readline()
print("bye", flush=True)
sys.exit(3)
"""


class _Frames:
    """A raw stream read into a queue of (monotonic arrival, frame)."""

    def __init__(self, api: ApiClient, path: str) -> None:
        self.queue: asyncio.Queue[tuple[float, Frame]] = asyncio.Queue()
        self.task = asyncio.create_task(self._read(api, path))

    async def _read(self, api: ApiClient, path: str) -> None:
        async with api.stream(path, cursor=0, name="watcher") as frames:
            async for frame in frames:
                await self.queue.put((time.monotonic(), frame))
                if frame.kind in (FrameKind.END, FrameKind.ERROR):
                    return

    async def next(self, timeout: float) -> tuple[float, Frame]:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"no frame within {timeout}s") from None

    async def keepalive(self, timeout: float, **states: str) -> tuple[float, Frame]:
        """The first keepalive showing ``states`` within ``timeout`` (other keepalives may
        come first: one built just before a transition shows the old state)."""
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any]] = []
        while True:
            try:
                at, frame = await self.next(max(deadline - time.monotonic(), 0.001))
            except AssertionError:
                raise AssertionError(f"no keepalive with {states} in {timeout}s: {seen}") from None
            assert frame.kind is FrameKind.KEEPALIVE, frame
            if all(frame.meta.get(k) == v for k, v in states.items()):
                return at, frame
            seen.append(frame.meta)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.mark.timeout(30)
async def test_keepalives_carry_process_and_sandbox_state(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        info = await sbx.commands.start([sys.executable, "-c", WAITER])
        stream = _Frames(api, f"/sandboxes/{sbx.sandbox_id}/processes/{info.pid}/stream")
        try:
            _, start = await stream.next(5)
            assert start.kind is FrameKind.START
            assert start.meta["keepalive_interval"] == KEEPALIVE
            assert start.meta["process_state"] == "running"
            assert start.meta["sandbox_state"] == "running"
            output = b""
            while output != b"ready\n":  # one chunk or several: the pipe decides
                _, data = await stream.next(5)
                assert data.kind is FrameKind.DATA, data
                output += data.payload
                assert b"ready\n".startswith(output), output
            head = data.meta["seq"] + 1

            # Idle: keepalives about every interval, each with both states and the cursor.
            stamps = []
            for _ in range(4):
                at, frame = await stream.next(3 * KEEPALIVE)
                assert frame.kind is FrameKind.KEEPALIVE, frame
                assert frame.meta["process_state"] == "running"
                assert frame.meta["sandbox_state"] == "running"
                assert frame.meta["cursor"] == head and frame.meta["head"] == head
                stamps.append(at)
            spacing = [b - a for a, b in itertools.pairwise(stamps)]
            assert all(0.5 * KEEPALIVE < s < 2.5 * KEEPALIVE for s in spacing), spacing

            # Paused: the next keepalives say so (one built before the pause may not).
            await sbx.pause()
            paused_at = time.monotonic()
            at, frame = await stream.keepalive(
                3 * KEEPALIVE, process_state="paused", sandbox_state="paused"
            )
            assert at - paused_at < 2.5 * KEEPALIVE
            for _ in range(2):
                _, frame = await stream.next(3 * KEEPALIVE)
                assert frame.kind is FrameKind.KEEPALIVE
                assert (frame.meta["process_state"], frame.meta["sandbox_state"]) == (
                    "paused",
                    "paused",
                )

            # Resumed: running again.
            await sbx.resume()
            await stream.keepalive(3 * KEEPALIVE, process_state="running", sandbox_state="running")

            # The process exits: its last output, then the end frame with the exit code.
            await sbx.commands.send_stdin(info.pid, "x\n")
            output = b""
            frame = (await stream.next(5))[1]
            while frame.kind is not FrameKind.END:
                if frame.kind is FrameKind.DATA:
                    output += frame.payload
                else:
                    assert frame.kind is FrameKind.KEEPALIVE, frame
                frame = (await stream.next(5))[1]
            assert output == b"bye\n"
            assert frame.meta["exit_code"] == 3
            await asyncio.wait_for(stream.task, 5)
            assert stream.queue.empty()
        finally:
            await stream.close()
            await api.aclose()


# -- g. the watchdog against a frozen daemon ---------------------------------------------

LINES = 400
# Numbered lines, one every 5 ms: ~2 s of output.
TICKER = """
import sys, time
for i in range(int(sys.argv[1])):
    sys.stdout.write("line %05d\\n" % i)
    sys.stdout.flush()
    time.sleep(0.005)  # sleep-ok: the child writes at a steady rate
"""


def _env(state_path: Path) -> dict[str, str]:
    """This checkout importable by the daemon, and no daemon settings inherited."""
    env = child_env()
    env[STATE_FILE_ENV] = str(state_path)
    repo = str(Path(sandboxkit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def _served(tmp_path: Path) -> Iterator[tuple[DaemonState, subprocess.Popen[bytes]]]:
    """``sandboxkit serve`` as a separate process with a 0.2 s keepalive; always thawed
    and stopped on exit."""
    state_path = tmp_path / "d.json"
    env = _env(state_path)
    log = tmp_path / "serve.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sandboxkit",
                "serve",
                "--state-file",
                str(state_path),
                "--keepalive-interval",
                str(KEEPALIVE),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            state = read_state(state_path)
            if state is not None and state.pid == proc.pid:
                break
            if proc.poll() is not None:
                raise AssertionError(f"serve exited: {log.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError("serve did not write its state file")
            time.sleep(0.02)  # sleep-ok: poll interval
        yield state, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        subprocess.run(
            [sys.executable, "-m", "sandboxkit", "stop", "--state-file", str(state_path)],
            env=env,
            capture_output=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_a_frozen_daemon_is_reported_to_a_stream_within_two_keepalives(
    tmp_path: Path,
) -> None:
    """A hung daemon (SIGSTOP: its kernel still accepts connections, nobody answers) is
    reported as DaemonUnavailable once the stream was silent for two keepalive periods and
    a health probe got no answer (was: reattached into the frozen daemon for a minute,
    69 s at the default interval); reconnecting from the handle's cursor after the thaw
    misses and repeats nothing."""
    with _served(tmp_path) as (state, proc):
        async with await AsyncSandbox.create(url=state.url, token=state.token) as sbx:
            info = await sbx.commands.start([sys.executable, "-c", TICKER, str(LINES)])
            follower = await AsyncSandbox.connect(sbx.sandbox_id, url=state.url, token=state.token)
            chunks: list[str] = []
            handle = await follower.commands.connect(
                info.pid, cursor=0, on_stdout=chunks.append, lines=False
            )
            stats = handle.stream.stats
            try:
                await _poll(lambda: _true(len("".join(chunks)) > 50 * 11), 10, "some lines")
                assert handle.stream.watchdog_bound == pytest.approx(BOUND)

                os.kill(proc.pid, signal.SIGSTOP)
                frozen_at = time.monotonic()
                try:
                    with pytest.raises(DaemonUnavailable):
                        await asyncio.wait_for(handle.wait(), BOUND + PROBE + 2.0)
                    detected = time.monotonic() - frozen_at
                    assert detected >= 0.8 * BOUND, detected
                    received_while_frozen = len("".join(chunks))
                finally:
                    os.kill(proc.pid, signal.SIGCONT)
                again = await follower.commands.connect(
                    info.pid, cursor=handle.cursor, on_stdout=chunks.append, lines=False
                )
                result = await asyncio.wait_for(again.wait(), 20)
            finally:
                await handle.disconnect()
                await follower.close()

        assert result.exit_code == 0
        text = "".join(chunks)
        expected = "".join(f"line {i:05d}\n" for i in range(LINES))
        assert text == expected, "output lost or duplicated across the reconnect"
        assert received_while_frozen < len(expected)
        assert stats.gaps == 0, stats
        print(f"frozen daemon reported to the stream {detected:.3f}s after SIGSTOP; {stats}")


@pytest.mark.timeout(60)
async def test_a_frozen_daemon_is_reported_to_a_unary_request_after_a_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the hung daemon does not answer checks the daemon's health on another
    connection after ``PROBE_AFTER``; no answer within ``PROBE_TIMEOUT`` is
    DaemonUnavailable (was: the whole 30 s request timeout)."""
    monkeypatch.setattr(raw_unary, "PROBE_AFTER", 0.5)
    monkeypatch.setattr(raw_unary, "PROBE_TIMEOUT", 0.5)
    with _served(tmp_path) as (state, proc):
        async with await AsyncSandbox.create(url=state.url, token=state.token) as sbx:
            os.kill(proc.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                with pytest.raises(DaemonUnavailable):
                    await asyncio.wait_for(sbx.commands.list(), 5.0)
                detected = time.monotonic() - frozen_at
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            # Thawed, the same client carries on.
            assert await sbx.commands.list() == []
        print(f"frozen daemon reported to a unary request {detected:.3f}s after SIGSTOP")


@pytest.mark.timeout(60)
async def test_a_frozen_daemon_is_reported_to_connect_after_a_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``connect()`` opens the process's stream before a handle exists; a daemon that
    does not answer it is asked for its health after ``PROBE_AFTER``, as for a unary
    request, and no answer within ``PROBE_TIMEOUT`` is DaemonUnavailable (not the
    stream's own 10 s wait for a response head)."""
    monkeypatch.setattr(raw_unary, "PROBE_AFTER", 0.5)
    monkeypatch.setattr(raw_unary, "PROBE_TIMEOUT", 0.5)
    with _served(tmp_path) as (state, proc):
        async with await AsyncSandbox.create(url=state.url, token=state.token) as sbx:
            info = await sbx.commands.start(["sleep", "30"])
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(DaemonUnavailable, match="hung"):
                    await asyncio.wait_for(sbx.commands.connect(info.pid, cursor=0), 5.0)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            handle = await sbx.commands.connect(info.pid, cursor=0)  # thawed: as ever
            await sbx.commands.kill(info.pid)
            with pytest.raises(CommandExitError):
                await handle.wait()


# -- h. an idle but healthy stream is left alone ---------------------------------------

SLEEPER = """
import sys, time
print("first", flush=True)
time.sleep(float(sys.argv[1]))
print("second", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(30)
async def test_idle_stream_is_not_killed_by_a_read_timeout(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        lines: list[str] = []
        started = time.monotonic()
        handle = await sbx.commands.run(
            [sys.executable, "-c", SLEEPER, str(3 * BOUND)],
            background=True,
            on_stdout=lines.append,
            lines=False,
        )
        result = await asyncio.wait_for(handle.wait(), 15)
        elapsed = time.monotonic() - started
        assert elapsed >= 3 * BOUND
        assert "".join(lines) == "first\nsecond\n"
        assert result.exit_code == 0
        stats = handle.stream.stats
        assert handle.stream.watchdog_bound == pytest.approx(BOUND)
        assert stats.watchdog_expiries == 0, stats
        assert stats.attaches == 1, stats
        assert stats.disconnects == 0 and stats.kicks == 0, stats
        # What kept the watchdog fed through the silence: keepalives (start, 2 data, end,
        # and about one keepalive per interval of the 1.8 s sleep).
        assert stats.frames >= 4 + int(3 * BOUND / KEEPALIVE) // 2, stats
