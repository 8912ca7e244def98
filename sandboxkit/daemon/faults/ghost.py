"""Pause-snapshot ghosts: the fault behind F1, made on purpose.

When a cloud sandbox is paused, the clients of its open streams are disconnected, but a
snapshot restores the daemon's side of those streams on resume: subscribers still
registered, writing into sockets whose peer is gone and whose buffers are nearly full.
:class:`GhostSink` is such a socket: real, with a small buffer, and never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from sandboxkit.daemon.consumers import FrameSink
from sandboxkit.lab_options import GHOST_BUFFER

__all__ = ["GhostSink", "Relay"]


class _FlowControl(asyncio.Protocol):
    def __init__(self) -> None:
        self.writable = asyncio.Event()
        self.writable.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.writable.set()


class GhostSink:
    """A frame sink whose socket has a ``buffer``-byte send buffer and a peer that never
    reads: sends succeed until the buffers fill, then block forever."""

    def __init__(
        self, transport: asyncio.WriteTransport, flow: _FlowControl, peer: socket.socket
    ) -> None:
        self._transport = transport
        self._flow = flow
        self._peer = peer

    @classmethod
    async def open(cls, buffer: int = GHOST_BUFFER) -> GhostSink:
        """A fresh ghost socket pair (the unread end is held by the sink)."""
        ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for sock in (ours, peer):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        ours.setblocking(False)
        flow = _FlowControl()
        transport, _ = await asyncio.get_running_loop().create_unix_connection(
            lambda: flow, sock=ours
        )
        # No user-space slack either: once the socket is full, the next send blocks.
        transport.set_write_buffer_limits(high=0)
        return cls(transport, flow, peer)

    async def send(self, data: bytes) -> None:
        """Write; blocks while the (never drained) buffers are full."""
        await self._flow.writable.wait()
        self._transport.write(data)

    async def close(self) -> None:
        """Drop both ends."""
        self._transport.abort()
        with contextlib.suppress(OSError):
            self._peer.close()


class Relay:
    """A consumer's transport that a snapshot restore can swap for a ghost: the consumer
    sends into the relay, which sends into ``target``."""

    def __init__(self, target: FrameSink) -> None:
        self.target = target

    async def send(self, data: bytes) -> None:
        await self.target.send(data)

    async def close(self) -> None:
        await self.target.close()

    def window_closed_for(self) -> float | None:
        probe = getattr(self.target, "window_closed_for", None)
        if probe is None:
            return None
        closed: float | None = probe()
        return closed
