"""Consumers: a cursor into one process's output log plus a transport, each with its own
sender task, so that no consumer ever waits for another and the producer waits for none."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any, Protocol

from sandboxkit._compat import uncancel, within
from sandboxkit.daemon import heap
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.consumer_sinks import (
    MIN_SHARE,
    Drain,
    FrameSink,
    PeerProbe,
    SendBudget,
    SendFile,
    SendNow,
    SendParts,
    SizeBuffer,
)
from sandboxkit.daemon.events import EventJournal
from sandboxkit.daemon.fanout import Fanout, Feed, Offered, Pull
from sandboxkit.daemon.file_span import FileSpan
from sandboxkit.daemon.output_log import Chunk, Gap, OutputLog
from sandboxkit.daemon.stall_watch import StallWatch
from sandboxkit.daemon.tcp_peer import PENDING_BYTES
from sandboxkit.errors import ConsumerKicked, InvalidArgument, SandboxkitError
from sandboxkit.vocab import (
    BLOCKED_AFTER,
    CONSUMER_STATES,
    DEFAULT_ROLE,
    ROLE_PATTERN,
    STARVED_AFTER,
    ConsumerState,
)
from sandboxkit.wire import FrameKind, encode_frame

__all__ = [
    "BLOCKED_AFTER",
    "CONSUMER_STATES",
    "DEFAULT_ROLE",
    "MIN_SHARE",
    "ROLE_PATTERN",
    "STARVED_AFTER",
    "Consumer",
    "ConsumerState",
    "FrameSink",
    "SendBudget",
    "StreamSource",
    "check_role",
]


def check_role(role: str | None) -> str:
    """``role``, or the default; InvalidArgument unless it is 1-32 of ``[a-z0-9_-]``."""
    if role is None:
        return DEFAULT_ROLE
    if not isinstance(role, str) or ROLE_PATTERN.fullmatch(role) is None:
        raise InvalidArgument("role must be 1 to 32 characters of a-z, 0-9, _ and -", field="role")
    return role


KICK_FRAME_TIMEOUT = 0.1
"""How long a kicked consumer's transport gets to accept the ``kicked`` error frame."""

_FIRST_SENDS = 128 * 1024
"""Payload bytes per send until a send that waited tells how fast the peer drains (see
``Consumer._send``): small enough for a slow reader's first sends to drain well within
the stall timeout."""

_BACKPRESSURE = 0.005
"""A send that took this long (seconds) waited for the transport to drain."""

CONNECTION_MEMORY = 64 * 1024
"""About what a consumer's connection holds beyond its sends (its read buffer, the HTTP
protocol's state): counted as released, with its largest send, when it leaves."""

_ids = itertools.count(1)


class StreamSource(Protocol):
    """What a consumer reads: a process's log and its current state."""

    pid: int
    sandbox_id: str
    log: OutputLog
    fanout: Fanout
    kill_reason: str | None
    """What ended the process, if not itself (``oom``, ``timeout``, ``user`` …)."""

    def states(self) -> dict[str, Any]:
        """``{"process_state": ..., "sandbox_state": ...}`` for keepalive frames."""


