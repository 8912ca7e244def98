"""Pause-snapshot ghosts: the fault behind F1, made on purpose.

When a cloud sandbox is paused, the clients of its open streams are disconnected, but a
snapshot restores the daemon's side of those streams on resume: subscribers still
registered, writing into sockets whose peer is gone and whose buffers are (nearly) full.
:class:`GhostSink` is such a socket: real, with a small buffer, full, and never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from sandboxkit.daemon.consumers import FrameSink
from sandboxkit.lab_options import GHOST_BUFFER

__all__ = ["GhostSink", "Relay"]


class GhostSink:
    """A frame sink whose socket has a ``buffer``-byte send buffer, full from the start,
    and a peer that never reads: every send blocks forever."""

    def __init__(self, sock: socket.socket, peer: socket.socket) -> None:
        self._sock = sock
        self._peer = peer

    @classmethod
    async def open(cls, buffer: int = GHOST_BUFFER) -> GhostSink:
        """A fresh ghost socket pair (the unread end is held by the sink), its buffers
        filled as a restored snapshot's are: what a ghost takes never depends on how the
        output after the restore happens to be chunked."""
        ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for sock in (ours, peer):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        ours.setblocking(False)
        filler = bytes(buffer)
        with contextlib.suppress(BlockingIOError):
            while ours.send(filler):
                pass
        return cls(ours, peer)

    async def send(self, data: bytes) -> None:
        """Write what the socket takes (nothing, once full), then wait for it to take the
        rest: forever, as nothing reads. No transport holds the rest for it, so a send
        never completes by being buffered in user space."""
        await asyncio.get_running_loop().sock_sendall(self._sock, data)

    async def close(self) -> None:
        """Drop both ends."""
        for sock in (self._sock, self._peer):
            with contextlib.suppress(OSError):
                sock.close()


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
