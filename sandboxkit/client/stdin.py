"""Stdin append sessions: numbered batches, acked, resent after reconnects, exactly once.

The session is modelled on streaming append sessions (S2): batches are pipelined up to a
bound on unacked bytes, acks arrive on their own, and a connection can fail at any time.
Failure F7 is the rule this module is built around: once the inputs are exhausted and
every batch is acked, the session has succeeded — an error that arrives afterwards,
retriable or not, with retries left or not, changes nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Protocol, runtime_checkable

from sandboxkit.client.api import ApiClient
from sandboxkit.errors import DaemonUnavailable, Retriable, SandboxkitError

__all__ = [
    "EndingStdinTransport",
    "HttpStdinTransport",
    "StdinConnection",
    "StdinSession",
    "StdinTransport",
]


class StdinConnection(Protocol):
    """One connection of a session: send batches, read acks (in order)."""

    async def send(self, seq: int, data: bytes) -> None:
        """Queue batch ``seq`` for sending (does not wait for its ack)."""

    def acks(self) -> AsyncIterator[int]:
        """Acked batch numbers as they arrive; raises when the connection fails."""

    async def aclose(self) -> None:
        """Drop the connection."""


@runtime_checkable
class StdinTransport(Protocol):
    """Opens connections for a session; HTTP in real use, scripted in tests."""

    async def connect(self, session: str) -> StdinConnection:
        """A fresh connection for ``session``."""


@runtime_checkable
class EndingStdinTransport(StdinTransport, Protocol):
    """A transport that can also tell the daemon a session is over."""

    async def end(self, session: str) -> None:
        """``session`` holds every ack and sends nothing more: the daemon may forget it."""


class StdinSession:
    """Write to a process's stdin exactly once and in order, across reconnects.

    ``write`` queues a batch (waiting while more than ``max_unacked_bytes`` are unacked);
    ``close`` waits until everything is acked. On a :class:`~sandboxkit.errors.Retriable`
    error (the daemon unreachable, its stdin buffer full …) or a transport's
    ``ConnectionError`` the session reconnects and resends exactly the unacked batches;
    the daemon acks a batch it already applied without writing it again. ``retries``
    bounds consecutive failed connections while something is in flight; a connection lost
    while nothing is in flight costs no retry.
    """

    def __init__(
        self,
        transport: StdinTransport,
        *,
        max_unacked_bytes: int = 1 << 20,
        retries: int = 5,
        backoff: float = 0.05,
        session_id: str | None = None,
    ) -> None:
        if max_unacked_bytes <= 0:
            raise ValueError("max_unacked_bytes must be positive")
        self.transport = transport
        self.session_id = session_id or secrets.token_hex(8)
        self.max_unacked_bytes = max_unacked_bytes
        self.retries = retries
        self.backoff = backoff
        self.acked = 0
        """Batches acked so far (every batch below this number is applied)."""
        self.reconnects = 0
        self._next_seq = 0
        self._unacked: deque[tuple[int, bytes]] = deque()
        self._unacked_bytes = 0
        self._inputs_done = False
        self._pulse: asyncio.Future[None] | None = None
        self._runner: asyncio.Task[None] | None = None
        self._ended = False

    @property
    def unacked_bytes(self) -> int:
        """Bytes written but not yet acked."""
        return self._unacked_bytes

    @property
    def finished(self) -> bool:
        """Inputs exhausted and nothing in flight: the session has succeeded."""
        return self._inputs_done and not self._unacked

    async def __aenter__(self) -> StdinSession:
        return self

    async def __aexit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            await self.close()
        else:
            await self.abort()

    async def write(self, data: bytes | str) -> int:
        """Queue one batch; returns its sequence number."""
        if self._inputs_done:
            raise RuntimeError("the session is closed")
        raw = data.encode() if isinstance(data, str) else bytes(data)
        self._ensure_running()
        while self._unacked and self._unacked_bytes + len(raw) > self.max_unacked_bytes:
            await self._wait_change()
        seq = self._next_seq
        self._next_seq += 1
        self._unacked.append((seq, raw))
        self._unacked_bytes += len(raw)
        self._notify()
        return seq

    async def write_all(self, inputs: Iterable[bytes | str] | AsyncIterable[bytes | str]) -> None:
        """Write every input, then :meth:`close`."""
        if isinstance(inputs, AsyncIterable):
            async for item in inputs:
                await self.write(item)
        else:
            for item in inputs:
                await self.write(item)
        await self.close()

    async def close(self) -> None:
        """No more inputs: wait until every batch is acked (or raise why it cannot be),
        then end the session on the daemon, which forgets it at once (one-shot writes
        leave nothing behind there). Ending is best effort: if it fails, the daemon
        forgets the session once it has been idle long enough."""
        self._inputs_done = True
        self._notify()
        if self._runner is None:
            return
        await asyncio.shield(self._runner)
        if not self._ended and isinstance(self.transport, EndingStdinTransport):
            self._ended = True
            with contextlib.suppress(SandboxkitError, ConnectionError):
                await self.transport.end(self.session_id)

    async def abort(self) -> None:
        """Stop now; unacked batches may or may not have been applied."""
        self._inputs_done = True
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    # -- internals -------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())
        elif self._runner.done():
            self._runner.result()  # re-raise why the session died

    def _notify(self) -> None:
        pulse, self._pulse = self._pulse, None
        if pulse is not None and not pulse.done():
            pulse.set_result(None)

    def _next_change(self) -> asyncio.Future[None]:
        """A future resolved at the next write, ack or close (no lost wake-ups)."""
        if self._pulse is None or self._pulse.done():
            # A pulse can be done without _notify: cancelled by a task that awaited it.
            self._pulse = asyncio.get_running_loop().create_future()
        return self._pulse

    async def _wait_change(self) -> None:
        runner = self._runner
        waiters: set[asyncio.Future[None]] = {self._next_change()}
        if runner is not None:
            waiters.add(runner)
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if runner is not None and runner.done():
            runner.result()

    async def _run(self) -> None:
        failures = 0
        while not self.finished:
            acked_before = self.acked
            try:
                await self._one_connection()
            except (Retriable, ConnectionError):
                if self.finished:
                    return  # F7: everything was acked; a late error changes nothing
                if self.acked > acked_before:
                    failures = 0  # the connection made progress: count failures afresh
                if not self._unacked:
                    # Idle when the connection broke: nothing was lost, no retry spent.
                    # Reconnect once there is something to send (or we are done).
                    while not self._unacked and not self._inputs_done:
                        await self._next_change()
                    continue
                failures += 1
                if failures > self.retries:
                    raise
                self.reconnects += 1
                await asyncio.sleep(self.backoff * 2 ** (failures - 1))
                continue
            failures = 0

    async def _one_connection(self) -> None:
        conn = await self.transport.connect(self.session_id)
        sender = asyncio.get_running_loop().create_task(self._send_loop(conn))
        acks = conn.acks()
        next_ack: asyncio.Future[int] | None = None
        try:
            while not self.finished:
                next_ack = asyncio.ensure_future(acks.__anext__())
                done, _ = await asyncio.wait(
                    {next_ack, sender}, return_when=asyncio.FIRST_COMPLETED
                )
                if next_ack not in done:
                    next_ack.cancel()
                    await asyncio.gather(next_ack, return_exceptions=True)
                    sender.result()  # raises if the sender failed; else we are finished
                    continue
                try:
                    seq = next_ack.result()
                except StopAsyncIteration:
                    raise DaemonUnavailable("stdin connection closed") from None
                self._on_ack(seq)
        finally:
            # Cancelled (abort) while waiting: the pending ack read must not outlive us.
            if next_ack is not None and not next_ack.done():
                next_ack.cancel()
                await asyncio.gather(next_ack, return_exceptions=True)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            # An error dropping the connection must not replace why it is dropped (above
            # all a cancellation: abort() would turn into a reconnect and never end).
            with contextlib.suppress(Exception):
                await conn.aclose()

    async def _send_loop(self, conn: StdinConnection) -> None:
        # A new connection resends exactly what is unacked, then what is written next.
        sent_upto = self._unacked[0][0] if self._unacked else self._next_seq
        while not self.finished:
            change = self._next_change()
            pending = [(seq, data) for seq, data in self._unacked if seq >= sent_upto]
            if not pending:
                # Shielded: cancelling this sender (a dropped connection) must not cancel
                # the pulse the runner and writers wait on too.
                await asyncio.shield(change)
                continue
            for seq, data in pending:
                await conn.send(seq, data)
                sent_upto = seq + 1

    def _on_ack(self, seq: int) -> None:
        while self._unacked and self._unacked[0][0] <= seq:
            _, data = self._unacked.popleft()
            self._unacked_bytes -= len(data)
        self.acked = max(self.acked, seq + 1)
        self._notify()


class HttpStdinTransport:
    """Stdin batches as POSTs to the daemon, one at a time, in order."""

    def __init__(self, api: ApiClient, sandbox_id: str, pid: int) -> None:
        self.api = api
        self.path = f"/sandboxes/{sandbox_id}/processes/{pid}/stdin"

    async def connect(self, session: str) -> StdinConnection:
        """A connection whose acks come back as the POSTs complete."""
        return _HttpStdinConnection(self, session)

    async def end(self, session: str) -> None:
        """Tell the daemon ``session`` is over (it forgets it)."""
        body = {"session": session, "seq": 0, "end": True}
        await self.api.call("POST", self.path, json=body)


class _HttpStdinConnection:
    def __init__(self, transport: HttpStdinTransport, session: str) -> None:
        self._transport = transport
        self._session = session
        self._outgoing: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self._acks: asyncio.Queue[int | BaseException] = asyncio.Queue()
        self._worker = asyncio.get_running_loop().create_task(self._post_loop())

    async def send(self, seq: int, data: bytes) -> None:
        self._outgoing.put_nowait((seq, data))

    async def acks(self) -> AsyncIterator[int]:
        while True:
            item = await self._acks.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    async def _post_loop(self) -> None:
        try:
            while True:
                seq, data = await self._outgoing.get()
                body = {
                    "session": self._session,
                    "seq": seq,
                    "data": base64.b64encode(data).decode(),
                }
                answer = await self._transport.api.call("POST", self._transport.path, json=body)
                self._acks.put_nowait(int(answer["acked"]))
        except Exception as exc:
            self._acks.put_nowait(exc)

    async def aclose(self) -> None:
        self._worker.cancel()
        await asyncio.gather(self._worker, return_exceptions=True)
