"""Definitive resume (F8): reattaching to a process always gets an answer. A process that
exited within its result TTL replays its remaining output and its exit code; an unknown or
evicted one is a typed ``ResultUnavailable`` at once, never silence; a reattach racing the
exit never misreports the result as unavailable and always gets the end."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import pytest
from support import fast_config
from support import poll as _poll

from sandboxkit import AsyncSandbox, CommandExitError, ResultUnavailable
from sandboxkit.client.api import ApiClient
from sandboxkit.client.results import Failed, Ok
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.wire import Frame, FrameDecoder, FrameKind

DEFINITIVE = 1.0
"""An unavailable result must be reported within this many seconds: far below the client's
watchdog (10 s before the first frame) and its reattach budget (60 s)."""

SHORT_TTL = {"result_ttl": 0.3, "housekeeping_interval": 0.05}


@pytest.fixture
def daemon_config(request: pytest.FixtureRequest) -> DaemonConfig:
    """The in-process daemon's settings; a test may pass overrides through indirect
    parametrization (e.g. a short result TTL)."""
    return fast_config(**getattr(request, "param", {}))


async def _wait_exited(sbx: AsyncSandbox, pid: int) -> None:
    async def exited() -> bool:
        return (await sbx.commands.get(pid)).state == "exited"

    await _poll(exited, 10, f"process {pid} to exit")


async def _raw_frames(api: ApiClient, sandbox_id: str, pid: int, cursor: int) -> list[Frame]:
    path = f"/sandboxes/{sandbox_id}/processes/{pid}/stream"
    frames: list[Frame] = []
    async with api.stream(path, cursor=cursor) as stream:
        async for frame in stream:
            frames.append(frame)
            if frame.kind in (FrameKind.END, FrameKind.ERROR):
                return frames
    raise AssertionError("stream ended without an end frame")


# A hundred lines, flushed one by one (several chunks), then exit 3.
HUNDRED_LINES = """
import sys, time
for i in range(1, 101):
    print("line %d %s" % (i, "x" * 100), flush=True)
    if i % 10 == 0:
        time.sleep(0.002)  # sleep-ok: the writer's pace
