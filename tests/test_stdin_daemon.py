"""The daemon's side of stdin: exactly-once without a count-limited ledger (sessions live by
lifetime, not by how many others came and went), and backpressure (a bounded per-process
buffer; beyond it a batch waits, then gets the retryable StdinBusy, unwritten)."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest
from support import fast_config, poll

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.daemon.stdin import StdinLedger
from sandboxkit.errors import StdinBusy, StdinSeqMismatch

# -- the ledger ------------------------------------------------------------------------


def test_live_session_survives_thousands_of_one_shot_writes() -> None:
    ledger = StdinLedger(pid=1)
    written: list[bytes] = []
    ledger.apply("live", 0, b"first", written.append)
    for i in range(3_000):  # one-shot send_stdin calls: a fresh session each
        ledger.apply(f"once-{i}", 0, b".", written.append)
    # The long-lived session goes on where it was.
    answer = ledger.apply("live", 1, b"second", written.append)
    assert answer["duplicate"] is False
    assert written[0] == b"first" and written[-1] == b"second"


def test_resend_after_thousands_of_other_sessions_is_not_applied_twice() -> None:
    ledger = StdinLedger(pid=1)
    written: list[bytes] = []
    ledger.apply("a", 0, b"once", written.append)
    for i in range(3_000):
        ledger.apply(f"other-{i}", 0, b"", written.append)
    assert ledger.apply("a", 0, b"once", written.append)["duplicate"] is True
    assert written.count(b"once") == 1


def test_sessions_are_forgotten_after_their_lifetime_not_before() -> None:
    now = [0.0]
    ledger = StdinLedger(pid=1, ttl=60.0, clock=lambda: now[0])
    written: list[bytes] = []
    ledger.apply("idle", 0, b"i", written.append)
    ledger.apply("busy", 0, b"b", written.append)
    for step in range(1, 10):
        now[0] = step * 20.0  # "busy" writes every 20 s, "idle" never again
        ledger.apply("busy", step, b"b", written.append)
        if now[0] <= 60.0:
            assert ledger.expected("idle") == 1
    assert ledger.expected("idle") == 0  # gone after 60 s idle
    assert ledger.expected("busy") == 10  # never idle that long: kept
    assert len(ledger) == 1


def test_session_cap_refuses_new_sessions_and_never_evicts_live_ones() -> None:
    ledger = StdinLedger(pid=9, max_sessions=3)
    written: list[bytes] = []
    for name in ("a", "b", "c"):
        ledger.apply(name, 0, name.encode(), written.append)
    with pytest.raises(StdinBusy) as busy:
        ledger.apply("d", 0, b"d", written.append)
    assert busy.value.pid == 9
    assert b"d" not in written
    for name in ("a", "b", "c"):  # every live session still continues
        ledger.apply(name, 1, name.encode(), written.append)
    with pytest.raises(StdinSeqMismatch):
        ledger.apply("a", 5, b"x", written.append)


# -- backpressure ----------------------------------------------------------------------

LIMIT = 128 * 1024
BATCH = 32 * 1024


async def _cat(host: Host) -> tuple[object, object]:
    host.config.stdin_buffer = LIMIT
    host.config.stdin_wait = 0.3
    sandbox = await host.create_sandbox()
    process = await sandbox.start_process(ProcessSpec(argv=("cat",)))
    return sandbox, process


def _output(process: object) -> bytes:
    log = process.log  # type: ignore[attr-defined]
    _, chunks = log.read(log.first_seq, 1 << 30)
    return b"".join(c.data for c in chunks)


async def test_stdin_buffer_is_bounded_and_a_busy_batch_is_not_written(host: Host) -> None:
    sandbox, process = await _cat(host)
    await sandbox.pause()  # frozen: cat reads nothing
    sent: list[bytes] = []
    busy: StdinBusy | None = None
    for seq in range(64):  # 2 MiB offered: far past the kernel pipe and the limit
        data = bytes([65 + seq % 26]) * BATCH
        try:
            await process.write_stdin("s", seq, data)
        except StdinBusy as exc:
            busy = exc
            break
        sent.append(data)
    assert busy is not None, "a child that reads nothing must not get unbounded stdin"
    assert busy.limit == LIMIT
    assert busy.buffered is not None and busy.buffered + BATCH > LIMIT
    info = process.to_json()
    assert info["stdin_limit"] == LIMIT
    assert 0 < info["stdin_buffered"] <= LIMIT
    # The refused batch was not recorded: the same seq is expected again.
    refused_seq = len(sent)
    with pytest.raises(StdinSeqMismatch):
        await process.write_stdin("s", refused_seq + 1, b"x")

    # Once the child reads again, the buffer drains and the same batch goes through once.
    await sandbox.resume()
    data = bytes([65 + refused_seq % 26]) * BATCH
    answer = await process.write_stdin("s", refused_seq, data)
    assert answer["duplicate"] is False
    sent.append(data)
    expected = b"".join(sent)
    await poll(lambda: len(_output(process)) >= len(expected), 10, "cat echoes everything")
    assert _output(process) == expected
    assert process.to_json()["stdin_buffered"] == 0


async def test_writer_beyond_the_buffer_waits_for_room(host: Host) -> None:
    sandbox, process = await _cat(host)
    host.config.stdin_wait = 10.0
    await sandbox.pause()
    seq = 0
    while process.stdin_buffered + BATCH <= LIMIT or process.stdin_buffered == 0:
        await process.write_stdin("s", seq, b"w" * BATCH)
        seq += 1
    waiting = asyncio.ensure_future(process.write_stdin("s", seq, b"w" * BATCH))
    # A resend of the same batch while the first waits is a duplicate, not a second write.
    resend = asyncio.ensure_future(process.write_stdin("s", seq, b"w" * BATCH))
    await asyncio.sleep(0.2)  # sleep-ok: show that the writer is held while frozen
    assert not waiting.done()
    await sandbox.resume()
    first, second = await asyncio.wait_for(asyncio.gather(waiting, resend), 10)
    assert (first["duplicate"], second["duplicate"]) == (False, True)
    total = (seq + 1) * BATCH
    await poll(lambda: len(_output(process)) >= total, 10, "cat echoes everything")
    assert _output(process) == b"w" * total


@pytest.fixture
def daemon_config() -> DaemonConfig:
    return fast_config(stdin_buffer=LIMIT, stdin_wait=0.2)


def test_stdin_busy_over_http_is_a_typed_429(daemon: DaemonServer) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        pid = http.post(f"/sandboxes/{sid}/processes", json={"argv": ["sleep", "60"]}).json()["pid"]
        path = f"/sandboxes/{sid}/processes/{pid}/stdin"
        data = base64.b64encode(b"z" * BATCH).decode()
        statuses = []
        for seq in range(40):
            answer = http.post(path, json={"session": "s", "seq": seq, "data": data})
            statuses.append(answer.status_code)
            if answer.status_code != 200:
                break
        assert statuses[-1] == 429, statuses
        body = answer.json()
        assert body["code"] == "stdin_busy"
        assert body["details"]["limit"] == LIMIT
        info = http.get(f"/sandboxes/{sid}/processes/{pid}").json()
        assert 0 < info["stdin_buffered"] <= LIMIT
        assert info["stdin_limit"] == LIMIT
        http.delete(f"/sandboxes/{sid}")


async def test_pty_stdin_goes_through_the_bounded_buffer_too(host: Host) -> None:
    sandbox = await host.create_sandbox()
    process = await sandbox.start_process(ProcessSpec(argv=("cat",), pty=True))
    await process.write_stdin("s", 0, b"hello pty\n")
    await poll(lambda: b"hello pty" in _output(process), 10, "the pty echoes")
    process.close_stdin()  # EOF character: cat exits
    assert await process.wait(10) == 0
    assert process.to_json()["stdin_buffered"] == 0


async def test_pty_stdin_is_bounded_and_drains_once_the_child_reads(host: Host) -> None:
    """A pty's input is written by the daemon itself (not a pipe transport): a child that
    reads nothing still gets at most ``stdin_buffer`` held for it, then StdinBusy, and what
    is held goes to the child once it reads."""
    host.config.stdin_buffer = LIMIT
    host.config.stdin_wait = 0.2
    sandbox = await host.create_sandbox()
    process = await sandbox.start_process(ProcessSpec(argv=("cat",), pty=True))
    await sandbox.pause()  # frozen: the terminal's input queue fills, then the daemon holds
    line = b"x" * 1023 + b"\n"  # lines: a terminal in canonical mode caps a line at 4 KiB
    with pytest.raises(StdinBusy) as busy:
        for seq in range(64):
            await process.write_stdin("s", seq, line * (BATCH // len(line)))
    assert busy.value.limit == LIMIT
    assert 0 < process.stdin_buffered <= LIMIT
    assert not process.stdin_drained.is_set()
    await sandbox.resume()
    await poll(lambda: process.stdin_buffered == 0, 10, "the held input reaches cat")
    assert process.stdin_drained.is_set()
    process.close_stdin()
    assert await process.wait(10) == 0
