"""What a consumer may hold in the daemon's memory (issue 19, point 4): the bytes waiting
in its connection's transport stay within a documented bound however slowly its peer reads,
its sends shrink as consumers multiply, and memory goes back to the system when they leave."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import sys
import time
import weakref
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.flow_control import FlowControl

from sandboxkit.daemon import heap
from sandboxkit.daemon.consumers import MIN_SHARE
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.http.fast_path import AsgiSink
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.server import DaemonServer
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
    sink = AsgiSink(None, cycle)  # type: ignore[arg-type]
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


class _Sink:
    """Takes every send at once."""

    async def send(self, data: bytes) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_consumers_that_leave_have_the_heap_trimmed(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What consumers held (their sends, their connections' buffers) is freed when they
    leave, but glibc keeps the pages: their leaving asks for a full collection and a
    trim (rate-limited by sandboxkit.daemon.heap), without any log being dropped."""
    trims: list[int] = []
    collections: list[int] = []
    monkeypatch.setattr(heap, "_trim", lambda pad: trims.append(pad) or 1)
    monkeypatch.setattr(heap, "gc", SimpleNamespace(collect=lambda: collections.append(1)))
    monkeypatch.setattr(heap, "_last", -heap.MIN_INTERVAL)
    monkeypatch.setattr(heap, "_collected", -heap.COLLECT_INTERVAL)
    monkeypatch.setattr(heap, "_owed", 0)
    monkeypatch.setattr(heap, "_later", None)
    sbx = await host.create_sandbox()
    write = "import sys; sys.stdout.buffer.write(b'x' * 262144)"
    process = await sbx.start_process(ProcessSpec(argv=(sys.executable, "-c", write)))
    await process.wait()
    for _ in range(16):
        await host.start_stream(host.open_consumer(process, 0), _Sink())
    deadline = time.monotonic() + 5
    while not trims:
        assert time.monotonic() < deadline, "no trim after 16 consumers left"
        await asyncio.sleep(0.02)  # sleep-ok: polling with a deadline
    assert process.log.memory_bytes > 0  # its log kept its cache: no log was dropped
    # Connections are reference cycles that lived long: collected before the trim.
    assert collections