sys.exit(3)
"""
EXPECTED = "".join(f"line {i} {'x' * 100}\n" for i in range(1, 101))


# -- (e) an exited process within its TTL replays the rest and its exit ---------------------


@pytest.mark.timeout(30)
async def test_connect_after_exit_replays_the_rest_and_the_exit_code(
    conn: dict[str, str],
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        try:
            info = await sbx.commands.start([sys.executable, "-c", HUNDRED_LINES])
            pid = info.pid
            await _wait_exited(sbx, pid)

            frames = await _raw_frames(api, sbx.sandbox_id, pid, 0)
            data = [f for f in frames if f.kind is FrameKind.DATA]
            assert b"".join(f.payload for f in data).decode() == EXPECTED
            assert frames[-1].kind is FrameKind.END
            assert frames[-1].meta["exit_code"] == 3
            assert len(data) >= 3, "need several chunks to reattach mid-log"

            for cursor in (len(data) // 2, 1, len(data) - 1, len(data)):
                offset = data[cursor].meta["offset"] if cursor < len(data) else len(EXPECTED)
                handle = await sbx.commands.connect(pid, cursor=cursor)
                with pytest.raises(CommandExitError) as failure:
                    await asyncio.wait_for(handle.wait(), 10)
                assert failure.value.details["exit_code"] == 3
                assert handle.exit_code == 3
                assert handle.stdout == EXPECTED[offset:], f"cursor {cursor}"
                assert failure.value.details["result"].stdout == EXPECTED[offset:]
                assert handle.cursor == len(data)
        finally:
            await api.aclose()


@pytest.mark.timeout(30)
async def test_try_connect_after_exit_is_ok_or_a_typed_exit_failure(
    conn: dict[str, str],
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        good = await sbx.commands.start("printf 'fine\\n'; exit 0")
        bad = await sbx.commands.start([sys.executable, "-c", HUNDRED_LINES])
        await _wait_exited(sbx, good.pid)
        await _wait_exited(sbx, bad.pid)

        ok = await asyncio.wait_for(sbx.commands.try_connect(good.pid, cursor=0), 10)
        assert isinstance(ok, Ok)
        assert ok.ok
        assert ok.value.stdout == "fine\n"
        assert ok.value.exit_code == 0

        failed = await asyncio.wait_for(sbx.commands.try_connect(bad.pid, cursor=0), 10)
        assert isinstance(failed, Failed)
        assert not failed.ok
        assert isinstance(failed.error, CommandExitError)
        assert failed.code == "command_exit"
        assert failed.error.details["exit_code"] == 3
        assert failed.error.details["result"].stdout == EXPECTED


# -- (f) unknown and evicted: a typed answer at once -----------------------------------------


@pytest.mark.timeout(30)
async def test_unknown_pid_is_result_unavailable_at_once(conn: dict[str, str]) -> None:
    async with (
        await AsyncSandbox.create(**conn) as sbx,
        await AsyncSandbox.create(**conn) as other,
    ):
        # A pid that exists, but in another sandbox, is as unknown here as a made-up one.
        elsewhere = await other.commands.run("echo elsewhere")
        for pid in (987_654_321, elsewhere.pid):
            started = time.monotonic()
            # connect() itself raises, before any handle (or stream) exists.
            with pytest.raises(ResultUnavailable) as failure:
                await asyncio.wait_for(sbx.commands.connect(pid, cursor=0), 5)
            assert time.monotonic() - started < DEFINITIVE
            assert failure.value.details["reason"] == "unknown"
            assert failure.value.details["pid"] == pid
            assert failure.value.details["sandbox_id"] == sbx.sandbox_id

            started = time.monotonic()
            outcome = await asyncio.wait_for(sbx.commands.try_connect(pid), 5)
            assert time.monotonic() - started < DEFINITIVE
            assert isinstance(outcome, Failed)
            assert outcome.code == "result_unavailable"
            assert isinstance(outcome.error, ResultUnavailable)
            assert outcome.error.details["reason"] == "unknown"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("daemon_config", [SHORT_TTL], indirect=True)
async def test_evicted_pid_is_result_unavailable_at_once(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        result = await sbx.commands.run("echo gone")
        pid = result.pid
        assert pid is not None
        assert result.stdout == "gone\n"

        async def evicted() -> bool:
            try:
                await sbx.commands.get(pid)
            except ResultUnavailable as exc:
                return exc.details["reason"] == "evicted"
            return False

        # The TTL is 0.3 s: eviction comes soon after the exit, once no consumer is attached.
        await _poll(evicted, 10, "the result to be evicted")
        events = await sbx.raw_events()
        assert any(e["kind"] == "process.evicted" and e["pid"] == pid for e in events)

        started = time.monotonic()
        with pytest.raises(ResultUnavailable) as failure:
            await asyncio.wait_for(sbx.commands.connect(pid, cursor=0), 5)
        assert time.monotonic() - started < DEFINITIVE
        assert failure.value.details["reason"] == "evicted"
        assert failure.value.details["pid"] == pid

        started = time.monotonic()
        outcome = await asyncio.wait_for(sbx.commands.try_connect(pid, cursor=0), 5)
        assert time.monotonic() - started < DEFINITIVE
        assert isinstance(outcome, Failed)
        assert outcome.code == "result_unavailable"
        assert outcome.error.details["reason"] == "evicted"


# -- (g) reattaches racing the exit ---------------------------------------------------------


@pytest.mark.timeout(60)
async def test_reattach_racing_the_exit_never_misreports(conn: dict[str, str]) -> None:
    """Start a short process and connect at once, 30 times, with the exit landing before,
    during or after the attach: always the full output and the exit code."""
    async with await AsyncSandbox.create(**conn) as sbx:
        for i in range(30):
            delay = (i % 6) * 0.003
            code = i % 3
            sleep = f"sleep {delay}; " if delay else ""
            info = await sbx.commands.start(f"{sleep}echo out-{i}; exit {code}")
            outcome = await asyncio.wait_for(sbx.commands.try_connect(info.pid, cursor=0), 10)
            if code == 0:
                assert isinstance(outcome, Ok), (i, outcome)
                result = outcome.value
            else:
                assert isinstance(outcome, Failed), (i, outcome)
                assert isinstance(outcome.error, CommandExitError), (i, outcome)
                result = outcome.error.details["result"]
            assert result.stdout == f"out-{i}\n", i
            assert result.exit_code == code, i


class FrameCollector:
    """A consumer transport that decodes and keeps every frame."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.decoder = FrameDecoder()
        self.frames: list[Frame] = []
        self.closed = False

    async def send(self, data: bytes) -> None:
        self.frames.extend(self.decoder.feed(data))

    async def close(self) -> None:
        self.closed = True


