"""Consumers: a cursor into one process's output log plus a transport, each with its own
sender task, so that no consumer ever waits for another and the producer waits for none."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any, Literal, Protocol

from sandboxkit._compat import within
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.events import EventJournal
from sandboxkit.daemon.fanout import Fanout, Feed
from sandboxkit.daemon.output_log import Chunk, OutputLog
from sandboxkit.errors import ConsumerKicked, SandboxkitError
from sandboxkit.wire import FrameKind, encode_frame

__all__ = ["BLOCKED_AFTER", "Consumer", "ConsumerState", "FrameSink", "StreamSource"]

ConsumerState = Literal["streaming", "blocked", "kicked", "closed"]

BLOCKED_AFTER = 0.2
"""A send that has not completed after this many seconds shows the consumer as blocked."""

KICK_FRAME_TIMEOUT = 0.1
"""How long a kicked consumer's transport gets to accept the ``kicked`` error frame."""

_COALESCE_BYTES = 64 * 1024

_ids = itertools.count(1)


class FrameSink(Protocol):
    """Where a consumer's frames go: an HTTP response, a socket, a queue in tests."""

    async def send(self, data: bytes) -> None:
        """Hand bytes to the transport; returns once it accepted them (may block)."""

    async def close(self) -> None:
        """End the transport; must not block on a peer that stopped reading."""


class _Relay:
    """The consumer's current sink; a pause snapshot can swap it for a ghost socket."""

    def __init__(self, target: FrameSink) -> None:
        self.target = target

    async def send(self, data: bytes) -> None:
        await self.target.send(data)

    async def close(self) -> None:
        await self.target.close()


class StreamSource(Protocol):
    """What a consumer reads: a process's log and its current state."""

    pid: int
    sandbox_id: str
    log: OutputLog
    fanout: Fanout

    def states(self) -> dict[str, Any]:
        """``{"process_state": ..., "sandbox_state": ...}`` for keepalive frames."""


