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

__all__ = ["GhostSink"]


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
    async def open(cls, buffer: int = 4096) -> GhostSink:
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