async def _race_one_exit(host: Host, sandbox: Any, i: int) -> None:
    """One process; consumers attached at start, while it runs, just before and just after
    ``log.finish`` and on the loop turn after it."""
    loop = asyncio.get_running_loop()
    code = i % 4
    process = await sandbox.start_process(ProcessSpec(cmd=f"printf out-{i}; exit {code}"))
    sinks: list[FrameCollector] = []
    served: list[asyncio.Task[None]] = []
    seen_at_finish: list[Any] = []

    def attach(label: str) -> None:
        sink = FrameCollector(label)
        consumer = host.open_consumer(process, 0, name=label)
        sinks.append(sink)
        served.append(loop.create_task(host.serve(consumer, sink)))

    original = process.log.finish

    def finish(exit_code: int) -> None:
        seen_at_finish.append(sandbox.retained_process(process.pid))
        attach("before-finish")
        original(exit_code)
        seen_at_finish.append(sandbox.retained_process(process.pid))
        attach("after-finish")
        loop.call_soon(attach, "next-turn")

    process.log.finish = finish  # type: ignore[method-assign]
    attach("at-start")
    deadline = time.monotonic() + 10
    while process.running:
        attach("while-running")
        assert time.monotonic() < deadline, "the process did not exit"
        await asyncio.sleep(0.002)  # sleep-ok: pace of the attaches
    # finish() scheduled the next-turn attach before the exit was signalled to wait().
    await asyncio.wait_for(process.wait(), 10)
    await asyncio.wait_for(asyncio.gather(*served), 10)

    assert seen_at_finish == [process, process]
    labels = [s.label for s in sinks]
    assert {"at-start", "before-finish", "after-finish", "next-turn"} <= set(labels)
    for sink in sinks:
        kinds = [f.kind for f in sink.frames]
        assert kinds[0] is FrameKind.START, (i, sink.label, kinds)
        assert kinds[-1] is FrameKind.END, (i, sink.label, kinds)
        assert set(kinds[1:-1]) <= {FrameKind.DATA, FrameKind.KEEPALIVE}, (i, kinds)
        output = b"".join(f.payload for f in sink.frames if f.kind is FrameKind.DATA)
        assert output == f"out-{i}".encode(), (i, sink.label)
        assert sink.frames[-1].meta["exit_code"] == code, (i, sink.label)
        assert sink.closed


@pytest.mark.timeout(60)
async def test_consumers_attached_around_finish_always_get_the_end(host: Host) -> None:
    """Core level: every consumer, however close to the exit it attached, gets all the
    output and then ``end`` with the exit code; the result stays available throughout."""
    sandbox = await host.create_sandbox()
    for i in range(15):
        await _race_one_exit(host, sandbox, i)
