"""The fault lab behind one fence: a sandbox is a lab sandbox only through its one ``lab``
option; a production sandbox reports none; the lab's queue policies get what they need
at attach (a start cursor, a kick callback) and never reach into a consumer; and a cursor
they cannot honour is reported (a gap of its exact size, a journal event), not silently
dropped."""

from __future__ import annotations

import sys
import warnings

import httpx
import pytest
from support import poll

from sandboxkit import AsyncSandbox
from sandboxkit.daemon.faults.fanout import BlockingFanout, KickFanout
from sandboxkit.daemon.output_log import OutputLog
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import OutputGapWarning
from sandboxkit.lab_options import LabCursorIgnored, LabOptions

# Prints one line, then waits to be killed: the stream stays open.
TALKER = "import time; print('hello', flush=True); time.sleep(60)  # sleep-ok: stays alive"


async def test_a_production_sandbox_has_no_lab_and_a_lab_sandbox_reports_its_options(
    conn: dict[str, str | None],
) -> None:
    async with await AsyncSandbox.create(**conn) as plain:
        assert plain.info.raw["lab"] is None
        assert plain.info.raw["fanout"] == "cursor"
    lab = LabOptions(fanout="kick", pause_ghosts=True)
    async with await AsyncSandbox.create(lab=lab, **conn) as sbx:
        # Unset fields are reported with the daemon's defaults in force.
        assert sbx.info.raw["fanout"] == "kick"
        assert sbx.info.raw["lab"] == {
            "fanout": "kick",
            "kick_grace": 5.0,
            "queue": 64,
            "pause_ghosts": True,
            "ghost_buffer": 4096,
        }


def test_the_lab_options_are_one_strict_object_on_the_wire(daemon: DaemonServer) -> None:
    headers = {"authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers) as http:
        # The old flat fields are gone: unknown, refused, nothing created.
        for body in ({"fanout": "blocking"}, {"pause_ghosts": True}, {"lab": {"ghosts": 1}}):
            response = http.post("/sandboxes", json=body)
            assert response.status_code == 422, (body, response.text)
        assert http.get("/sandboxes").json() == []
        schema = http.get("/openapi.json").json()["components"]["schemas"]
        assert set(schema["CreateSandbox"]["properties"]) >= {"lab"}
        assert not {"fanout", "pause_ghosts"} & set(schema["CreateSandbox"]["properties"])
        assert set(schema["LabOptions"]["properties"]) == {
            "fanout",
            "kick_grace",
            "queue",
            "pause_ghosts",
            "ghost_buffer",
        }


@pytest.mark.parametrize("policy", ["blocking", "kick"])
async def test_a_cursor_a_queue_policy_cannot_honour_is_a_gap_and_is_journaled(
    conn: dict[str, str | None], policy: str
) -> None:
    lab = LabOptions(fanout="blocking" if policy == "blocking" else "kick")
    async with await AsyncSandbox.create(lab=lab, **conn) as sbx:
        talker = await sbx.commands.run([sys.executable, "-c", TALKER], background=True)
        await poll(lambda: _has_output(sbx, talker.pid), 10, "the talker's line")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = await sbx.commands.connect(talker.pid, cursor=0)
            events = await poll(
                lambda: _events(sbx, "consumer.cursor_ignored"), 10, "the cursor_ignored event"
            )
            await handle.disconnect()
        (event,) = events
        assert event["data"]["requested"] == 0 and event["data"]["cursor"] > 0, event
        assert event["reason"] == policy
        # Said where the reader looks, as any loss: a gap (here the SDK's default, a
        # warning and a marker in stdout), not a warning of another kind.
        assert not [w for w in caught if issubclass(w.category, LabCursorIgnored)]
        lost = [w for w in caught if issubclass(w.category, OutputGapWarning)]
        assert len(lost) == 1, [str(w.message) for w in caught]
        assert "cursor 0 ->" in str(lost[0].message)
        assert "not replayed" in str(lost[0].message)
        await talker.kill()


async def test_the_cursor_policy_honours_a_cursor_without_a_warning(
    conn: dict[str, str | None],
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        talker = await sbx.commands.run([sys.executable, "-c", TALKER], background=True)
        await poll(lambda: _has_output(sbx, talker.pid), 10, "the talker's line")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = await sbx.commands.connect(talker.pid, cursor=0)
            await poll(lambda: _text(handle), 10, "the replayed line")
            await handle.disconnect()
        assert not [w for w in caught if issubclass(w.category, LabCursorIgnored)]
        assert not await _events(sbx, "consumer.cursor_ignored")
        await talker.kill()


async def test_queue_policies_give_a_start_cursor_and_kick_through_the_callback() -> None:
    log = OutputLog(1 << 20)  # no coalescing: one chunk per append
    for _ in range(3):
        log.append("stdout", b"x" * 10)
    kicks: list[tuple[str, float]] = []
    fanout = KickFanout(log, queue_size=1, grace=0.05)
    try:
        # Asked for 0; a queue policy starts new subscribers at the head, and says so.
        feed = fanout.attach(0, lambda reason, blocked: kicks.append((reason, blocked)))
        assert feed.start == log.head == 3
        for _ in range(3):  # nobody pulls: the queue of 1 fills, the grace runs out
            log.append("stdout", b"y" * 10)
        await poll(lambda: kicks, 5, "the kick callback")
        assert kicks == [("queue_full", 0.05)]
    finally:
        await fanout.close()
    blocking = BlockingFanout(log, queue_size=1)
    try:
        assert blocking.attach(1, lambda *_: None).start == log.head
    finally:
        await blocking.close()


async def _has_output(sbx: AsyncSandbox, pid: int) -> bool:
    return (await sbx.commands.get(pid)).head > 0


async def _events(sbx: AsyncSandbox, kind: str) -> list[dict[str, object]]:
    return [e for e in await sbx.raw_events() if e["kind"] == kind]


async def _text(handle: object) -> str:
    return str(getattr(handle, "stdout", ""))
