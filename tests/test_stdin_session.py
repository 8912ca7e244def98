"""Stdin append sessions (F7): exactly once and in order across reconnects; inputs
exhausted with nothing in flight is success whatever error arrives afterwards; retries
resend exactly the unacked batches; running out of retries with something unacked is
an error, never a silent success.

Sections: (a) late errors after every ack, on a scripted transport; (b) the real daemon
with disconnects injected before or after a POST reaches it; (c) the session against the
real :class:`StdinLedger` behind an in-memory transport, under generated disconnect
schedules; (d) retries exhausted while something is unacked.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import poll

from sandboxkit import AsyncSandbox, DaemonUnavailable, StdinBusy, StdinSeqMismatch
from sandboxkit.client.api import ApiClient
from sandboxkit.client.stdin import HttpStdinTransport, StdinConnection, StdinSession
from sandboxkit.daemon.stdin import StdinLedger
from sandboxkit.errors import SandboxkitError

HANG = 5.0
"""Bound on anything that must complete: a hang fails the test instead of the suite."""


# -- (a) a scripted in-memory transport --------------------------------------------------


class ScriptedTransport:
    """Connections that ack every batch they receive, in order, with scripted failures.

    ``fail_after``: the ack stream fails with ``DaemonUnavailable`` right after acking each
    of these batch numbers (once each). ``ack_limit``: batches from this number on are never
    acked; the connection fails instead. ``fail_on_aclose``: dropping a connection raises.
    ``silent``: connections never ack and never fail (a peer that went quiet). ``error``:
    what ``fail_after`` raises.
    """

    def __init__(
        self,
        fail_after: Iterable[int] = (),
        *,
        ack_limit: int | None = None,
        fail_on_aclose: bool = False,
        silent: bool = False,
        error: type[SandboxkitError] = DaemonUnavailable,
    ) -> None:
        self.silent = silent
        self.error = error
        self.fail_after = set(fail_after)
        self.ack_limit = ack_limit
        self.fail_on_aclose = fail_on_aclose
        self.connects = 0
        self.closes = 0
        self.failures = 0
        self.sent: list[int] = []
        self.acked: list[int] = []
        self.failed = asyncio.Event()

    async def connect(self, session: str) -> StdinConnection:
        self.connects += 1
        return ScriptedConnection(self)


class ScriptedConnection:
    def __init__(self, transport: ScriptedTransport) -> None:
        self.t = transport
        self.queue: asyncio.Queue[int] = asyncio.Queue()

    async def send(self, seq: int, data: bytes) -> None:
        self.t.sent.append(seq)
        self.queue.put_nowait(seq)

    async def acks(self) -> AsyncIterator[int]:
        while True:
            seq = await self.queue.get()
            if self.t.silent:
                continue
            if self.t.ack_limit is not None and seq >= self.t.ack_limit:
                self.t.failures += 1
                self.t.failed.set()
                raise DaemonUnavailable(f"connection lost before batch {seq} was acked")
            self.t.acked.append(seq)
            yield seq
            if seq in self.t.fail_after:
                # Asked for the next ack after this one: the connection breaks.
                self.t.fail_after.discard(seq)
                self.t.failures += 1
                self.t.failed.set()
                raise self.t.error(f"connection reset after acking batch {seq}")

    async def aclose(self) -> None:
        self.t.closes += 1
        if self.t.fail_on_aclose:
            self.t.failures += 1
            raise DaemonUnavailable("connection reset while closing it")


BATCHES = [b"alpha\n", b"beta\n", b"gamma\n", b"delta\n"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("retries", [1, 0])
@pytest.mark.parametrize("fail_via", ["acks", "aclose"])
async def test_error_after_every_ack_is_success(retries: int, fail_via: str) -> None:
    """The error arrives once every batch is acked (from the ack stream, or from tearing the
    connection down): write_all completes, without raising, with or without retries left."""
    last = len(BATCHES) - 1
    transport = ScriptedTransport(
        fail_after=[last] if fail_via == "acks" else [],
        fail_on_aclose=fail_via == "aclose",
    )
    session = StdinSession(transport, retries=retries, backoff=0.001)
    await asyncio.wait_for(session.write_all(BATCHES), HANG)
    assert session.finished
    assert session.acked == len(BATCHES)
    assert session.unacked_bytes == 0
    assert transport.acked == list(range(len(BATCHES)))
    assert transport.sent == list(range(len(BATCHES)))  # nothing resent
    assert transport.connects == 1
    if fail_via == "aclose":
        assert transport.failures == 1  # the late error did arrive, and changed nothing


@pytest.mark.timeout(30)
@pytest.mark.parametrize("retries", [1, 0])
async def test_error_after_every_ack_before_close_then_close_completes(retries: int) -> None:
    """Every batch is acked, the connection breaks (the session sees the error while still
    open), and only then does the writer close: close completes, nothing is resent."""
    last = len(BATCHES) - 1
    transport = ScriptedTransport(fail_after=[last])
    session = StdinSession(transport, retries=retries, backoff=0.001)
    for batch in BATCHES:
        await session.write(batch)
    await asyncio.wait_for(transport.failed.wait(), HANG)
    # The session has handled the error (dropped the broken connection) before the close.
    await poll(lambda: transport.closes == 1, HANG, "the broken connection to be dropped")
    assert transport.failures == 1
    assert session.acked == len(BATCHES)
    assert not session.finished  # inputs are not exhausted yet
    await asyncio.wait_for(session.close(), HANG)
    assert session.finished
    assert transport.sent == list(range(len(BATCHES)))
    assert transport.connects == 1  # nothing to resend, so no reconnect was needed


@pytest.mark.timeout(30)
async def test_error_after_every_ack_with_an_async_input_source() -> None:
    """write_all over an async iterable whose end comes only after the connection broke
    (every batch acked): the end of input then finishes the session, no retry left."""
    last = len(BATCHES) - 1
    transport = ScriptedTransport(fail_after=[last])
    session = StdinSession(transport, retries=0, backoff=0.001)

    async def inputs() -> AsyncIterator[bytes]:
        for batch in BATCHES:
            yield batch
        await asyncio.wait_for(transport.failed.wait(), HANG)
        await poll(lambda: transport.closes == 1, HANG, "the broken connection to be dropped")

    await asyncio.wait_for(session.write_all(inputs()), HANG)
    assert session.finished
    assert transport.failures == 1
    assert transport.acked == list(range(len(BATCHES)))


@pytest.mark.timeout(30)
async def test_idle_connection_loss_costs_no_retry_and_later_writes_reconnect() -> None:
    """A connection lost with nothing in flight loses nothing: with retries=0 the session
    still reconnects for the next write, sends only that batch, and finishes."""
    transport = ScriptedTransport(fail_after=[1])
    session = StdinSession(transport, retries=0, backoff=0.001)
    await session.write(b"one\n")
    await session.write(b"two\n")
    await asyncio.wait_for(transport.failed.wait(), HANG)
    # Write only once the session has handled the loss (dropped that connection): the
    # next batch then goes out on a fresh connection, on no retry budget at all.
    await poll(lambda: transport.closes == 1, HANG, "the broken connection to be dropped")
    await session.write(b"three\n")
    await asyncio.wait_for(session.close(), HANG)
    assert session.acked == 3
    assert transport.sent == [0, 1, 2]
    assert transport.connects == 2


@pytest.mark.timeout(30)
async def test_every_retriable_error_is_retried_and_no_other() -> None:
    """The session retries by category: StdinBusy (the daemon's stdin buffer was full) is
    Retriable, so the batch goes again and lands once; a non-retriable error ends it."""
    busy = ScriptedTransport(fail_after=[0], error=StdinBusy)
    session = StdinSession(busy, retries=1, backoff=0.001)
    await asyncio.wait_for(session.write_all([b"one\n", b"two\n"]), HANG)
    assert session.finished
    assert busy.failures == 1
    assert busy.acked == [0, 1]
    assert busy.connects == 2

    refused = ScriptedTransport(fail_after=[0], error=StdinSeqMismatch)
    doomed = StdinSession(refused, retries=3, backoff=0.001)
    await doomed.write(b"one\n")
    await doomed.write(b"two\n")
    with pytest.raises(StdinSeqMismatch):
        await asyncio.wait_for(doomed.close(), HANG)
    assert refused.connects == 1


# -- (d) retries exhausted with something unacked -------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("retries", [0, 2])
async def test_retries_exhausted_with_unacked_batches_raise(retries: int) -> None:
    """Batches 0..1 are acked, batch 2 never is: after ``retries`` reconnects the session
    raises the retriable error; it does not report success for lost input."""
    transport = ScriptedTransport(ack_limit=2)
    session = StdinSession(transport, retries=retries, backoff=0.001)
    with pytest.raises(DaemonUnavailable):
        await asyncio.wait_for(session.write_all(BATCHES), HANG)
    assert not session.finished
    assert session.acked == 2
    assert session.unacked_bytes == sum(len(b) for b in BATCHES[2:])
    assert transport.connects == retries + 1
    assert session.reconnects == retries
    # Each reconnect resent exactly the unacked batches, from the first unacked one.
    assert transport.sent == [0, 1, 2, 3] + [2, 3] * retries


@pytest.mark.timeout(30)
async def test_retries_exhausted_raise_from_close_after_writes() -> None:
    """The same through write()/close(): close raises, it does not return quietly."""
    transport = ScriptedTransport(ack_limit=0)
    session = StdinSession(transport, retries=1, backoff=0.001)
    await session.write(b"lost\n")
    with pytest.raises(DaemonUnavailable):
        await asyncio.wait_for(session.close(), HANG)
    assert session.acked == 0
    assert transport.connects == 2


@pytest.mark.timeout(30)
async def test_retries_bound_consecutive_failures_not_all_failures() -> None:
    """``retries`` bounds *consecutive* failed connections: a connection that made
    progress (acked something) before breaking starts the count afresh, so a long session
    survives more disconnects in total than ``retries``."""
    batches = [f"b{i}\n".encode() for i in range(8)]
    transport = ScriptedTransport(fail_after=[0, 2, 4, 6])
    session = StdinSession(transport, retries=1, backoff=0.001)
    await asyncio.wait_for(session.write_all(batches), HANG)
    assert session.acked == len(batches)
    assert transport.failures == 4
    assert transport.acked == list(range(len(batches)))
    assert transport.connects == 5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fail_on_aclose", [False, True])
async def test_abort_ends_a_stuck_session_even_if_dropping_the_connection_fails(
    fail_on_aclose: bool,
) -> None:
    """A session waiting on a peer that went quiet: a cancelled close leaves it running
    (close is shielded), abort ends it — also when dropping the connection raises a
    retriable error, which must not turn the cancellation into a reconnect."""
    transport = ScriptedTransport(silent=True, fail_on_aclose=fail_on_aclose)
    session = StdinSession(transport, retries=3, backoff=0.001)
    await session.write(b"never acked\n")
    await poll(lambda: transport.sent == [0], HANG, "the batch to be sent")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(session.close(), 0.2)
    runner = session._runner
    assert runner is not None and not runner.done()
    try:
        await asyncio.wait_for(session.abort(), HANG)
    finally:
        # Were the cancellation swallowed, end the runner anyway: a task that survives
        # cancel() would hang the event loop's teardown and with it the whole suite.
        transport.fail_on_aclose = False
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    assert runner.done()
    assert transport.connects == 1
    assert transport.closes == 1
    assert not session.finished


# -- (c) the real ledger behind an in-memory transport ------------------------------------


class LedgerTransport:
    """The daemon's :class:`StdinLedger` behind an in-memory "network" that drops
    connections on a schedule of send attempts: ``before`` (the batch never reaches the
    ledger) or ``after`` (the ledger applied it, the ack is lost). Acks lag sends by a loop
    turn, so the session pipelines up to its bound."""

    def __init__(self, faults: dict[int, str]) -> None:
        self.ledger = StdinLedger(pid=4242)
        self.applied: list[bytes] = []
        self.faults = dict(faults)
        self.triggered: list[str] = []
        self.attempts = 0
        self.connects = 0
        self.duplicates = 0
        self.sizes: dict[int, int] = {}
        self.delivered = 0  # every batch below this was acked to the session
        self.max_sent = -1
        self.max_inflight = 0

    async def connect(self, session: str) -> StdinConnection:
        self.connects += 1
        return LedgerConnection(self, session)


class LedgerConnection:
    def __init__(self, transport: LedgerTransport, session: str) -> None:
        self.t = transport
        self.session = session
        self.outgoing: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self.incoming: asyncio.Queue[int | BaseException] = asyncio.Queue()
        self.worker = asyncio.get_running_loop().create_task(self._deliver())

    async def send(self, seq: int, data: bytes) -> None:
        t = self.t
        t.sizes[seq] = len(data)
        t.max_sent = max(t.max_sent, seq)
        inflight = sum(t.sizes[s] for s in range(t.delivered, t.max_sent + 1))
        t.max_inflight = max(t.max_inflight, inflight)
        self.outgoing.put_nowait((seq, data))

    async def _deliver(self) -> None:
        t = self.t
        while True:
            seq, data = await self.outgoing.get()
            await asyncio.sleep(0)  # the network: the ack comes a loop turn later
            attempt = t.attempts
            t.attempts += 1
            fault = t.faults.pop(attempt, None)
            if fault == "before":
                t.triggered.append(fault)
                self.incoming.put_nowait(DaemonUnavailable(f"attempt {attempt} lost"))
                return
            try:
                answer = t.ledger.apply(self.session, seq, data, t.applied.append)
            except SandboxkitError as exc:
                self.incoming.put_nowait(exc)
                return
            t.duplicates += bool(answer["duplicate"])
            if fault == "after":
                t.triggered.append(fault)
                self.incoming.put_nowait(DaemonUnavailable(f"ack of attempt {attempt} lost"))
                return
            self.incoming.put_nowait(int(answer["acked"]))

    async def acks(self) -> AsyncIterator[int]:
        while True:
            item = await self.incoming.get()
            if isinstance(item, BaseException):
                raise item
            self.t.delivered = max(self.t.delivered, item + 1)
            yield item

    async def aclose(self) -> None:
        self.worker.cancel()
        await asyncio.gather(self.worker, return_exceptions=True)


@st.composite
def _schedules(draw: st.DrawFn) -> tuple[list[bytes], dict[int, str], int]:
    batches = draw(st.lists(st.binary(min_size=0, max_size=40), min_size=1, max_size=25))
    faults = draw(
        st.dictionaries(
            st.integers(0, 2 * len(batches) + 4),
            st.sampled_from(["before", "after"]),
            max_size=8,
        )
    )
    bound = draw(st.integers(1, 120))
    return batches, faults, bound


@settings(max_examples=200, deadline=None)
@given(_schedules())
def test_ledger_applies_every_batch_exactly_once_in_order(
    schedule: tuple[list[bytes], dict[int, str], int],
) -> None:
    batches, faults, bound = schedule

    async def scenario() -> tuple[LedgerTransport, StdinSession]:
        transport = LedgerTransport(faults)
        session = StdinSession(
            transport, max_unacked_bytes=bound, retries=len(faults) + 1, backoff=0
        )
        await asyncio.wait_for(session.write_all(batches), HANG)
        return transport, session

    transport, session = asyncio.run(scenario())
    # Exactly once, in order, batch by batch.
    assert transport.applied == batches
    assert transport.ledger.expected(session.session_id) == len(batches)
    assert session.acked == len(batches)
    # Each disconnect costs exactly one resend: only the unacked batches go again.
    assert transport.attempts == len(batches) + len(transport.triggered)
    assert transport.duplicates == transport.triggered.count("after")
    assert transport.connects == 1 + len(transport.triggered)
    # The bound on unacked bytes holds for what is in flight (one oversized batch may
    # exceed it alone).
    assert transport.max_inflight <= bound + max(len(b) for b in batches)
    assert transport.max_inflight <= max(bound, max(len(b) for b in batches))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=40))
def test_ledger_writes_only_the_expected_batch(seqs: list[int]) -> None:
    """Any order of arrivals: the expected batch is written, an earlier one is re-acked
    without writing, a later one is refused with StdinSeqMismatch (nothing written)."""
    ledger = StdinLedger(pid=7)
    written: list[bytes] = []
    expected = 0
    for seq in seqs:
        data = b"batch-%d" % seq
        if seq > expected:
            with pytest.raises(StdinSeqMismatch) as info:
                ledger.apply("s", seq, data, written.append)
            assert info.value.details["expected"] == expected
            assert info.value.details["got"] == seq
            assert info.value.details["pid"] == 7
        else:
            answer = ledger.apply("s", seq, data, written.append)
            assert answer["acked"] == seq
            assert answer["duplicate"] == (seq < expected)
            if seq == expected:
                expected += 1
            assert answer["next_seq"] == expected
        assert written == [b"batch-%d" % i for i in range(expected)]
        assert ledger.expected("s") == expected
    assert ledger.expected("another session") == 0


def test_ledger_sessions_are_independent() -> None:
    ledger = StdinLedger(pid=1)
    written: list[bytes] = []
    ledger.apply("a", 0, b"a0", written.append)
    ledger.apply("b", 0, b"b0", written.append)
    assert ledger.apply("a", 0, b"a0", written.append)["duplicate"] is True
    ledger.apply("a", 1, b"a1", written.append)
    with pytest.raises(StdinSeqMismatch):
        ledger.apply("b", 2, b"b2", written.append)
    assert written == [b"a0", b"b0", b"a1"]


# -- (b) the real daemon, disconnects injected around the POSTs ---------------------------


class FaultyApi:
    """Wraps the :class:`ApiClient` under :class:`HttpStdinTransport`: a stdin POST for a
    batch with a scheduled fault fails ``before`` reaching the daemon, or ``after`` the
    daemon applied it (the ack is lost on the way back)."""

    def __init__(self, api: ApiClient, faults: list[tuple[int, str]]) -> None:
        self.api = api
        self.pending: dict[int, list[str]] = {}
        for seq, mode in faults:
            self.pending.setdefault(seq, []).append(mode)
        self.posts = 0
        self.answers: list[dict[str, Any]] = []

    async def call(self, method: str, path: str, json: Any = None, **params: Any) -> Any:
        if not (method == "POST" and path.endswith("/stdin")) or json.get("end"):
            return await self.api.call(method, path, json=json, **params)  # not a batch
        self.posts += 1
        modes = self.pending.get(json["seq"])
        mode = modes.pop(0) if modes else None
        if mode == "before":
            raise DaemonUnavailable("injected: the POST never reached the daemon")
        answer = await self.api.call(method, path, json=json, **params)
        self.answers.append(answer)
        if mode == "after":
            raise DaemonUnavailable("injected: the ack was lost on its way back")
        return answer


def _batch(index: int, size: int) -> str:
    head = f"<{index}:"
    body = "".join(chr(ord("a") + (index + k) % 26) for k in range(size))
    return head + body + ">\n"


@st.composite
def _daemon_schedules(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, str]], int]:
    sizes = draw(st.lists(st.integers(0, 3000), min_size=1, max_size=10))
    faults = draw(
        st.lists(
            st.tuples(st.integers(0, len(sizes) - 1), st.sampled_from(["before", "after"])),
            max_size=5,
        )
    )
    bound = draw(st.sampled_from([1, 2000, 1 << 20]))
    return sizes, faults, bound


@pytest.mark.timeout(120)
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schedule=_daemon_schedules())
def test_cat_receives_every_byte_exactly_once_through_disconnects(
    conn: dict[str, str], schedule: tuple[list[int], list[tuple[int, str]], int]
) -> None:
    sizes, faults, bound = schedule
    batches = [_batch(i, size) for i, size in enumerate(sizes)]

    async def scenario() -> tuple[str, int | None, FaultyApi]:
        api = ApiClient(conn["url"], conn["token"])
        try:
            async with await AsyncSandbox.create(**conn) as sbx:
                handle = await sbx.commands.run("cat", background=True)
                faulty = FaultyApi(api, faults)
                transport = HttpStdinTransport(faulty, sbx.sandbox_id, handle.pid)  # type: ignore[arg-type]
                session = StdinSession(
                    transport, max_unacked_bytes=bound, retries=len(faults) + 1, backoff=0.001
                )
                await asyncio.wait_for(session.write_all(batches), 10)
                await sbx.commands.close_stdin(handle.pid)
                result = await asyncio.wait_for(handle.wait(), 10)
                return result.stdout, result.exit_code, faulty
        finally:
            await api.aclose()

    stdout, exit_code, faulty = asyncio.run(scenario())
    assert exit_code == 0
    assert stdout == "".join(batches)
    # Every injected fault fired; each cost exactly one resend of an unacked batch.
    assert all(not modes for modes in faulty.pending.values())
    assert faulty.posts == len(batches) + len(faults)
    after = sum(1 for _, mode in faults if mode == "after")
    assert sum(1 for a in faulty.answers if a["duplicate"]) == after


@pytest.mark.timeout(30)
async def test_daemon_dedups_and_refuses_future_batches(conn: dict[str, str]) -> None:
    """The HTTP endpoint: a batch from the future is a typed StdinSeqMismatch (409) and
    writes nothing; a resent batch is acked as a duplicate and written once."""
    async with await AsyncSandbox.create(**conn) as sbx:
        api = ApiClient(conn["url"], conn["token"])
        try:
            handle = await sbx.commands.run("cat", background=True)
            path = f"/sandboxes/{sbx.sandbox_id}/processes/{handle.pid}/stdin"
            session = secrets.token_hex(4)

            def body(seq: int, data: bytes) -> dict[str, Any]:
                return {"session": session, "seq": seq, "data": base64.b64encode(data).decode()}

            with pytest.raises(StdinSeqMismatch) as info:
                await api.call("POST", path, json=body(1, b"future\n"))
            assert info.value.status == 409
            assert info.value.details["expected"] == 0
            assert info.value.details["got"] == 1
            first = await api.call("POST", path, json=body(0, b"zero\n"))
            assert first["duplicate"] is False
            again = await api.call("POST", path, json=body(0, b"zero\n"))
            assert again["duplicate"] is True
            assert again["next_seq"] == 1
            await api.call("POST", path, json=body(1, b"one\n"))
            await sbx.commands.close_stdin(handle.pid)
            result = await asyncio.wait_for(handle.wait(), 10)
            assert result.stdout == "zero\none\n"
        finally:
            await api.aclose()
