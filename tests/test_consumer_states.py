"""Consumer metrics a student can trust: who reads (role, ghost), and what each state means
under every fan-out policy — ``blocked`` (its own send is stuck) vs ``starved`` (held back by
the shared loop while its lag grows) — and a closed consumer's lag frozen at close."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx
import pytest
from support import poll

from sandboxkit.daemon.consumers import Consumer
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ManagedProcess, ProcessSpec
from sandboxkit.daemon.sandbox import Sandbox
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import InvalidArgument

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


class StuckSink:
    """A transport whose peer stopped reading: every send waits until closed."""

    def __init__(self) -> None:
        self._closed = asyncio.Event()

    async def send(self, data: bytes) -> None:
        await self._closed.wait()

    async def close(self) -> None:
        self._closed.set()


async def _producing(host: Host, **sandbox: Any) -> tuple[Sandbox, ManagedProcess]:
    sbx = await host.create_sandbox(**sandbox)
    process = await sbx.start_process(ProcessSpec(argv=(sys.executable, "-c", PRODUCER)))
    await poll(lambda: process.log.head > 0, 10, "first output")
    return sbx, process


def _row(host: Host, consumer: Consumer) -> dict[str, Any]:
    (row,) = [r for r in host.consumers() if r["consumer_id"] == consumer.consumer_id]
    return row


async def test_role_defaults_to_sdk_and_is_validated(host: Host) -> None:
    _, process = await _producing(host)
    default = host.consumer(process, None)
    panel = host.consumer(process, None, role="panel")
    assert _row(host, default)["role"] == "sdk"
    assert _row(host, panel)["role"] == "panel"
    assert _row(host, panel)["ghost"] is False
    before = len(process.consumers)
    for bad in ("", "Panel", "a b", "x" * 33, "pänel", "role\x00", "../etc"):
        with pytest.raises(InvalidArgument) as info:
            host.consumer(process, None, role=bad)
        assert info.value.field == "role"
    assert len(process.consumers) == before  # refused means not registered


async def test_pause_snapshot_ghost_is_flagged_and_keeps_its_role(host: Host) -> None:
    sbx, process = await _producing(host, pause_ghosts=True)
    consumer = host.consumer(process, None, role="panel")
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
    host: Host, fanout: str, victim_state: str
) -> None:
    # kick_grace long enough that the kick policy's loop is still waiting while we look.
    _, process = await _producing(host, fanout=fanout, kick_grace=60.0)
    ghost = host.consumer(process, None, role="ghost")
    victim = host.consumer(process, None, role="panel")
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
    consumer = host.consumer(process, None, role="sdk")
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
