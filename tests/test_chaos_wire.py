"""Chaos below the SDK: what the daemon guarantees to any HTTP client, with faults on the
wire.

1. **Replay over raw sockets.** A seeded producer (the one of ``test_chaos_sdk``) is read
   by a chain of plain-socket consumers speaking HTTP/1.1 by hand (h11). Each connection
   ends at a random point — a FIN, an RST, or a request cut before its end — unless the
   stream ended first, and the next
   one asks for the stream from the cursor after the last ``data`` frame received, while
   the sandbox is paused and resumed at random. The bytes received, joined, are exactly
   what the producer wrote (sha256), on stdout and stderr alike.
2. **Stdin through a chaos proxy.** A stdin session talks to the daemon through a small TCP
   proxy that drops requests before they reach the daemon, drops replies after it acted,
   and restarts (every connection cut at once). ``cat`` echoes every batch exactly once,
   in order.

For a long run set ``SANDBOXKIT_CHAOS_MB`` (MiB of producer output) and
``SANDBOXKIT_CHAOS_BATCHES`` (stdin batches), e.g.::

    SANDBOXKIT_CHAOS_MB=50 SANDBOXKIT_CHAOS_BATCHES=5000 pytest tests/test_chaos_wire.py -s
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import random
import socket
import struct
import sys
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11
import pytest
from support import fast_config
from test_chaos_sdk import PRODUCER, _expected

from sandboxkit import AsyncSandbox
from sandboxkit.client.api import ApiClient
from sandboxkit.client.stdin import HttpStdinTransport, StdinSession
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.wire import FrameDecoder, FrameKind

_LONG_MB = float(os.environ.get("SANDBOXKIT_CHAOS_MB", "0"))
_BATCHES = int(os.environ.get("SANDBOXKIT_CHAOS_BATCHES", "0"))


@pytest.fixture
def daemon_config() -> DaemonConfig:
    # Retention that holds the whole output: a gap here would be a lost byte.
    return fast_config(retention_bytes=max(64, 2 * int(_LONG_MB)) * 1024 * 1024)


# -- 1. replay over raw sockets -------------------------------------------------------------


@dataclass
class Reader:
    """What the chain of raw consumers received, and where the next one starts."""

    cursor: int = 0
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    ended: bool = False
    gaps: int = 0
    connections: int = 0
    stuck_closes: int = 0
    """Connections whose close this client could not complete (see _one_connection)."""
    fruitless: int = 0
    """Connections in a row that ended before a whole data frame: a chunk larger than
    every budget (the daemon reads what the pipe holds, up to 256 KiB, when it lags)
    would otherwise be cut inside forever, so after 3 the next one reads one whole."""
    cut: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(["fin", "rst", "half-request"], 0)
    )


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a reset instead of a FIN (linger on, timeout zero)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _one_connection(
    conn: dict[str, str], path: str, reader: Reader, rng: random.Random
) -> None:
    """One consumer: ask for the stream from ``reader.cursor``; end the connection the way
    ``rng`` picks; record every data frame it got whole."""
    url = urlsplit(conn["url"])
    stream_r, stream_w = await asyncio.open_connection(url.hostname, url.port)
    reader.connections += 1
    client = h11.Connection(h11.CLIENT)
    request = client.send(
        h11.Request(
            method="GET",
            target=f"{path}?cursor={reader.cursor}",
            headers=[("Host", url.netloc), ("Authorization", f"Bearer {conn['token']}")],
        )
    )
    mode = rng.choices(["fin", "rst", "half-request"], [4, 4, 2])[0]
    reader.cut[mode] += 1
    try:
        if mode == "half-request":  # the request itself is cut: the daemon sees a stub
            stream_w.write(request[: rng.randint(1, len(request) - 1)])
            await stream_w.drain()
            (_rst if rng.random() < 0.5 else lambda w: w.close())(stream_w)
            return
        stream_w.write(request)
        budget = rng.randint(1, 40_000)  # bytes of response before the cut
        decoder = FrameDecoder()
        got, start = 0, reader.cursor
        while got < budget or (reader.fruitless >= 3 and reader.cursor == start):
            event = client.next_event()
            if event is h11.NEED_DATA:
                try:  # a paused producer sends only keepalives: cut there too
                    data = await asyncio.wait_for(stream_r.read(65536), 0.3)
                except TimeoutError:
                    break
                client.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                assert event.status_code == 200, event
            elif isinstance(event, h11.Data):
                got += len(event.data)
                for frame in decoder.feed(event.data):
                    if frame.kind == FrameKind.DATA:
                        target = (
                            reader.stdout if frame.meta["stream"] == "stdout" else reader.stderr
                        )
                        target += frame.payload
                        reader.cursor = frame.meta["seq"] + 1
                    elif frame.kind == FrameKind.GAP:
                        reader.gaps += 1
                    elif frame.kind == FrameKind.END:
                        reader.ended = True
                        return
                    elif frame.kind == FrameKind.ERROR:
                        raise frame.error()
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return
        reader.fruitless = reader.fruitless + 1 if reader.cursor == start else 0
        (_rst if mode == "rst" else lambda w: w.close())(stream_w)
    finally:
        stream_w.close()
        # Bounded: what this checks is the replay, not our own socket's teardown; a close
        # that never completes is counted (and reported) instead of hanging the test.
        try:
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(stream_w.wait_closed(), 5)
        except TimeoutError:
            reader.stuck_closes += 1
            stream_w.transport.abort()


async def _raw_replay(conn: dict[str, str], seed: int, size: int, seconds: float) -> Reader:
    rng = random.Random(seed)
    _, _, writes = _expected(seed, size)
    pace = min(1.0, seconds / 0.0025 / writes)
    reader = Reader()
    pauses = 0
    paused = False
    async with await AsyncSandbox.create(**conn) as sbx:
        info = await sbx.commands.start(
            [sys.executable, "-c", f"{PRODUCER}\nmain({seed}, {size}, {pace})"]
        )
        path = f"/sandboxes/{sbx.sandbox_id}/processes/{info.pid}/stream"
        while not reader.ended:
            await _one_connection(conn, path, reader, rng)
            if paused:
                await sbx.resume()
                paused = False
            elif rng.random() < 0.2:  # the next consumer replays from a paused sandbox
                await sbx.pause()
                pauses += 1
                paused = True
        if paused:
            await sbx.resume()
    print(
        f"\nraw chaos seed={seed}: {len(reader.stdout)} stdout + {len(reader.stderr)} stderr "
        f"bytes over {reader.connections} connections {reader.cut}, {pauses} pauses, "
        f"{reader.gaps} gaps, {reader.stuck_closes} closes that did not complete"
    )
    return reader


@pytest.mark.timeout(120 if not _LONG_MB else 3600)
@pytest.mark.slow
@pytest.mark.parametrize("seed", [5, 17])
async def test_raw_consumers_cut_at_random_replay_byte_exact(
    conn: dict[str, str], seed: int
) -> None:
    size = int(_LONG_MB * 1024 * 1024) if _LONG_MB else 512 * 1024
    stdout, stderr, _ = _expected(seed, size)
    reader = await _raw_replay(conn, seed, size, seconds=60.0 if _LONG_MB else 1.0)
    assert reader.gaps == 0
    assert hashlib.sha256(reader.stdout).digest() == hashlib.sha256(stdout).digest()
    assert bytes(reader.stderr) == stderr
    assert reader.connections >= 10
    assert min(reader.cut.values()) > 0  # every kind of cut happened


# -- 2. stdin through a chaos proxy ----------------------------------------------------------


class ChaosProxy:
    """A TCP proxy on loopback in front of the daemon. Each request (each read from the
    client), at random: passes through; is lost before it reaches the daemon (the
    connection is dropped); or reaches the daemon, whose reply is lost (dropped before the
    client gets it). :meth:`restart` cuts every connection and listens anew on the same
    port."""

    def __init__(self, upstream: str, rng: random.Random, fault_rate: float) -> None:
        url = urlsplit(upstream)
        self.upstream = (url.hostname or "127.0.0.1", url.port or 80)
        self.rng = rng
        self.fault_rate = fault_rate
        self.port = 0
        self.faults = {"lost request": 0, "lost reply": 0, "restarts": 0}
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._served: set[asyncio.Future[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen: on a free port the first time, on the same one after a restart."""
        # The old listener's close may complete on a later turn of the loop (uvloop
        # closes its handles there): until it has, listening again fails with EADDRINUSE.
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            try:
                self._server = await asyncio.start_server(
                    self._serve, "127.0.0.1", self.port, reuse_address=True
                )
                break
            except OSError as exc:
                if not self.port or exc.errno != errno.EADDRINUSE:
                    raise
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.01)  # sleep-ok: poll interval, bounded above
        self.port = self._server.sockets[0].getsockname()[1]

    async def restart(self) -> None:
        await self.close()
        self.faults["restarts"] += 1
        await self.start()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # every pump sees its connection end
        await asyncio.gather(*self._served, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        served = asyncio.get_running_loop().create_future()
        self._served.add(served)
        self._writers.add(client_w)
        up_w = None
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            self._writers.add(up_w)
            lose_reply = asyncio.Event()
            pumps = [
                asyncio.ensure_future(self._requests(client_r, up_w, lose_reply)),
                asyncio.ensure_future(self._replies(up_r, client_w, lose_reply)),
            ]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        except ConnectionError:
            pass
        finally:
            for writer in (client_w, up_w):
                if writer is not None:
                    writer.transport.abort()
                    self._writers.discard(writer)
            served.set_result(None)
            self._served.discard(served)

    async def _requests(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, lose_reply: asyncio.Event
    ) -> None:
        while data := await src.read(65536):
            if self.rng.random() < self.fault_rate:
                if self.rng.random() < 0.5:
                    self.faults["lost request"] += 1
                    return  # never reaches the daemon
                lose_reply.set()  # the daemon acts on it; its answer is lost
            dst.write(data)
            await dst.drain()

    async def _replies(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, lose_reply: asyncio.Event
    ) -> None:
        while data := await src.read(65536):
            if lose_reply.is_set():
                self.faults["lost reply"] += 1
                return
            dst.write(data)
            await dst.drain()


@pytest.mark.timeout(120 if not _BATCHES else 3600)
async def test_stdin_through_a_chaos_proxy_is_exactly_once(conn: dict[str, str]) -> None:
    rng = random.Random(7)
    count = _BATCHES or 150
    batches = [f"<{i}:{'x' * rng.randint(0, 200)}>\n" for i in range(count)]
    proxy = ChaosProxy(conn["url"], rng, fault_rate=0.3)
    await proxy.start()
    api = ApiClient(proxy.url, conn["token"])
    try:
        async with await AsyncSandbox.create(**conn) as sbx:
            handle = await sbx.commands.run("cat", background=True)
            session = StdinSession(
                HttpStdinTransport(api, sbx.sandbox_id, handle.pid),
                max_unacked_bytes=2000,
                retries=50,
                backoff=0.001,
            )
            for batch in batches:
                await session.write(batch)
                if rng.random() < 0.03:
                    await proxy.restart()
            await asyncio.wait_for(session.close(), 30)
            await sbx.commands.close_stdin(handle.pid)
            result = await asyncio.wait_for(handle.wait(), 30)
    finally:
        await api.aclose()
        await proxy.close()
    print(f"\nstdin chaos: {count} batches, {proxy.faults}")
    assert result.stdout == "".join(batches)
    assert proxy.faults["lost request"] > 0 and proxy.faults["lost reply"] > 0
    assert proxy.faults["restarts"] > 0
