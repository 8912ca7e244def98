"""Stdin sessions do not accumulate (issue 19, point 6): a session whose writer has every
ack and says so is forgotten at once, a session idle past the grace makes room for a new
one at the cap, and ``send_stdin`` (one session per call) keeps working however often it
is called."""

from __future__ import annotations

import pytest
from support import fast_config

from sandboxkit.client import AsyncSandbox
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.stdin import StdinLedger
from sandboxkit.errors import StdinBusy


def test_a_million_ended_one_shot_sessions_leave_nothing_behind() -> None:
    # The ledger's cap is the daemon's default: without sessions ending, call 100,001
    # would get StdinBusy (and did, for up to an hour).
    ledger = StdinLedger(pid=1, max_sessions=100_000)
    written = 0

    def write(data: bytes) -> None:
        nonlocal written
        written += len(data)

    for i in range(1_000_000):
        session = f"s{i}"
        ledger.apply(session, 0, b".", write)
        ledger.end(session)
    assert written == 1_000_000
    assert len(ledger) == 0


def test_ending_is_idempotent_and_a_live_session_is_untouched() -> None:
    ledger = StdinLedger(pid=1)
    written: list[bytes] = []
    ledger.apply("live", 0, b"a", written.append)
    ledger.apply("once", 0, b"b", written.append)
    assert ledger.end("once")["ended"] is True
    assert ledger.end("once")["ended"] is True  # a resent end changes nothing
    assert ledger.end("never-seen")["ended"] is True
    assert ledger.expected("live") == 1
    assert ledger.apply("live", 0, b"a", written.append)["duplicate"] is True
    assert written == [b"a", b"b"]


def test_at_the_cap_a_session_idle_past_the_grace_makes_room() -> None:
    now = [0.0]
    ledger = StdinLedger(pid=3, max_sessions=2, idle_grace=30.0, clock=lambda: now[0])
    written: list[bytes] = []
    ledger.apply("old", 0, b"o", written.append)
    now[0] = 10.0
    ledger.apply("recent", 0, b"r", written.append)
    now[0] = 35.0  # "old" idle 35 s (past the grace), "recent" 25 s (within it)
    ledger.apply("new", 0, b"n", written.append)
    assert ledger.expected("old") == 0  # evicted, least recently used first
    assert ledger.expected("recent") == 1
    # Both left are within the grace: a further new session is refused, none evicted.
    with pytest.raises(StdinBusy) as busy:
        ledger.apply("newer", 0, b"x", written.append)
    assert busy.value.sessions == 2
    assert busy.value.limit == 2
    assert busy.value.buffered is None  # bytes waiting: not what this refusal is about
    assert written == [b"o", b"r", b"n"]


@pytest.fixture
def daemon_config() -> DaemonConfig:
    # A small cap: without sessions ending, call 51 got StdinBusy.
    return fast_config(stdin_sessions=50)


async def _send_many(conn: dict[str, str], calls: int) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        handle = await sbx.commands.run("cat", background=True)
        for i in range(calls):
            await sbx.commands.send_stdin(handle.pid, f"{i}\n")
        info = await sbx.commands.get(handle.pid)
        await sbx.commands.close_stdin(handle.pid)
        result = await handle.wait()
    assert info.raw["stdin_sessions"] == 0
    assert result.stdout.splitlines() == [str(i) for i in range(calls)]


async def test_send_stdin_past_the_session_cap_over_http(conn: dict[str, str]) -> None:
    await _send_many(conn, 200)


@pytest.mark.slow
async def test_five_thousand_send_stdin_calls_over_http(conn: dict[str, str]) -> None:
    await _send_many(conn, 5_000)
