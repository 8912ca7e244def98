"""What a consumer sends through: its transport (:class:`FrameSink`, and what a sink may
offer besides) and the send budget all consumers share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from sandboxkit.daemon.file_span import FileSpan

__all__ = [
    "MIN_SHARE",
    "Drain",
    "FrameSink",
    "PeerProbe",
    "SendBudget",
    "SendFile",
    "SendNow",
    "SendParts",
    "SizeBuffer",
]

MIN_SHARE = 64 * 1024
"""The least a consumer's sends may hold (payload bytes), however many consumers share
the send budget: one 64 KiB write of the process's, about, per send."""


class SendBudget:
    """What all consumers' sends may hold at once (``DaemonConfig.send_budget``), shared
    out among the consumers streaming.

    A send holds its chunks until the peer took them: the log's own (shared), or views
    of a mapped segment, but the newest segment is read with a copy, and a chunk the cache
    evicted meanwhile lives on only for the sends that hold it. Up to 1 MiB a consumer,
    that grows with the consumers; within the budget it does not (issue 19)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.consumers = 0
        """Consumers streaming now (between their start and their end)."""

    def share(self, most: int) -> int:
        """Payload bytes one consumer's send (or read of the log) may hold: ``most``, or
        less when more consumers than ``total // most`` stream, never under
        :data:`MIN_SHARE`."""
        return min(most, max(MIN_SHARE, self.total // max(1, self.consumers)))


class FrameSink(Protocol):
    """Where a consumer's frames go: an HTTP response, a socket, a queue in tests."""

    async def send(self, data: bytes) -> None:
        """Hand bytes to the transport; returns once it accepted them (may block)."""

    async def close(self) -> None:
        """End the transport; must not block on a peer that stopped reading."""


PeerProbe = Callable[[], float | None]
"""A sink may also offer ``window_closed_for()``: how long its peer has taken no bytes
while some wait (see :func:`sandboxkit.daemon.tcp_peer.window_closed_for`), or ``None``."""

SizeBuffer = Callable[[int], None]
"""A sink may also offer ``size_send_buffer(nbytes)``: let its transport hold about
``nbytes`` for the peer (what the peer drains in a quarter of the stall timeout)."""

SendParts = Callable[[list[bytes | memoryview], int], Awaitable[None]]
"""A sink may also offer ``send_parts(parts, size)``: send the concatenation of ``parts``
(``size`` bytes), joining them itself with its own framing in one copy."""

SendNow = Callable[[list[bytes | memoryview], int], int | None]
"""A sink may also offer ``send_now(parts, size)``: send as ``send_parts`` would, at once
and without waiting, if it can, and return how many of the bytes its transport holds
(what the kernel did not take); ``None`` (nothing sent) if it cannot now. Such a sink
offers ``drain()`` too (:data:`Drain`)."""

Drain = Callable[[], Awaitable[None]]
"""``drain()``: returns once the transport holds nothing of this stream's (what the
kernel did not take of a ``send_now``)."""

SendFile = Callable[[FileSpan], Awaitable[None]]
"""A sink may also offer ``send_file(span)``: send a span of a segment file as it is
(``os.sendfile``), with only its own framing written from Python."""
