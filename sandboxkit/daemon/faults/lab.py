"""One sandbox's fault lab: its fan-out policy and its pause-snapshot ghosts.

A sandbox created with :class:`~sandboxkit.lab_options.LabOptions` owns a :class:`FaultLab`;
the sandbox, the host and the consumers ask it at four points (a process's fan-out, a
stream's transport, pause, resume) and otherwise know nothing of the lab.
"""

from __future__ import annotations

import msgspec

from sandboxkit.daemon.config import LabDefaults
from sandboxkit.daemon.consumers import Consumer, FrameSink
from sandboxkit.daemon.events import EventJournal
from sandboxkit.daemon.fanout import CursorFanout, Fanout
from sandboxkit.daemon.faults.fanout import BlockingFanout, KickFanout
from sandboxkit.daemon.faults.ghost import GhostSink, Relay
from sandboxkit.daemon.output_log import OutputLog
from sandboxkit.errors import InvalidArgument
from sandboxkit.lab_options import GHOST_BUFFER, LabOptions

__all__ = ["FaultLab"]


class FaultLab:
    """The lab's machinery for one sandbox, configured by one :class:`LabOptions`."""

    def __init__(
        self, sandbox_id: str, options: LabOptions, defaults: LabDefaults, journal: EventJournal
    ) -> None:
        try:  # the HTTP schema validated these already; a direct caller gets the same rules
            msgspec.convert(msgspec.to_builtins(options), LabOptions)
        except msgspec.ValidationError as exc:
            raise InvalidArgument(f"lab: {exc}", field="lab") from None
        queue = defaults.kick_queue if options.fanout == "kick" else defaults.blocking_queue
        self.options = msgspec.structs.replace(
            options,
            kick_grace=defaults.kick_grace if options.kick_grace is None else options.kick_grace,
            queue=queue if options.queue is None else options.queue,
            ghost_buffer=options.ghost_buffer or defaults.ghost_buffer,
        )
        """The options in force: every field set."""
        self.sandbox_id = sandbox_id
        self.journal = journal
        self._relays: dict[str, tuple[Consumer, Relay]] = {}
        self._ghosts: set[str] = set()
        self._snapshot: list[tuple[Consumer, Relay]] = []

    # -- fan-out ----------------------------------------------------------------------

    def fanout(self, log: OutputLog, stall_timeout: float) -> Fanout:
        """The fan-out policy for one process's log."""
        options = self.options
        queue = options.queue or 1
        if options.fanout == "blocking":
            return BlockingFanout(log, queue)
        if options.fanout == "kick":
            return KickFanout(log, queue, options.kick_grace or 0.0)
        return CursorFanout(log, stall_timeout)

    # -- ghosts -----------------------------------------------------------------------

    def transport(self, consumer: Consumer, sink: FrameSink) -> FrameSink:
        """The transport ``consumer`` streams into: ``sink``, behind a relay a snapshot
        restore can swap when ``pause_ghosts`` is on."""
        if not self.options.pause_ghosts:
            return sink
        relay = Relay(sink)
        self._forget_closed()
        self._relays[consumer.consumer_id] = (consumer, relay)
        return relay

    def is_ghost(self, consumer: Consumer) -> bool:
        """True once a snapshot restore turned ``consumer`` into a ghost."""
        return consumer.consumer_id in self._ghosts

    def snapshot(self) -> None:
        """At pause: remember the streams open now (a snapshot would capture them)."""
        self._forget_closed()
        self._snapshot = [
            (c, r) for c, r in self._relays.values() if c.consumer_id not in self._ghosts
        ]

    async def restore(self) -> None:
        """At resume, what a snapshot restore does to the streams open at pause: their
        clients are disconnected, their daemon-side consumers live on as ghosts, writing
        into sockets whose peer never reads (:class:`GhostSink`)."""
        snapshot, self._snapshot = self._snapshot, []
        for consumer, relay in snapshot:
            if consumer.closed_at is not None:
                continue
            ghost = await GhostSink.open(self.options.ghost_buffer or GHOST_BUFFER)
            old, relay.target = relay.target, ghost
            self._ghosts.add(consumer.consumer_id)
            self.journal.record(
                "consumer.ghosted",
                sandbox_id=self.sandbox_id,
                pid=consumer.source.pid,
                consumer_id=consumer.consumer_id,
                name=consumer.name,
                role=consumer.role,
                cursor=consumer.cursor,
            )
            await old.close()

    def _forget_closed(self) -> None:
        for cid, (consumer, _) in list(self._relays.items()):
            if consumer.closed_at is not None:
                del self._relays[cid]

    def to_json(self) -> dict[str, object]:
        """The options in force, JSON-ready."""
        return msgspec.structs.asdict(self.options)