class _Kicked(Exception):
    def __init__(self, blocked_for: float) -> None:
        self.blocked_for = blocked_for


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
    ) -> None:
        self.consumer_id = f"c{next(_ids)}"
        self.name = name or self.consumer_id
        self.peer = peer
        self.source = source
        self.cursor = source.log.first_seq if cursor is None else cursor
        self.config = config
        self.journal = journal
        self.bytes_sent = 0
        self.frames_sent = 0
        self.attached_at = time.time()
        self.last_send: float | None = None
        self.closed_at: float | None = None
        self.close_reason: str | None = None
        self._sending_since: float | None = None
        self._final_state: ConsumerState | None = None
        self._task: asyncio.Task[Any] | None = None
        self._feed: Feed | None = None
        self._relay: _Relay | None = None
        self._kick_request: tuple[str, float] | None = None
        self.ghost = False
        """True once a pause snapshot turned this consumer into a ghost."""

    # -- metrics ---------------------------------------------------------------------

    @property
    def state(self) -> ConsumerState:
        """``streaming``, ``blocked`` (a send is stuck), ``kicked`` or ``closed``."""
        if self._final_state is not None:
            return self._final_state
        return "blocked" if self.blocked_since is not None else "streaming"

    @property
    def blocked_since(self) -> float | None:
        """Wall-clock time the current stuck send started, if it is stuck."""
        since = self._sending_since
        if since is None or self._final_state is not None:
            return None
        return since if time.monotonic() - since >= BLOCKED_AFTER else None

    @property
    def lag_bytes(self) -> int:
        """Bytes the process wrote that this consumer's transport has not accepted yet."""
        log = self.source.log
        return log.total_bytes - log.offset_of(self.cursor)

    def metrics(self) -> dict[str, Any]:
        """A JSON-ready snapshot of this consumer."""
        blocked = self.blocked_since
        return {
            "consumer_id": self.consumer_id,
            "name": self.name,
            "sandbox_id": self.source.sandbox_id,
            "pid": self.source.pid,
            "peer": self.peer,
            "ghost": self.ghost,
            "cursor": self.cursor,
            "head": self.source.log.head,
            "lag_bytes": self.lag_bytes,
            "bytes_sent": self.bytes_sent,
            "frames_sent": self.frames_sent,
            "state": self.state,
            "blocked_since": None if blocked is None else _wall(blocked),
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
        self._relay = relay = _Relay(sink)
        self._feed = feed = self.source.fanout.attach(self)
        self._record("consumer.attached", cursor=self.cursor)
        reason = "end"
        try:
            await self._stream(relay, feed)
        except _Kicked as kicked:
            reason = "kicked"
            await self._kick(relay, "stalled", kicked.blocked_for)
        except asyncio.CancelledError:
            if self._kick_request is None:
                reason = "detached"
                raise
            reason = "kicked"
            _uncancel()
            await self._kick(relay, *self._kick_request)
        except SandboxkitError as exc:
            reason = exc.code
            await self._try_send(relay, encode_frame(FrameKind.ERROR, exc.to_wire()))
        finally:
            feed.close()
            self._finish("kicked" if reason == "kicked" else "closed", reason)
            await relay.close()

    def kick(self, reason: str, blocked_for: float) -> None:
        """Kick from outside the consumer's task (a fan-out policy's shared loop)."""
        if self._final_state is None and self._kick_request is None and self._task:
            self._kick_request = (reason, blocked_for)
            self._task.cancel()

    def become_ghost(self, ghost: FrameSink) -> FrameSink | None:
        """Keep streaming into ``ghost`` instead of the current transport, which is
        returned for the caller to close (a pause snapshot's stale stream, F1)."""
        if self._relay is None or self._final_state is not None or self.ghost:
            return None
        old, self._relay.target = self._relay.target, ghost
        self.ghost = True
        self._record("consumer.ghosted", cursor=self.cursor)
        return old

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
                    "head": log.head,
                    "first_seq": log.first_seq,
                    "keepalive_interval": self.config.keepalive_interval,
                    "stall_timeout": feed.stall_timeout,
                    "fanout": self.source.fanout.name,
                    **self.source.states(),
                },
            ),
        )
        batch_limit = self.config.send_batch
        keepalive = self.config.keepalive_interval
        while True:
            pulled = await feed.pull(self.cursor, batch_limit, keepalive)
            gap = pulled.gap
            if gap is not None:
                self._record(
                    "consumer.gap",
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
                        },
                    ),
                )
                self.cursor = gap.first_available
            if pulled.chunks:
                await self._send_chunks(sink, pulled.chunks)
            if pulled.ended:
                await self._send(
                    sink,
                    encode_frame(
                        FrameKind.END,
                        {
                            "exit_code": log.exit_code,
                            "cursor": self.cursor,
                            "ended_at": log.ended_at,
                        },
                    ),
                )
                return
            if gap is None and not pulled.chunks:
                await self._send(
                    sink,
                    encode_frame(
                        FrameKind.KEEPALIVE,
                        {"cursor": self.cursor, "head": log.head, **self.source.states()},
                    ),
                )

    async def _send_chunks(self, sink: FrameSink, chunks: list[Chunk]) -> None:
        # Small frames are coalesced into one send; big ones go out as they are, since
        # copying them into a joined buffer would cost more than the extra send.
        batch: list[Chunk] = []
        size = 0
        for chunk in chunks:
            if batch and size + len(chunk.frame) > _COALESCE_BYTES:
                await self._send_batch(sink, batch)
                batch, size = [], 0
            batch.append(chunk)
            size += len(chunk.frame)
        if batch:
            await self._send_batch(sink, batch)

    async def _send_batch(self, sink: FrameSink, batch: list[Chunk]) -> None:
        data = batch[0].frame if len(batch) == 1 else b"".join(c.frame for c in batch)
        await self._send(sink, data, frames=len(batch))
        self.cursor = batch[-1].seq + 1

    async def _send(self, sink: FrameSink, data: bytes, frames: int = 1) -> None:
        started = time.monotonic()
        self._sending_since = started
        try:
            await within(sink.send(data), self._feed.stall_timeout if self._feed else None)
        except TimeoutError:
            raise _Kicked(time.monotonic() - started) from None
        finally:
            self._sending_since = None
        self.bytes_sent += len(data)
        self.frames_sent += frames
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
        self._final_state = state
        self.closed_at = time.time()
        self.close_reason = reason
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
            **data,
        )


def _uncancel() -> None:
    # The kick cancelled this task on purpose; the task goes on to close cleanly.
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


def _wall(monotonic_ts: float) -> float:
    return time.time() - (time.monotonic() - monotonic_ts)
