"""JSON calls to a loopback daemon over the client's own kept-alive sockets
(client/transport/raw_unary.py), against scripted loopback servers: connections reused, a request
the daemon dropped on a kept-alive connection retried once when that is safe, broken or
silent servers ending in typed errors (never a hang), every socket closed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import tracemalloc
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from support import poll

from sandboxkit import AsyncSandbox
from sandboxkit.client.api import ApiClient
from sandboxkit.client.transport import RawTransport, raw_unary
from sandboxkit.client.transport.http11 import BadResponse, parse_head
from sandboxkit.client.transport.raw_stream import open_raw_stream
from sandboxkit.errors import (
    DaemonUnavailable,
    InvalidArgument,
    MalformedFrame,
    SandboxkitError,
    SandboxNotFound,
)

pytestmark = pytest.mark.timeout(20)

OK = b'HTTP/1.1 200 OK\r\ncontent-length: 11\r\ncontent-type: application/json\r\n\r\n{"ok":true}'


@dataclass
class Request:
    head: bytes
    body: bytes


@dataclass
class Close:
    """Send these bytes, then close the connection."""

    data: bytes


# (the connection's number, the request's number on it, the request) -> what to do.
Script = Callable[[int, int, Request], Awaitable[bytes | Close | None]]


@dataclass
class Server:
    """A loopback HTTP server whose answers a test scripts: bytes to send (and keep the
    connection), :class:`Close` (send, then close), or None (close it, unanswered)."""

    script: Script
    accepts: int = 0
    requests: list[Request] = field(default_factory=list)
    open: int = 0  # connections not yet closed by either side
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.accepts
        self.accepts += 1
        self.open += 1
        self.writers.append(writer)
        try:
            for index in range(1_000):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                request = Request(head, await reader.readexactly(length))
                self.requests.append(request)
                answer = await self.script(number, index, request)
                if answer is None:
                    return
                writer.write(answer.data if isinstance(answer, Close) else answer)
                await writer.drain()
                if isinstance(answer, Close):
                    return
        finally:
            writer.close()
            self.open -= 1


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Awaitable[Server]]]:
    servers: list[Server] = []

    async def start(script: Script) -> Server:
        server = Server(script)
        server.server = await asyncio.start_server(server.serve, "127.0.0.1", 0)
        servers.append(server)
        return server

    yield start
    for server in servers:
        assert server.server is not None
        server.server.close()
        await server.server.wait_closed()


async def always_ok(conn: int, index: int, request: Request) -> bytes:
    return OK


async def test_calls_reuse_one_connection_and_close_it(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    server = await serve(always_ok)
    api = ApiClient(server.url, "tok")
    assert isinstance(api.transport, RawTransport)
    for _ in range(5):
        assert await api.call("POST", "/sandboxes/s/pause", json={"a": [1, "é"]}) == {"ok": True}
    assert server.accepts == 1
    head = server.requests[0].head
    assert head.startswith(b"POST /sandboxes/s/pause HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer tok\r\n" in head
    assert server.requests[0].body == '{"a":[1,"é"]}'.encode()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        await api.aclose()
        gc.collect()
    assert isinstance(api.transport, RawTransport) and api.transport.pool.connections == 0
    await poll(lambda: server.open == 0, 5.0, "the server to see the connection close")


async def test_concurrent_calls_get_connections_of_their_own(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    release = asyncio.Event()

    async def slow(conn: int, index: int, request: Request) -> bytes:
        await release.wait()
        return OK

    server = await serve(slow)
    api = ApiClient(server.url, None)
    try:
        calls = [asyncio.create_task(api.call("GET", "/x")) for _ in range(3)]
        await poll(lambda: len(server.requests) == 3, 5.0, "three requests")
        release.set()
        assert await asyncio.gather(*calls) == [{"ok": True}] * 3
        assert server.accepts == 3
        for _ in range(3):  # all three kept, reused
            await api.call("GET", "/x")
        assert server.accepts == 3
    finally:
        await api.aclose()


async def test_an_idempotent_request_the_daemon_dropped_is_retried_once(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    # The second request on the first connection is read and dropped unanswered (the
    # daemon closed its end of a kept-alive connection just as the request went out).
    async def drop_second(conn: int, index: int, request: Request) -> bytes | None:
        return None if (conn, index) == (0, 1) else OK

    server = await serve(drop_second)
    api = ApiClient(server.url, "tok")
    try:
        await api.call("GET", "/health")
        assert await api.call("GET", "/health") == {"ok": True}
        assert len(server.requests) == 3  # sent once, dropped, sent once more
        assert server.accepts == 2
    finally:
        await api.aclose()


async def test_a_request_dropped_twice_is_not_retried_again(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    async def drop_after_first(conn: int, index: int, request: Request) -> bytes | None:
        return OK if (conn, index) == (0, 0) else None

    server = await serve(drop_after_first)
    api = ApiClient(server.url, "tok")
    try:
        await api.call("GET", "/health")
        with pytest.raises(DaemonUnavailable, match="without answering"):
            await api.call("GET", "/health")
        assert len(server.requests) == 3  # the first, then the dropped one twice: no more
    finally:
        await api.aclose()


async def test_a_dropped_post_is_not_sent_twice(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    async def drop_second(conn: int, index: int, request: Request) -> bytes | None:
        return None if (conn, index) == (0, 1) else OK

    server = await serve(drop_second)
    api = ApiClient(server.url, "tok")
    try:
        await api.call("POST", "/p")
        with pytest.raises(DaemonUnavailable):
            await api.call("POST", "/p")  # the daemon may have acted on it
        assert len(server.requests) == 2
    finally:
        await api.aclose()


async def test_a_connection_closed_while_idle_is_not_written_to(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    # The daemon closes an idle kept-alive connection (its keep-alive timeout): the next
    # POST must go out on a new connection, once, and succeed.
    server = await serve(always_ok)
    api = ApiClient(server.url, "tok")
    try:
        await api.call("POST", "/p")
        server.writers[0].close()
        await poll(lambda: server.open == 0, 5.0, "the server to see the connection close")
        assert await api.call("POST", "/p") == {"ok": True}
        assert len(server.requests) == 2
        assert server.accepts == 2
    finally:
        await api.aclose()


async def test_a_connection_idle_near_the_keep_alive_timeout_is_not_reused(
    serve: Callable[[Script], Awaitable[Server]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The daemon closes a connection idle for its keep-alive timeout (5 s): a request
    # written to it as that happens is lost, and a POST (a start) cannot be retried. So
    # a connection idle nearly that long goes, before it is written to.
    monkeypatch.setattr(raw_unary, "MAX_IDLE_AGE", 0.2)
    server = await serve(always_ok)
    api = ApiClient(server.url, "tok")
    try:
        await api.call("POST", "/p")
        await api.call("POST", "/p")
        assert server.accepts == 1  # reused while fresh
        await asyncio.sleep(0.3)  # sleep-ok: the idle time is what is tested
        assert await api.call("POST", "/p") == {"ok": True}
        assert server.accepts == 2  # a new connection for a request after that long
        await poll(lambda: server.open == 1, 5.0, "the old connection to be closed")
    finally:
        await api.aclose()


async def test_a_close_the_loop_has_not_seen_yet_is_noticed_before_writing() -> None:
    # The daemon's FIN is in this socket's receive queue, but the event loop has not run
    # since (no eof_received yet): the POST must still not be written to that connection.
    listener = socket.create_server(("127.0.0.1", 0))
    answered = threading.Event()
    requests: list[bytes] = []

    def serve_one_per_connection() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with client:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = client.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if data:
                    requests.append(data)
                    client.sendall(OK)
            answered.set()  # answered and closed

    thread = threading.Thread(target=serve_one_per_connection, daemon=True)
    thread.start()
    api = ApiClient(f"http://127.0.0.1:{listener.getsockname()[1]}", "tok")
    try:
        await api.call("POST", "/p")
        # Blocks the loop on purpose: the close happens while the loop cannot see it.
        assert answered.wait(5)
        answered.clear()
        assert await api.call("POST", "/p") == {"ok": True}
        assert len(requests) == 2
    finally:
        await api.aclose()
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        listener.close()
        thread.join(5)
    assert not thread.is_alive()


async def test_an_answer_is_read_into_a_buffer_its_connection_keeps() -> None:
    # Not into a new object of the loop's read size (256 KiB) for every read: memory the
    # allocator may map, shrink and unmap each time (three system calls, measured at a
    # sixth of a small call's time in the client). The server reads into a buffer of
    # its own, so that what is traced is the client's.
    listener = socket.create_server(("127.0.0.1", 0))
    big = b"[" + b",".join([b'"' + b"x" * 998 + b'"'] * 300) + b"]"  # 300 KB: many reads

    def serve() -> None:
        with contextlib.suppress(OSError):
            client, _ = listener.accept()
            with client:
                buffer, got = bytearray(4096), b""
                while n := client.recv_into(buffer):
                    got += buffer[:n]
                    while b"\r\n\r\n" in got:
                        head, _, got = got.partition(b"\r\n\r\n")
                        body = big if head.startswith(b"GET /big ") else b'{"ok":true}'
                        client.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
                        client.sendall(body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    api = ApiClient(f"http://127.0.0.1:{listener.getsockname()[1]}", None)
    try:
        assert await api.call("GET", "/x") == {"ok": True}  # its connection, made
        tracemalloc.start()
        try:
            for _ in range(20):
                assert await api.call("GET", "/x") == {"ok": True}
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 * 1024, f"{peak} bytes at most for 20 calls"
        assert await api.call("GET", "/big") == [("x" * 998)] * 300  # read whole
        assert await api.call("GET", "/x") == {"ok": True}  # and the connection kept
    finally:
        await api.aclose()
        listener.shutdown(socket.SHUT_RDWR)  # wakes an accept() still waiting (close does not)
        listener.close()
        thread.join(5)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    "answer",
    [
        b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"ok":',  # dies mid-body
        b"HTTP/1.1 200 OK\r\ncontent-",  # dies mid-head
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
    ids=["mid-body", "mid-head", "garbage", "two-lengths", "bad-chunk"],
)
async def test_a_broken_answer_is_daemon_unavailable(
    serve: Callable[[Script], Awaitable[Server]], answer: bytes
) -> None:
    async def broken(conn: int, index: int, request: Request) -> bytes | Close:
        return Close(answer) if conn == 0 else OK

    server = await serve(broken)
    api = ApiClient(server.url, "tok")
    try:
        with pytest.raises(DaemonUnavailable) as raised:
            await api.call("GET", "/x")
        assert raised.value.url == server.url
        assert await api.call("GET", "/x") == {"ok": True}  # a new connection works
    finally:
        await api.aclose()


async def test_a_daemon_that_is_gone_is_daemon_unavailable(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    server = await serve(always_ok)
    url = server.url
    api = ApiClient(url, "tok")
    try:
        await api.call("GET", "/health")
        assert server.server is not None
        server.server.close()  # the daemon exits: listener and connections
        for writer in server.writers:
            writer.close()
        await server.server.wait_closed()
        with pytest.raises(DaemonUnavailable, match="cannot reach") as raised:
            await api.call("GET", "/health")
        assert raised.value.url == url
    finally:
        await api.aclose()


async def test_a_daemon_that_never_answers_times_out(
    serve: Callable[[Script], Awaitable[Server]],
) -> None:
    async def silent(conn: int, index: int, request: Request) -> bytes | None:
        await asyncio.Event().wait()
        return None

    server = await serve(silent)
    api = ApiClient(server.url, "tok", timeout=httpx.Timeout(0.3))
    try:
        with pytest.raises(DaemonUnavailable, match="did not answer"):
            await api.call("GET", "/x")
    finally:
        await api.aclose()
    assert isinstance(api.transport, RawTransport) and api.transport.pool.connections == 0


async def test_chunked_and_error_answers(serve: Callable[[Script], Awaitable[Server]]) -> None:
    missing = b'{"code":"sandbox_not_found","message":"no such sandbox","details":{}}'
    answers = [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\n[1,2,\r\n2;x=y\r\n3]\r\n0\r\n\r\n",
        b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(missing), missing),
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n" + OK,
        b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nnull",
        b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nnot json",
        b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 5\r\n\r\noops!",
    ]

    async def scripted(conn: int, index: int, request: Request) -> bytes:
        return answers[index]

    server = await serve(scripted)
    api = ApiClient(server.url, "tok")
    try:
        assert await api.call("GET", "/a") == [1, 2, 3]
        with pytest.raises(SandboxNotFound, match="no such sandbox"):
            await api.call("GET", "/b")
        assert await api.call("DELETE", "/c") is None
        assert await api.call("GET", "/d") == {"ok": True}
        assert await api.call("GET", "/e") is None  # JSON null is an answer, not junk
        with pytest.raises(MalformedFrame):
            await api.call("GET", "/f")
        with pytest.raises(SandboxkitError, match="HTTP 500"):
            await api.call("GET", "/g")
        assert server.accepts == 1  # all on one connection
    finally:
        await api.aclose()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno-colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\nb\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
    ],
)
def test_the_head_parser_is_strict(head: bytes) -> None:
    with pytest.raises(BadResponse):
        parse_head(head, len(head))


def test_the_head_parser_reads_framing_and_keep_alive() -> None:
    def parse(head: bytes) -> tuple[int, int | None, bool, bool]:
        parsed = parse_head(head, len(head))
        return parsed.status, parsed.length, parsed.chunked, parsed.keep_alive

    assert parse(b"HTTP/1.1 200 OK\r\nContent-Length:  42 \r\n\r\n") == (200, 42, False, True)
    assert parse(b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 1\r\n\r\n") == (
        200,
        1,
        False,
        False,
    )
    assert parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n") == (
        200,
        None,
        True,
        True,
    )
    assert parse(b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n")[3] is False
    assert parse(b"HTTP/1.1 200 OK\r\n\r\n") == (200, None, False, False)  # until close
    assert parse(b"HTTP/1.1 204 No Content\r\n\r\n") == (204, 0, False, True)


@pytest.mark.parametrize("token", ["abc\r\nX-Injected: 1", "abc\n", "a\x00b"])
async def test_a_token_that_would_break_the_request_is_refused_before_anything_is_sent(
    token: str,
) -> None:
    # Requests are written by hand (no h11 validating each field): a token pasted with
    # its newline would otherwise end the Authorization line and start a header of its own.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(InvalidArgument) as refused:
            await AsyncSandbox.create(url=url, token=token)
        assert refused.value.field == "Authorization"
        with pytest.raises(InvalidArgument):
            async with open_raw_stream(url, "/stream", {}, {"Authorization": token}):
                pass
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


async def test_a_real_daemon_serves_a_sandbox_over_one_connection(conn: dict[str, Any]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        transport = sbx.backend.api.transport
        assert isinstance(transport, RawTransport)
        pool = transport.pool
        assert pool is not None
        for _ in range(3):
            await sbx.pause()
            await sbx.resume()
        assert pool.connections == 1
    assert pool.connections == 0


@pytest.mark.parametrize("sandbox_id", ["no such sandbox", "sbx-é", "a\tb"])
async def test_a_sandbox_id_as_typed_is_a_typed_not_found_on_both_paths(
    conn: dict[str, Any], sandbox_id: str
) -> None:
    # Requests are written by hand: a target with a space, a control or non-ASCII text is
    # percent-encoded as httpx would, never sent broken (nor an encoding error raised).
    with pytest.raises(SandboxNotFound):
        await AsyncSandbox.connect(sandbox_id, **conn)
    url, token = str(conn["url"]), str(conn["token"])
    path = f"/sandboxes/{sandbox_id}/processes/1/stream"
    with pytest.raises(SandboxNotFound):
        async with open_raw_stream(url, path, {}, {"Authorization": f"Bearer {token}"}):
            pass


# -- helpers ---------------------------------------------------------------------------
