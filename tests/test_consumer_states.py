"""Consumer metrics a student can trust: who reads (role, ghost), and what each state means
under every fan-out policy — ``blocked`` (its own send is stuck) vs ``starved`` (held back by
the shared loop while its lag grows) — and a closed consumer's lag frozen at close."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
from support import StuckSink, poll

from sandboxkit import AsyncSandbox
from sandboxkit.client.transport import raw_stream
from sandboxkit.daemon.consumers import Consumer
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ManagedProcess, ProcessSpec
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import InvalidArgument
from sandboxkit.lab_options import FanoutPolicy, LabOptions

# About 200 KB/s in 1 KiB writes, until killed.
PRODUCER = """
import sys, time
out = sys.stdout.buffer
while True:
    out.write(b"x" * 1023 + b"\\n")
    out.flush()
    time.sleep(0.005)  # sleep-ok: the producer's pace
"""


class OpenSink:
    """A transport that takes everything at once."""

    def __init__(self) -> None:
        self.received = 0

    async def send(self, data: bytes) -> None:
        self.received += len(data)

    async def close(self) -> None:
        pass


async def _producing(host: Host, **sandbox: Any) -> tuple[ManagedSandbox, ManagedProcess]:
    sbx = await host.create_sandbox(**sandbox)
    process = await sbx.start_process(ProcessSpec(argv=(sys.executable, "-c", PRODUCER)))
    await poll(lambda: process.log.head > 0, 10, "first output")
    return sbx, process


def _row(host: Host, consumer: Consumer) -> dict[str, Any]:
    (row,) = [r for r in host.consumer_metrics() if r["consumer_id"] == consumer.consumer_id]
    return row


async def test_role_defaults_to_sdk_and_is_validated(host: Host) -> None:
    _, process = await _producing(host)
    default = host.open_consumer(process, None)
    panel = host.open_consumer(process, None, role="panel")
    assert _row(host, default)["role"] == "sdk"
    assert _row(host, panel)["role"] == "panel"
    assert _row(host, panel)["ghost"] is False
    before = len(process.consumers)
    for bad in ("", "Panel", "a b", "x" * 33, "pänel", "role\x00", "../etc"):
        with pytest.raises(InvalidArgument) as info:
            host.open_consumer(process, None, role=bad)
        assert info.value.field == "role"
    assert len(process.consumers) == before  # refused means not registered


async def test_pause_snapshot_ghost_is_flagged_and_keeps_its_role(host: Host) -> None:
    sbx, process = await _producing(host, lab=LabOptions(pause_ghosts=True))
    consumer = host.open_consumer(process, None, role="panel")
    host.start_stream(consumer, OpenSink())
    await poll(lambda: consumer.bytes_sent > 0, 10, "the consumer streams")
    await sbx.pause()
    assert _row(host, consumer)["ghost"] is False
    await sbx.resume()
    row = _row(host, consumer)
    assert row["ghost"] is True
    assert row["role"] == "panel"
    # The ghost's socket is never read: it soon shows blocked on its own send.
    await poll(lambda: _row(host, consumer)["state"] == "blocked", 10, "ghost blocked")


@pytest.mark.parametrize(
    ("fanout", "victim_state"),
    [("cursor", "streaming"), ("blocking", "starved"), ("kick", "starved")],
)
async def test_blocked_ghost_and_starved_victims_under_each_policy(
    host: Host, fanout: FanoutPolicy, victim_state: str
) -> None:
    # kick_grace long enough that the kick policy's loop is still waiting while we look.
    _, process = await _producing(host, lab=LabOptions(fanout=fanout, kick_grace=60.0))
    ghost = host.open_consumer(process, None, role="ghost")
    victim = host.open_consumer(process, None, role="panel")
    host.start_stream(ghost, StuckSink())
    host.start_stream(victim, OpenSink())

    await poll(lambda: _row(host, ghost)["state"] == "blocked", 10, "ghost blocked")
    if victim_state == "streaming":
        # The cursor policy: nobody waits for the ghost; the victim keeps up the whole time.
        for _ in range(30):
            row = _row(host, victim)
            assert row["state"] == "streaming", row
            assert row["starved_since"] is None
            await asyncio.sleep(0.02)  # sleep-ok: sampling the metrics over ~0.6 s
        assert victim.bytes_sent > 0
        return

    row = await poll(
        lambda: (r := _row(host, victim))["state"] == "starved" and r, 10, "victim starved"
    )
    assert row["blocked_since"] is None  # its own transport is fine
    assert row["starved_since"] is not None
    sent = row["bytes_sent"]
    # Its lag keeps growing while its sends make no progress, and it stays starved.
    grown = await poll(
        lambda: (r := _row(host, victim))["lag_bytes"] > row["lag_bytes"] + 4096 and r,
        10,
        "victim's lag grows",
    )
    assert grown["state"] == "starved"
    assert grown["bytes_sent"] == sent
    assert _row(host, ghost)["state"] == "blocked"


async def test_closed_consumer_lag_is_frozen_at_close(host: Host) -> None:
    _, process = await _producing(host)
    # A consumer that never sends (stuck), then goes away: it ends with a large lag.
    consumer = host.open_consumer(process, None, role="sdk")
    task = host.start_stream(consumer, StuckSink())
    await poll(lambda: consumer.lag_bytes > 8192, 10, "lag builds up")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    row = _row(host, consumer)
    assert row["state"] == "closed"
    head = process.log.head
    await poll(lambda: process.log.head > head + 8, 10, "the producer writes on")
    later = _row(host, consumer)
    assert later["lag_bytes"] == row["lag_bytes"]
    assert later["head"] == row["head"]
    assert later["state"] == "closed"


def test_role_over_http(daemon: DaemonServer) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        pid = http.post(f"/sandboxes/{sid}/processes", json={"cmd": "echo hi"}).json()["pid"]
        path = f"/sandboxes/{sid}/processes/{pid}/stream"
        bad = http.get(path, params={"role": "Not A Role"})
        assert bad.status_code == 422
        assert bad.json()["code"] == "invalid_argument"
        assert bad.json()["details"]["field"] == "role"
        assert http.get(f"/sandboxes/{sid}/consumers").json() == []
        with http.stream("GET", path, params={"role": "panel"}) as response:
            assert response.status_code == 200
            response.read()  # the process ends: the stream ends
        (row,) = http.get(f"/sandboxes/{sid}/consumers").json()
        assert (row["role"], row["ghost"], row["state"]) == ("panel", False, "closed")
        http.delete(f"/sandboxes/{sid}")


# A raw-socket reader in its own process, with a small receive buffer: it reads its
# stream until it is stopped. Prints "ready" once the first bytes arrived.
RAW_READER = r"""
import socket, sys
host, port, path, token = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
s.connect((host, port))
s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
s.recv(65536)
print("ready", flush=True)
while s.recv(65536):
    pass
