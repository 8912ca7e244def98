"""The event journal as many views follow it (issue 22, the cost curve): a follower of one
sandbox is woken only by that sandbox's events, and a read at the head costs the events
it returns, not the journal's length — so an event costs the daemon what its own
followers cost, not (followers × journal), which grew as the square of the sandboxes."""

from __future__ import annotations

import asyncio
from collections import deque

from sandboxkit.daemon.events import Event, EventJournal


class _TailOnly(deque[Event]):
    """A journal's events that refuse a read from the oldest end."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("the whole journal was scanned")


def _journal(count: int, maxlen: int = 20_000) -> EventJournal:
    journal = EventJournal(maxlen)
    for i in range(count):
        journal.record("sandbox.paused", sandbox_id=f"sbx-{i % 3}", pid=i % 2)
    return journal


def test_since_returns_exactly_the_events_asked_for() -> None:
    journal = _journal(30, maxlen=20)  # 10 evicted: the oldest kept is seq 10
    assert [e.seq for e in journal.since(0)] == list(range(10, 30))
    assert [e.seq for e in journal.since(25)] == [25, 26, 27, 28, 29]
    assert journal.since(30) == [] and journal.since(99) == []
    assert [e.seq for e in journal.since(20, sandbox_id="sbx-1")] == [22, 25, 28]
    assert [e.seq for e in journal.since(20, sandbox_id="sbx-1", pid=0)] == [22, 28]
    assert [e.seq for e in journal.since(0, pid=1)] == list(range(11, 30, 2))
    assert journal.since(0, sandbox_id="sbx-9") == []


def test_a_read_at_the_head_does_not_scan_the_whole_journal() -> None:
    journal = _journal(5_000)
    journal._events = _TailOnly(journal._events, maxlen=20_000)
    assert [e.seq for e in journal.since(4_997)] == [4_997, 4_998, 4_999]
    assert [e.seq for e in journal.since(4_990, sandbox_id="sbx-0")] == [4_992, 4_995, 4_998]
    assert journal.since(5_000, sandbox_id="sbx-0") == []


async def test_a_follower_of_one_sandbox_is_woken_by_its_events_only() -> None:
    journal = EventJournal()
    mine = asyncio.ensure_future(journal.wait(30, sandbox_id="sbx-a"))
    everything = asyncio.ensure_future(journal.wait(30))
    await asyncio.sleep(0)  # sleep-ok: both are waiting
    journal.record("sandbox.paused", sandbox_id="sbx-b")
    journal.record("host.error")
    await asyncio.wait_for(everything, 1)  # a follower of the whole journal hears every event
    for _ in range(5):
        await asyncio.sleep(0)  # sleep-ok: a wake-up, were one sent, would have run by now
    assert not mine.done()
    journal.record("sandbox.resumed", sandbox_id="sbx-a")
    await asyncio.wait_for(mine, 1)
    assert journal.waiting == 0


async def test_a_follower_that_gave_up_leaves_nothing_behind() -> None:
    journal = EventJournal()
    await asyncio.gather(*(journal.wait(0.01, sandbox_id=f"sbx-{i}") for i in range(50)))
    await journal.wait(0.01)
    assert journal.waiting == 0
    journal.record("sandbox.paused", sandbox_id="sbx-1")  # nobody to wake: no error
