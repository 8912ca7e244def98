"""A command is one request on a kept-alive connection: ``run`` starts the process and
reads its output in one ``POST …/processes/stream`` (its pid in the start frame), and a
stream's connection goes back to the pool when its response ended whole — closed when it
did not, or when the end of its body never came."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest
from support import poll

from sandboxkit import AsyncSandbox
from sandboxkit.client.api import ApiClient
from sandboxkit.client.options import follow_options
from sandboxkit.client.start_stream import start_stream
from sandboxkit.client.transport import RawTransport
from sandboxkit.client.transport.raw_stream import open_raw_stream
from sandboxkit.client.transport.raw_unary import RawPool
from sandboxkit.daemon.http.router import DaemonApp
from sandboxkit.errors import DaemonUnavailable, InvalidArgument
from sandboxkit.wire import FrameKind, encode_frame

WAIT = 10.0


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every HTTP request the in-process daemon serves, as (method, path)."""
    seen: list[tuple[str, str]] = []
    original = DaemonApp.__call__

    async def counting(self: DaemonApp, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append((scope["method"], scope["path"]))
        await original(self, scope, receive, send)

    monkeypatch.setattr(DaemonApp, "__call__", counting)
    return seen


async def test_a_foreground_run_is_one_request(
    conn: dict[str, str], served: list[tuple[str, str]]
) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        served.clear()
        result = await sbx.commands.run(["sh", "-c", "echo out; echo err >&2; exit 0"])
        assert (result.stdout, result.stderr) == ("out\n", "err\n")
        assert served == [("POST", f"/sandboxes/{sbx.sandbox_id}/processes/stream")]
        # The pid the start frame named is the process's, as a plain start's would be.
        assert (await sbx.commands.get(result.pid)).pid == result.pid
        handle = await sbx.commands.run(["sleep", "30"], background=True)
        assert (await sbx.commands.get(handle.pid)).pid == handle.pid
        await handle.kill()


async def test_a_bad_start_is_its_typed_error_before_any_handle(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        with pytest.raises(InvalidArgument, match="cwd"):
            await sbx.commands.run(["true"], cwd="no/such/directory")
        assert await sbx.commands.list() == []  # nothing started


def _time_wait(port: int) -> int:
    """TCP connections to ``port`` closed and waiting out TIME_WAIT (connection churn)."""
    return sum(
        1
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_TIME_WAIT and port in (c.laddr.port, c.raddr and c.raddr.port)
    )


async def test_streams_reuse_the_kept_alive_connections(conn: dict[str, str]) -> None:
    port = urlsplit(conn["url"]).port
    assert port is not None
    async with await AsyncSandbox.create(**conn) as sbx:
        transport = sbx.backend.api.transport
        assert isinstance(transport, RawTransport)
        await sbx.commands.run(["true"])
        before = _time_wait(port)
        for i in range(12):
            assert (await sbx.commands.run(["echo", str(i)])).stdout == f"{i}\n"
        # No connection was opened and closed per command: they went back to the pool
        # (two at most: a run may start while the last one's body is still ending).
        assert _time_wait(port) == before
        assert transport.pool.connections <= 2


async def test_a_stream_left_mid_body_closes_its_connection(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        transport = sbx.backend.api.transport
        assert isinstance(transport, RawTransport)
        handle = await sbx.commands.run(["sh", "-c", "echo started; sleep 30"], background=True)
        await poll(lambda: "started" in handle.stdout, timeout=WAIT)
        held = transport.pool.connections
        await handle.disconnect()
        # Its response never ended: the connection cannot carry another request.
        await poll(lambda: transport.pool.connections == held - 1, timeout=WAIT)
        await sbx.commands.kill(handle.pid)


_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@contextlib.asynccontextmanager
async def _server(terminator: bool) -> AsyncIterator[tuple[str, list[int], asyncio.Event]]:
    """Answers each request with a start and an end frame, then (``terminator``) the end
    of the body; yields its URL, the requests each connection carried, and an event set
    when a connection is closed by the client."""
    carried: list[int] = []
    closed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        carried.append(0)
        index = len(carried) - 1
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                carried[index] += 1
                start = encode_frame(FrameKind.START, {"cursor": 0, "pid": 7})
                end = encode_frame(FrameKind.END, {"exit_code": 0})
                writer.write(_HEAD + _chunk(start) + _chunk(end))
                if terminator:
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
        closed.set()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", carried, closed
    finally:
        server.close()
        await server.wait_closed()


async def _one_stream(url: str, pool: RawPool) -> list[FrameKind]:
    kinds: list[FrameKind] = []
    async with open_raw_stream(url, "/s", {}, {}, lender=pool) as stream:
        async for batch in stream.batches():
            kinds += [frame.kind for frame in batch]
            if FrameKind.END in kinds:
                break  # as a process's stream stops reading at its end frame
    return kinds


async def test_a_connection_whose_body_ended_whole_carries_the_next_stream() -> None:
    async with _server(terminator=True) as (url, carried, closed):
        pool = RawPool(url, {})
        try:
            for _ in range(3):
                assert await _one_stream(url, pool) == [FrameKind.START, FrameKind.END]
            assert carried == [3]  # one connection, three streams
            assert not closed.is_set()
        finally:
            await pool.aclose()


async def test_a_body_that_never_ends_closes_its_connection() -> None:
    async with _server(terminator=False) as (url, carried, closed):
        pool = RawPool(url, {})
        try:
            assert await _one_stream(url, pool) == [FrameKind.START, FrameKind.END]
            # Its end frame came, the end of the body did not: closed after a wait.
            await asyncio.wait_for(closed.wait(), WAIT)
            await poll(lambda: pool.connections == 0, timeout=WAIT)
            assert await _one_stream(url, pool) == [FrameKind.START, FrameKind.END]
            assert carried == [1, 1]  # the second stream needed a new connection
        finally:
            await pool.aclose()


async def test_a_connection_given_back_after_a_large_read_reads_again() -> None:
    """The end of a body that comes after the stream closed gives the connection back
    from inside the read; the reader must not then pause it for being behind (it had
    just taken a large read), or the next request on it waits for ever (seen: a
    ``kill`` after a 64 MiB fan-out)."""
    large = encode_frame(FrameKind.DATA, {"seq": 0}, b"x" * (512 * 1024))
    closed = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            end = encode_frame(FrameKind.END, {"exit_code": 0})
            body = _chunk(large) + _chunk(end)
            writer.write(_HEAD + body[:1000])
            await writer.drain()
            await asyncio.sleep(0.05)  # sleep-ok: the client reads, then waits for more
            writer.write(body[1000:])  # the rest at once: its last read is a large one
            await writer.drain()
            await closed.wait()  # the stream is closed, waiting for the body's end
            writer.write(b"0\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"GET /json")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
            await reader.read()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = RawPool(url, {})
    try:
        async with open_raw_stream(url, "/s", {}, {}, lender=pool) as stream:
            async for batch in stream.batches():
                if batch[-1].kind is FrameKind.END:
                    break
        closed.set()
        await poll(lambda: len(pool._idle) == 1, timeout=WAIT)  # given back
        response = await asyncio.wait_for(pool.request("GET", "/json"), WAIT)
        assert (response.status, response.body) == (200, b"{}")
    finally:
        await pool.aclose()
        server.close()
        await server.wait_closed()


async def test_a_connection_whose_reader_had_paused_is_given_back_reading() -> None:
    """A reader that fell behind stopped reading its socket (so the daemon sees it
    behind); if the body ended meanwhile, its connection goes back reading."""
    async with _server(terminator=True) as (url, carried, _):
        pool = RawPool(url, {})
        try:
            async with open_raw_stream(url, "/s", {}, {}, lender=pool) as stream:
                async for batch in stream.batches():
                    if batch[-1].kind is FrameKind.END:
                        reader = stream._reader  # as when its last read found it behind
                        assert reader.transport is not None
                        reader.transport.pause_reading()
                        reader._paused = True
                        break
            kinds = await asyncio.wait_for(_one_stream(url, pool), WAIT)
            assert kinds == [FrameKind.START, FrameKind.END]
            assert carried == [2]  # on the connection given back
        finally:
            await pool.aclose()


async def test_a_start_cut_off_before_its_start_frame_is_not_retried() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    requests: list[bytes] = []
    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    api = ApiClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "token")
    try:
        with pytest.raises(DaemonUnavailable):
            await start_stream(api, "sbx-1", {"argv": ["true"]}, follow_options({}, True))
        assert len(requests) == 1  # the process may have started: never sent twice
        assert requests[0].startswith(b"POST /sandboxes/sbx-1/processes/stream")
    finally:
        await api.aclose()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("command", [["true"], ["sh", "-c", "echo out; echo err >&2"]])
async def test_a_run_closes_what_it_read_with(conn: dict[str, str], command: list[str]) -> None:
    """A finished command leaves no half-read async generator for the loop to close
    from the garbage collector: each would cost a wake-up of the loop and a task, per
    command, and close after the connection went back to the pool."""
    async with await AsyncSandbox.create(**conn) as sbx:
        await sbx.commands.run(command)  # the pool's connection, made
        await sbx.commands.connect((await sbx.commands.run(command, background=True)).pid)
        left: list[Any] = []
        firstiter, finalizer = sys.get_asyncgen_hooks()
        sys.set_asyncgen_hooks(firstiter, lambda agen: (left.append(agen), finalizer(agen)))
        try:
            await sbx.commands.run(command)
            handle = await sbx.commands.run(command, background=True)
            await handle.wait()
            await (await sbx.commands.connect(handle.pid, cursor=0)).wait()
            gc.collect()
        finally:
            sys.set_asyncgen_hooks(firstiter, finalizer)
        assert left == []