def test_full_collections_before_a_trim_are_rare_however_often_consumers_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full collection stops the loop for as long as the heap is large: consumers that
    come and go every second (a chaos test's, a reconnecting client's) get a trim every
    second but a collection once per COLLECT_INTERVAL."""
    clock = [1000.0]
    collections: list[int] = []
    monkeypatch.setattr(heap.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(heap, "_trim", lambda pad: 1)
    monkeypatch.setattr(heap, "gc", SimpleNamespace(collect=lambda: collections.append(1)))
    monkeypatch.setattr(heap, "_last", -heap.MIN_INTERVAL)
    monkeypatch.setattr(heap, "_collected", -heap.COLLECT_INTERVAL)
    monkeypatch.setattr(heap, "_owed", 0)
    monkeypatch.setattr(heap, "_later", None)
    trims = 0
    for _ in range(20):  # 20 s of consumers leaving every second
        heap.released_soon(heap.THRESHOLD)
        clock[0] += heap.MIN_INTERVAL
        trims += heap.released(0)
    assert trims == 20
    assert len(collections) == 1


@pytest.mark.slow
def test_slow_readers_of_the_daemon_never_have_more_than_the_bound_in_its_transports(
    daemon: DaemonServer,
) -> None:
    """Through the daemon (asyncio, as a plain install serves): four readers taking 16 KiB
    every 20 ms of a process that wrote 4 MiB at once. However their sends are sized, no
    connection of theirs holds more than ``PENDING_BYTES`` in the daemon's transport while
    they read (for a second)."""
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        write = "import sys; sys.stdout.buffer.write(b'x' * 4194304)"
        argv = [sys.executable, "-c", write]
        pid = http.post(f"/sandboxes/{sid}/processes", json={"argv": argv}).json()["pid"]
        host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
        readers = []
        for _ in range(4):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
            sock.connect((host, int(port)))
            sock.sendall(
                f"GET /sandboxes/{sid}/processes/{pid}/stream?cursor=0 HTTP/1.1\r\n"
                f"Host: x\r\nAuthorization: Bearer {daemon.token}\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            sock.setblocking(False)
            readers.append(sock)
        connections = daemon._server.server_state.connections
        received = [0] * len(readers)
        most = 0
        until = time.monotonic() + 1
        try:
            while time.monotonic() < until:
                most = max([most, *(c.transport.get_write_buffer_size() for c in connections)])
                for i, sock in enumerate(readers):
                    with contextlib.suppress(BlockingIOError):
                        received[i] += len(sock.recv(16 * 1024))
                time.sleep(0.02)  # sleep-ok: the readers' slow pace
        finally:
            for sock in readers:
                sock.close()
        http.delete(f"/sandboxes/{sid}")
    assert all(n > 256 * 1024 for n in received), received
    assert most <= PENDING_BYTES, most


class _RecordingSink(_Sink):
    """Takes each send after a pause (a peer that drains), recording its size beside the
    share of the send budget each consumer had then."""

    def __init__(self, host: Host, sends: list[tuple[int, int]]) -> None:
        self.host = host
        self.sends = sends

    async def send(self, data: bytes) -> None:
        share = self.host.send_budget.share(self.host.config.send_batch)
        self.sends.append((len(data), share))
        await asyncio.sleep(0.001)  # sleep-ok: the transport's drain, letting others run


async def test_sends_shrink_as_consumers_multiply_within_the_send_budget(host: Host) -> None:
    """All consumers' sends together stay within ``send_budget``: each send is at most
    the budget divided by the consumers streaming (64 KiB at least), plus its frames'
    headers. With 8 consumers and a budget of 512 KiB, that is 64 KiB, not 128 KiB."""
    host.config.read_chunk = 16 * 1024
    host.send_budget.total = 512 * 1024  # config.send_budget, for this host
    sbx = await host.create_sandbox()
    write = "import sys; sys.stdout.buffer.write(b'x' * 2097152)"
    process = await sbx.start_process(ProcessSpec(argv=(sys.executable, "-c", write)))
    await process.wait()
    sends: list[tuple[int, int]] = []
    streams = [
        host.start_stream(host.open_consumer(process, 0), _RecordingSink(host, sends))
        for _ in range(8)
    ]
    await asyncio.gather(*streams)
    assert sum(size for size, _ in sends) > 8 * 2097152
    headers = 1024  # a frame's header is under 100 bytes; a 64 KiB send has 4 frames
    assert all(size <= share + headers for size, share in sends), sends
    assert max(size for size, share in sends if share == MIN_SHARE) <= MIN_SHARE + headers


class _TcpSink(_Sink):
    """A sink offering what a TCP connection's sink offers (see consumers.FrameSink)."""

    def window_closed_for(self) -> float | None:
        return None

    def size_send_buffer(self, nbytes: int) -> None:
        pass


async def test_consumers_that_left_keep_neither_their_connections_nor_more_than_64_rows(
    host: Host,
) -> None:
    """A consumer that left stays in the metrics for a while, but holds nothing of its
    connection (its sink, and through it the server's request, buffers and transport);
    and no more than 64 that left are kept per process, even when they all leave at
    once (400 rows, each holding its connection, after 400 consumers left together)."""
    sbx = await host.create_sandbox()
    write = "import sys; sys.stdout.buffer.write(b'x' * 65536)"
    process = await sbx.start_process(ProcessSpec(argv=(sys.executable, "-c", write)))
    await process.wait()
    sinks = [_TcpSink() for _ in range(70)]
    refs = [weakref.ref(sink) for sink in sinks]
    consumers = [host.open_consumer(process, 0) for _ in sinks]
    await asyncio.gather(*(host.start_stream(c, s) for c, s in zip(consumers, sinks, strict=True)))
    del sinks
    gc.collect()
    assert all(c.state == "closed" for c in consumers)
    assert all(ref() is None for ref in refs), "a consumer that left still holds its sink"
    assert len(process.consumers) <= 64, len(process.consumers)