"""

# About 10 KB/s in 1 KiB lines: a slow producer, so the daemon's own buffers for a stopped
# peer (its socket's send buffer, the server's write buffer) take many seconds to fill.
SLOW_PRODUCER = PRODUCER.replace("0.005", "0.1")


def test_a_stopped_peer_shows_blocked_once_its_window_is_full(daemon: DaemonServer) -> None:
    """Issue 10: a SIGSTOPped client's consumer showed "streaming, lag 0" for as long as
    the daemon's buffers kept taking its output (30 s). Once the peer's receive window is
    full — it takes no more bytes — the consumer shows ``blocked``, within a second."""
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        argv = [sys.executable, "-c", SLOW_PRODUCER]
        pid = http.post(f"/sandboxes/{sid}/processes", json={"argv": argv}).json()["pid"]
        host_name, port = daemon.url.removeprefix("http://").rsplit(":", 1)
        path = f"/sandboxes/{sid}/processes/{pid}/stream?name=stopped"
        reader = subprocess.Popen(
            [sys.executable, "-c", RAW_READER, host_name, port, path, daemon.token or ""],
            stdout=subprocess.PIPE,
        )
        try:
            assert reader.stdout is not None
            assert reader.stdout.readline() == b"ready\n"

            def row() -> dict[str, Any]:
                rows = http.get(f"/sandboxes/{sid}/consumers").json()
                (found,) = [r for r in rows if r["name"] == "stopped"]
                return dict(found)

            assert row()["state"] == "streaming"
            os.kill(reader.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            # The peer's 4 KiB window fills within a second at 10 KB/s; the daemon's own
            # buffers would take far longer than the deadline below.
            while (state := row())["state"] != "blocked":
                assert time.monotonic() - stopped_at < 3.0, state
                time.sleep(0.05)  # sleep-ok: polling the metrics with a deadline
            assert state["blocked_since"] is not None
            assert state["blocked_since"] >= time.time() - 3.0
            assert state["closed_at"] is None
            # The peer reads again: the consumer streams again.
            os.kill(reader.pid, signal.SIGCONT)
            while (state := row())["state"] != "streaming":
                assert time.monotonic() - stopped_at < 10.0, state
                time.sleep(0.05)  # sleep-ok: polling the metrics with a deadline
        finally:
            reader.kill()
            os.kill(reader.pid, signal.SIGCONT)
            reader.wait()
            http.delete(f"/sandboxes/{sid}")


# 48 MiB as fast as a pipe takes it, each 64 KiB block its own byte.
FAST_WRITER = """
import sys
out = sys.stdout.buffer
for i in range(768):
    out.write(bytes([i % 251]) * 65536)
