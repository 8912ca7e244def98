"""The host's housekeeping (``Host._housekeeping``, every ``housekeeping_interval``):
idle timeouts, exited processes forgotten after their ``result_ttl``, killed sandboxes
released. A sandbox keeps every exited process for that TTL (15 minutes by default), so a
notebook's loop of commands leaves thousands; a tick must not look at each of them, or
it holds the event loop that long every 50 ms (5,000 of them: 20 % of a core, a stall of
~10 ms each tick, before this was fixed)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support import StuckSink, fast_config, poll

import sandboxkit.daemon.sandbox as sandbox_module
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ManagedProcess
from sandboxkit.daemon.process_spec import ProcessSpec
from sandboxkit.daemon.sandbox import ManagedSandbox

SANDBOX_PY = str(Path(sandbox_module.__file__))


def _ended(sandbox: ManagedSandbox, count: int) -> list[ManagedProcess]:
    """``count`` processes that ran and exited in ``sandbox`` (made as the daemon keeps
    them, their logs in memory, without spawning thousands)."""
    made = []
    for i in range(count):
        process = ManagedProcess(
            sandbox.sandbox_id,
            ProcessSpec(argv=("true",)),
            sandbox.config,
            sandbox.journal,
            lambda: sandbox.state,
            sandbox._fanout,
        )
        process.pid = 10_000_000 + i  # beyond any real pid: never signalled
        process.log.append("stdout", b"done\n")
        process.log.finish(0)
        sandbox.processes[process.pid] = process
        made.append(process)
    return made


@contextmanager
def _lines_run(filename: str) -> Iterator[list[int]]:
    """Count the lines of ``filename`` run meanwhile: the work done, by a count that does
    not depend on how fast the machine is."""
    count = [0]

    def trace(frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code.co_filename != filename:
            return None
        if event == "line":
            count[0] += 1
        return trace

    sys.settrace(trace)
    try:
        yield count
    finally:
        sys.settrace(None)


async def _tick_work(host: Host, sandbox: ManagedSandbox) -> int:
    with _lines_run(SANDBOX_PY) as lines:
        await host._tend(sandbox, time.monotonic(), time.time())
    return lines[0]


@pytest.mark.timeout(60)
async def test_a_tick_does_the_same_work_with_thousands_of_exited_processes_kept() -> None:
    config = fast_config(result_ttl=900.0, housekeeping_interval=3600.0)
    async with Host(config) as host:
        few = await host.create_sandbox(timeout=600)
        many = await host.create_sandbox(timeout=600)
        _ended(few, 10)
        _ended(many, 3000)
        for sandbox in (few, many):
            await _tick_work(host, sandbox)  # the first look at them may see each
        work = [await _tick_work(host, sandbox) for sandbox in (few, many)]
        assert work[1] <= work[0] + 5, work
        assert len(many.processes) == 3000  # nothing forgotten before its time


@pytest.mark.timeout(60)
async def test_a_kept_result_holds_nothing_of_what_ran_its_process() -> None:
    # A result is kept for its TTL (15 minutes by default), thousands of them after a
    # notebook's loop, and every object of theirs is walked by each full collection of
    # the daemon's heap, a pause of the whole daemon: what ran the process (its pipes'
    # transports, their files, its futures) goes once it ended, its output stays.
    async with Host(fast_config()) as host:
        sandbox = await host.create_sandbox()
        for spec in (ProcessSpec(argv=("echo", "kept")), ProcessSpec(cmd="echo kept", pty=True)):
            process = await sandbox.start_process(spec)
            child = weakref.ref(process._child)  # type: ignore[arg-type]
            pipe = weakref.ref(process._stdin_pipe)  # type: ignore[arg-type]
            assert await process.wait(10) == 0
            gc.collect()
            assert child() is None and pipe() is None, "what ran it is still held"
            assert b"kept" in b"".join(bytes(c.data) for c in process.log.read(0, 100)[1])
            assert sandbox.process(process.pid) is process and process.stdin_buffered == 0


async def test_exited_processes_are_forgotten_each_after_its_own_ttl() -> None:
    # One exits now, one later: a look at the first must not put off the second.
    config = fast_config(result_ttl=0.6, housekeeping_interval=0.02)
    async with Host(config) as host:
        sandbox = await host.create_sandbox()
        first = await sandbox.start_process(ProcessSpec(argv=("true",)))
        await first.wait()
        started = time.monotonic()
        second = await sandbox.start_process(ProcessSpec(argv=("sleep", "0.3")))
        await poll(lambda: first.pid in sandbox.evicted, 10, "the first result to expire")
        assert second.pid in sandbox.processes
        await second.wait()
        await poll(lambda: second.pid in sandbox.evicted, 10, "the second result to expire")
        ended_at = second.log.ended_at
        assert ended_at is not None and time.time() - ended_at >= 0.6
        assert time.monotonic() - started >= 0.9


@pytest.mark.timeout(60)
async def test_a_result_read_past_its_ttl_is_forgotten_once_its_reader_leaves() -> None:
    config = fast_config(result_ttl=0.2, housekeeping_interval=0.02)
    async with Host(config) as host:
        sandbox = await host.create_sandbox()
        process = await sandbox.start_process(ProcessSpec(argv=("true",)))
        await process.wait()
        reading = host.start_stream(host.open_consumer(process, 0), StuckSink())
        # Long past the TTL, read still: kept (its reader must be able to finish).
        await poll(lambda: time.time() - (process.log.ended_at or 0) > 1.0, 10, "1 s")
        await _ticks(host, 5)
        assert process.pid in sandbox.processes
        await _leave(reading)
        await poll(lambda: process.pid in sandbox.evicted, 10, "the result to expire")


@pytest.mark.timeout(60)
async def test_a_reader_of_an_old_result_keeps_its_sandbox_from_going_idle() -> None:
    # Among many exited processes, one stream open on an old one is activity: the
    # sandbox outlives its idle timeout while it is open, and times out once it closes.
    config = fast_config(result_ttl=900.0, housekeeping_interval=0.02)
    async with Host(config) as host:
        sandbox = await host.create_sandbox(timeout=0.3, on_timeout="kill")
        old = _ended(sandbox, 200)[0]
        reading = host.start_stream(host.open_consumer(old, 0), StuckSink())
        opened = time.monotonic()
        await poll(lambda: time.monotonic() - opened > 1.0, 10, "three idle timeouts")
        await _ticks(host, 5)
        assert sandbox.state == "running"
        await _leave(reading)
        closed = time.monotonic()
        await poll(lambda: sandbox.state == "killed", 10, "the idle timeout")
        assert time.monotonic() - closed >= 0.3 - 0.05


async def _leave(reading: asyncio.Task[None]) -> None:
    reading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reading


async def _ticks(host: Host, count: int) -> None:
    """Wait for ``count`` housekeeping ticks to have run."""
    until = host.ticks + count
    await poll(lambda: host.ticks >= until, 10, f"{count} housekeeping ticks")