class Consumer:
    """One reader of one process's output, with its own cursor and metrics."""

    def __init__(
        self,
        source: StreamSource,
        cursor: int | None,
        config: DaemonConfig,
        journal: EventJournal,
        *,
        name: str | None = None,
        peer: str | None = None,
        role: str | None = None,
        budget: SendBudget | None = None,
    ) -> None:
        """``budget``: the daemon's send budget, shared with its other consumers (by
        default one of its own, of ``config.send_budget``)."""
        self.consumer_id = f"c{next(_ids)}"
        self.name = name or self.consumer_id
        self.role = check_role(role)
        """Who reads: a label the client gives (``sdk`` by default, ``panel``, ...)."""
        self.peer = peer
        self.source = source
        # No cursor: from the very first chunk. If the start of the output was evicted,
        # the reader is told how much with a gap frame (never handed the rest as whole).
        self.cursor = 0 if cursor is None else cursor
        self.config = config
        self.journal = journal
        self.bytes_sent = 0
        self.frames_sent = 0
        self.attached_at = time.time()
        self.last_send: float | None = None
        self.closed_at: float | None = None
        self.close_reason: str | None = None
        self._waiting = False
        self._final_state: ConsumerState | None = None
        self._final_lag: tuple[int, int] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._feed: Feed | None = None
        self._peer_probe: PeerProbe | None = None
        self._send_parts: SendParts | None = None
        self._send_now: SendNow | None = None
        self._drain: Drain | None = None
        self._owed = False  # a send from the append left bytes with the transport
        self._send_file: SendFile | None = None
        self._size_buffer: SizeBuffer | None = None
        self._requested = cursor
        self._kick_request: tuple[str, float] | None = None
        self._states_sent: dict[str, Any] | None = None
        self._stall = StallWatch(self.kick)
        self._coalesce = min(config.send_batch, _FIRST_SENDS)
        self._largest_send = 0
        self._budget = budget or SendBudget(config.send_budget)

    # -- metrics ---------------------------------------------------------------------

    @property
    def state(self) -> ConsumerState:
        """One of :data:`CONSUMER_STATES`: ``streaming``; ``blocked`` (its own send is
        stuck); ``starved`` (its output waits, yet it is not sending: held back by someone
        else); ``kicked`` or ``closed`` (final)."""
        return self._observed()[0]

    def _observed(self) -> tuple[ConsumerState, float | None, float | None]:
        # The state, with its blocked_since and its starved_since (one unless final).
        blocked = self.blocked_since
        starved = None if blocked is not None else self.starved_since
        if self._final_state is not None:
            return self._final_state, blocked, starved
        if blocked is not None:
            return "blocked", blocked, starved
        return ("starved" if starved is not None else "streaming"), blocked, starved

    @property
    def blocked_since(self) -> float | None:
        """Monotonic time since which the transport takes no bytes, if for at least
        ``BLOCKED_AFTER``: the current send is stuck, or the peer's receive window has been
        full (bytes wait in the socket and none go out) even though sends still complete
        into the server's buffers (a stopped client, issue 10)."""
        if self._final_state is not None:
            return None
        now = time.monotonic()
        since = self._stall.since
        if since is not None and now - since >= BLOCKED_AFTER:
            return since
        closed = self._peer_probe() if self._peer_probe is not None else None
        if closed is not None and closed >= BLOCKED_AFTER:
            return now - closed if since is None else min(since, now - closed)
        return None

    @property
    def starved_since(self) -> float | None:
        """Wall-clock time its oldest pending output was written, if the consumer is
        waiting for its feed (not sending) and that output has waited ``STARVED_AFTER``.

        Under the ``cursor`` policy a consumer never waits while output is pending (it
        reads the log itself), so this shows only consumers fed by someone else."""
        if not self._waiting or self._final_state is not None:
            return None
        log = self.source.log
        since = log.ts_of(max(self.cursor, log.first_seq))
        if since is None:  # nothing pending
            return None
        return since if time.time() - since >= STARVED_AFTER else None

    @property
    def lag_bytes(self) -> int:
        """Bytes the process wrote that this consumer's transport has not accepted yet
        (for a closed or kicked consumer: at the moment it ended, no longer changing)."""
        if self._final_lag is not None:
            return self._final_lag[0]
        log = self.source.log
        return log.total_bytes - log.offset_of(self.cursor)

    @property
    def head(self) -> int:
        """The log's head (for a closed or kicked consumer: when it ended)."""
        return self._final_lag[1] if self._final_lag is not None else self.source.log.head

    def metrics(self) -> dict[str, Any]:
        """A JSON-ready snapshot of this consumer (the rows of ``GET /consumers``)."""
        state, blocked, starved = self._observed()
        return {
            "consumer_id": self.consumer_id,
            "name": self.name,
            "role": self.role,
            "sandbox_id": self.source.sandbox_id,
            "pid": self.source.pid,
            "peer": self.peer,
            "cursor": self.cursor,
            "head": self.head,
            "lag_bytes": self.lag_bytes,
            "bytes_sent": self.bytes_sent,
            "frames_sent": self.frames_sent,
            "state": state,
            "blocked_since": None if blocked is None else _wall(blocked),
            "starved_since": starved,
            "last_send": self.last_send,
            "attached_at": self.attached_at,
            "closed_at": self.closed_at,
            "close_reason": self.close_reason,
        }

    # -- the sender ------------------------------------------------------------------

    async def run(self, sink: FrameSink) -> None:
        """Send frames from the cursor on until the process ends, the transport stalls
        (kick) or the task is cancelled (the peer went away)."""
        self._task = asyncio.current_task()
        self._peer_probe = getattr(sink, "window_closed_for", None)
        self._send_parts = getattr(sink, "send_parts", None)
        self._send_now = getattr(sink, "send_now", None)
        self._drain = getattr(sink, "drain", None) if self._send_now is not None else None
        self._send_file = getattr(sink, "send_file", None)
        self._size_buffer = getattr(sink, "size_send_buffer", None)
        self._feed = feed = self.source.fanout.attach(self.cursor, self.kick)
        self._stall.timeout = feed.stall_timeout
        self.cursor = feed.start
        self._record("consumer.attached", cursor=self.cursor)
        if self._requested is not None and self._requested != feed.start:
            self._record(
                "consumer.cursor_ignored",
                reason=self.source.fanout.name,
                requested=self._requested,
                cursor=feed.start,
            )
        reason = "end"
        self._budget.consumers += 1
        try:
            await self._stream(sink, feed)
        except asyncio.CancelledError:
            if self._kick_request is None:
                reason = "detached"
                raise
            reason = "kicked"
            uncancel()  # the kick cancelled this task on purpose
            await self._kick(sink, *self._kick_request)
        except SandboxkitError as exc:
            reason = exc.code
            await self._try_send(sink, encode_frame(FrameKind.ERROR, exc.to_wire()))
        finally:
            self._stall.close()
            self._budget.consumers -= 1
            feed.close()
            self._finish("kicked" if reason == "kicked" else "closed", reason)
            # Its sends and its connection are freed once the connection closes: the
            # heap is trimmed a moment later if enough consumers left (heap.py).
            heap.released_soon(CONNECTION_MEMORY + self._largest_send)
            try:
                await sink.close()
            finally:
                self._let_go()

    def _let_go(self) -> None:
        # A consumer that left stays in the metrics for a while: it keeps nothing of its
        # connection (the sink's methods held the server's request, its buffers and its
        # transport, every one of the 400 that left at once), nor of its feed.
        self._peer_probe = self._send_parts = self._size_buffer = self._send_file = None
        self._send_now = self._drain = None
        self._feed = None
        self._task = None

    def kick(self, reason: str, blocked_for: float) -> None:
        """End the stream with a ``kicked`` error frame: from its stall watchdog, or from
        outside its task (the callback a fan-out policy's feed gets at attach)."""
        if self._final_state is None and self._kick_request is None and self._task:
            self._kick_request = (reason, blocked_for)
            self._task.cancel()

    async def _stream(self, sink: FrameSink, feed: Feed) -> None:
        log = self.source.log
        await self._send(
            sink,
            encode_frame(
                FrameKind.START,
                {
                    "pid": self.source.pid,
                    "sandbox_id": self.source.sandbox_id,
                    "consumer_id": self.consumer_id,
                    "cursor": self.cursor,
                    "requested_cursor": self._requested,
                    "head": log.head,
                    "first_seq": log.first_seq,
                    "keepalive_interval": self.config.keepalive_interval,
                    "stall_timeout": feed.stall_timeout,
                    "fanout": self.source.fanout.name,
                    **self._states(),
                },
            ),
        )
        # No cursor asks for everything from the first chunk, as for the log's own feed.
        requested = 0 if self._requested is None else self._requested
        if requested < feed.start:
            # A lab policy that delivers new output only did not honour the cursor: what
            # lies between is as lost to this reader as evicted output, and said so the
            # same way, exactly (the reader's on_gap, its marker, the panel's line).
            lost = log.offset_of(feed.start) - log.offset_of(requested)
            await self._send_gap(sink, Gap(requested, feed.start, lost), "not_replayed")
        keepalive = self.config.keepalive_interval
        eager = self._send_at_once if self._send_now is not None else None
        while True:
            self._waiting = True
            try:
                # What is read at once is held until sent: within this consumer's share,
                # and no more than a send takes (a span is one send, see _send).
                batch_limit = min(self._coalesce, self._budget.share(self.config.send_batch))
                pulled = await feed.pull(self.cursor, batch_limit, keepalive, eager)
            finally:
                self._waiting = False
            gap = pulled.gap
            states = self.source.states()
            told = states != self._states_sent and states["process_state"] != "exited"
            # A lifecycle change (pause, resume, ...) goes out before anything else, even
            # while output flows (no keepalive is due then): views follow it now. The
            # sandbox nudges idle feeds when it changes, so that is at once too. An exit
            # is said by the end frame, after the rest of the output.
            await self._send_pulled(sink, pulled, told)
            if self._owed:
                await self._drained()
            if pulled.ended:
                await self._send(
                    sink,
                    encode_frame(
                        FrameKind.END,
                        {
                            "exit_code": log.exit_code,
                            "reason": self.source.kill_reason or "exit",
                            "cursor": self.cursor,
                            "ended_at": log.ended_at,
                        },
                    ),
                )
                return
            idle = gap is None and not pulled.chunks and pulled.span is None
            if idle and not told and not pulled.served:
                await self._send_keepalive(sink)

    async def _drained(self) -> None:
        # What the kernel did not take of a send from the append, waited for under the
        # stall watch as any send's rest (a reader that stopped reading is kicked then).
        self._owed = False
        assert self._drain is not None
        self._stall.start()
        try:
            await self._drain()
        finally:
            self._stall.stop()

    def _send_at_once(self) -> Offered:
        """New output sent from the producer's own turn (the feed's ``Eager``) when it is
        small (a line, a prompt: for a printed line's latency), every state change has
        been told and the connection takes bytes now. ``LEFT`` leaves it to the task, a
        turn later; bulk output always goes that way, in sends as large as the peer
        drains (``_send``)."""
        send_now, log = self._send_now, self.source.log
        if send_now is None or self._kick_request is not None or self._final_state is not None:
            return Offered.LEFT
        if not 0 < log.total_bytes - log.offset_of(self.cursor) <= PENDING_BYTES:
            return Offered.LEFT
        states = self.source.states()
        if states != self._states_sent and states["process_state"] != "exited":
            return Offered.LEFT  # (told first, by the task)
        gap, chunks = log.read(self.cursor, PENDING_BYTES)
        if gap is not None or not chunks:
            return Offered.LEFT
        parts: list[bytes | memoryview] = []
        for chunk in chunks:
            parts += (chunk.head, chunk.data)
        size = sum(map(len, parts))
        left = send_now(parts, size)
        if left is None:
            return Offered.LEFT
        self.cursor = chunks[-1].seq + 1
        self._sent(size, len(chunks))
        if left:  # the task waits for what the transport holds (_drained)
            self._owed = True
            return Offered.SENT
        return Offered.DONE

    async def _send_pulled(self, sink: FrameSink, pulled: Pull, told: bool) -> None:
        try:  # (a span holds a descriptor: let go of it whatever happens)
            if told:
                await self._send_keepalive(sink)
            if pulled.gap is not None:
                await self._send_gap(sink, pulled.gap)
            if pulled.chunks:
                await self._send_chunks(sink, pulled.chunks)
            if pulled.span is not None:
                await self._send_span(sink, pulled.span)
        finally:
            if pulled.span is not None:
                pulled.span.close()

    async def _send_span(self, sink: FrameSink, span: FileSpan) -> None:
        # Frames as they sit in a segment file: ``sendfile`` where the sink can, else one
        # copy (never part of a span: a file shrunk under it sends nothing, and the next
        # pull finds the damage and says so with a gap).
        if self._send_file is None:
            data = span.read()
            if data is None:
                return
            await self._send(sink, data, frames=span.count)
        else:
            await self._send(sink, span, frames=span.count)
        self.cursor = span.end_seq

    def _states(self) -> dict[str, Any]:
        self._states_sent = states = self.source.states()
        return states

    async def _send_keepalive(self, sink: FrameSink) -> None:
        log = self.source.log
        await self._send(
            sink,
            encode_frame(
                FrameKind.KEEPALIVE, {"cursor": self.cursor, "head": log.head, **self._states()}
            ),
        )

    async def _send_gap(self, sink: FrameSink, gap: Gap, reason: str = "evicted") -> None:
        self._record(
            "consumer.gap",
            reason=reason,
            cursor=gap.cursor,
            first_available=gap.first_available,
            bytes_lost=gap.bytes_lost,
        )
        await self._send(
            sink,
            encode_frame(
                FrameKind.GAP,
                {
                    "cursor": gap.cursor,
                    "first_available": gap.first_available,
                    "bytes_lost": gap.bytes_lost,
                    "reason": reason,
                },
            ),
        )
        self.cursor = gap.first_available

    async def _send_chunks(self, sink: FrameSink, chunks: list[Chunk]) -> None:
        # Frames are coalesced into one send of up to ``_coalesce`` payload bytes: the
        # Python cost of a send (the server's chunked encoding, the ASGI wrappers, this
        # bookkeeping) is per call, so several 64 KiB frames in one send cost far less
        # than one send each, the join's copy included (benchmarks/compare.py).
        limit = min(self._coalesce, self._budget.share(self.config.send_batch))
        batch: list[Chunk] = []
        size = 0
        for chunk in chunks:
            if batch and size + chunk.size > limit:
                await self._send_batch(sink, batch)
                batch, size = [], 0
            batch.append(chunk)
            size += chunk.size
        if batch:
            await self._send_batch(sink, batch)

    async def _send_batch(self, sink: FrameSink, batch: list[Chunk]) -> None:
        parts: list[bytes | memoryview] = []
        for chunk in batch:
            parts += (chunk.head, chunk.data)
        await self._send(sink, parts, frames=len(batch))
        self.cursor = batch[-1].seq + 1

    async def _send(
        self,
        sink: FrameSink,
        data: bytes | list[bytes | memoryview] | FileSpan,
        frames: int = 1,
    ) -> None:
        started = self._stall.start()
        size = sum(map(len, data)) if isinstance(data, list) else len(data)
        try:
            if isinstance(data, bytes):
                await sink.send(data)
            elif isinstance(data, FileSpan):
                assert self._send_file is not None
                await self._send_file(data)
            elif self._send_parts is not None:
                # The sink joins the frames with its own framing: one copy, not two.
                await self._send_parts(data, size)
            else:
                await sink.send(b"".join(data))
        finally:
            self._stall.stop()
        took = time.monotonic() - started
        if took >= _BACKPRESSURE and self._feed is not None and self._feed.stall_timeout:
            # The transport made this send wait: size the next ones to what it drains in
            # a quarter of the stall timeout, so a slow reader's sends stay short and it
            # shows progress as often as with one frame per send (it is never kicked for
            # reading slowly), while a fast one gets up to ``send_batch`` per send.
            # The transport's own buffer is sized by the same rule.
            drained = size / took * self._feed.stall_timeout / 4
            self._coalesce = int(min(self.config.send_batch, drained))
            if self._size_buffer is not None:
                share = self._budget.share(self.config.send_batch)
                # Where the send budget binds, the kernel's buffer follows it too.
                binds = share < self.config.send_batch
                self._size_buffer(int(min(drained, share) if binds else drained))
        elif size >= self._coalesce and self._coalesce < self.config.send_batch:
            # Taken at once: the peer drains fast, the next sends may be larger.
            self._coalesce = min(self.config.send_batch, 2 * self._coalesce)
        self._sent(size, frames)

    def _sent(self, size: int, frames: int) -> None:
        self.bytes_sent += size
        self.frames_sent += frames
        self._largest_send = max(self._largest_send, size)
        self.last_send = time.time()

    async def _kick(self, sink: FrameSink, reason: str, blocked_for: float) -> None:
        self._record(
            "consumer.kicked",
            reason=reason,
            cursor=self.cursor,
            lag_bytes=self.lag_bytes,
            blocked_for=round(blocked_for, 3),
        )
        self._finish("kicked", "kicked")
        error = ConsumerKicked(
            "no progress on this stream; reattach from your cursor",
            pid=self.source.pid,
            cursor=self.cursor,
            blocked_for=round(blocked_for, 3),
            reason=reason,
        )
        await self._try_send(sink, encode_frame(FrameKind.ERROR, error.to_wire()))

    async def _try_send(self, sink: FrameSink, data: bytes) -> None:
        with contextlib.suppress(TimeoutError, OSError):
            await within(sink.send(data), KICK_FRAME_TIMEOUT)

    def _finish(self, state: ConsumerState, reason: str) -> None:
        if self._final_state is not None:
            return
        self._final_lag = (self.lag_bytes, self.source.log.head)
        self._final_state = state
        self.closed_at = time.time()
        self.close_reason = reason
        self.source.log.readers_moved()
        if state == "closed":
            self._record("consumer.detached", reason=reason, cursor=self.cursor)

    def _record(self, kind: str, reason: str | None = None, **data: Any) -> None:
        self.journal.record(
            kind,
            sandbox_id=self.source.sandbox_id,
            pid=self.source.pid,
            reason=reason,
            consumer_id=self.consumer_id,
            name=self.name,
            role=self.role,
            **data,
        )


def _wall(monotonic_ts: float) -> float:
    return time.time() - (time.monotonic() - monotonic_ts)
