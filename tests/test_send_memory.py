"""What a consumer may hold in the daemon's memory (issue 19, point 4): the bytes waiting
in its connection's transport stay within a documented bound however slowly its peer reads,
its sends shrink as consumers multiply, and memory goes back to the system when they leave."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl

from sandboxkit.daemon.app import _AsgiSink
from sandboxkit.daemon.tcp_peer import PENDING_BYTES


class _Protocol(asyncio.Protocol):
    """The server side of a connection, forwarding flow control as uvicorn's protocols do."""

    flow: FlowControl

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.flow = FlowControl(transport)

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()


async def _connection() -> tuple[Any, socket.socket]:
    """A cycle (transport, flow, disconnected) on a real loopback socket, and its peer,
    both with small kernel buffers (a peer that reads slowly fills them at once)."""
    listener = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(listener.getsockname())
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    server, _ = listener.accept()
    listener.close()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
    server.setblocking(False)
    transport, protocol = await asyncio.get_running_loop().connect_accepted_socket(
        _Protocol, server
    )
    return SimpleNamespace(transport=transport, flow=protocol.flow, disconnected=False), peer


async def test_a_slow_peer_never_has_more_than_the_bound_buffered_in_the_daemon() -> None:
    """A 4 MiB send to a peer that reads 16 KiB at a time: the daemon's transport never
    holds more than ``PENDING_BYTES`` for it (the rest waits, unjoined, in the consumer's
    send), and the peer gets every byte in order."""
    cycle, peer = await _connection()
    sink = _AsgiSink(None, cycle)  # type: ignore[arg-type]
    parts: list[bytes | memoryview] = [bytes([65 + i % 26]) * 65536 for i in range(64)]
    size = sum(map(len, parts))
    sending = asyncio.ensure_future(sink.send_parts(parts, size))
    received = bytearray()
    expected = b"%x\r\n" % size + b"".join(parts) + b"\r\n"
    peer.setblocking(False)
    most = 0
    loop = asyncio.get_running_loop()
    try:
        while len(received) < len(expected):
            most = max(most, cycle.transport.get_write_buffer_size())
            received += await loop.sock_recv(peer, 16 * 1024)
        await asyncio.wait_for(sending, 5)
    finally:
        sending.cancel()
        cycle.transport.close()
        peer.close()
    assert received == expected
    assert most <= PENDING_BYTES, most