"""


async def test_an_sdk_reader_that_kept_up_then_stalled_shows_blocked(
    daemon: DaemonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that keeps up reads through a larger receive buffer
    (``raw_stream._MAX_RECEIVE_BUFFER``); once its callback stalls, bytes land while it is
    busy: the buffer goes back to the small one, the client stops reading, and the daemon
    sees the consumer ``blocked``. Released, it gets every byte, in order."""
    sizes: list[int] = []
    sizing = raw_stream._Reader._size_receive_buffer

    def recording(reader: raw_stream._Reader, size: int) -> None:
        sizes.append(size)
        sizing(reader, size)

    monkeypatch.setattr(raw_stream._Reader, "_size_receive_buffer", recording)
    release = asyncio.Event()
    received = hashlib.sha256()
    got = 0

    async def take(data: bytes) -> None:
        nonlocal got
        received.update(data)
        got += len(data)
        if got >= 16 << 20:
            await release.wait()

    async with await AsyncSandbox.create(url=daemon.url, token=daemon.token) as sbx:
        proc = await sbx.commands.start([sys.executable, "-c", FAST_WRITER])
        handle = await sbx.commands.connect(
            proc.pid, cursor=0, on_stdout_bytes=take, keep_output=False, role="stalling"
        )
        headers = {"Authorization": f"Bearer {daemon.token}"}
        async with httpx.AsyncClient(base_url=daemon.url, headers=headers) as http:

            async def state() -> str:
                rows = (await http.get(f"/sandboxes/{sbx.sandbox_id}/consumers")).json()
                found = [r for r in rows if r["role"] == "stalling" and not r["closed_at"]]
                return str(found[0]["state"]) if found else "none"

            deadline = time.monotonic() + 20
            while (now := await state()) != "blocked":
                assert time.monotonic() < deadline, now
                await asyncio.sleep(0.05)  # sleep-ok: polling the metrics with a deadline
        assert raw_stream._MAX_RECEIVE_BUFFER in sizes, "it kept up before it stalled"
        assert sizes[-1] == raw_stream._RECEIVE_BUFFER, "stalled, it went back"
        release.set()
        await handle.wait()
    expected = hashlib.sha256()
    for i in range(768):
        expected.update(bytes([i % 251]) * 65536)
    assert (got, received.hexdigest()) == (768 * 65536, expected.hexdigest())
