"""The lab's JSON-RPC workload: the stdio server on its own (a plain subprocess), then
``JsonRpcClient`` talking to it through the real in-process daemon."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import poll

from sandboxkit import AsyncSandbox, SandboxPaused
from sandboxkit.lab.jsonrpc import JsonRpcClient, RpcClosed, RpcError, RpcTimeout, refresh
from sandboxkit.lab.stdio_server import LineWriter, split_pieces

SERVER = [sys.executable, "-m", "sandboxkit.lab.stdio_server"]


# -- the server alone ---------------------------------------------------------------------


class ServerProcess:
    """The stdio server as a subprocess; a reader thread queues its stdout lines."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*SERVER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.lines: queue.Queue[tuple[float, bytes]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line))

    def send(self, message: dict[str, Any] | bytes) -> None:
        assert self.proc.stdin is not None
        raw = message if isinstance(message, bytes) else json.dumps(message).encode()
        self.proc.stdin.write(raw.rstrip(b"\n") + b"\n")
        self.proc.stdin.flush()

    def line(self, timeout: float = 5.0) -> tuple[float, bytes]:
        """(arrival time, raw line without its newline)."""
        try:
            at, raw = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("the server wrote no line in time") from None
        assert raw.endswith(b"\n")
        return at, raw[:-1]

    def response(self, timeout: float = 5.0) -> tuple[dict[str, Any], int]:
        """The next line that is not a notification: (message, line length)."""
        while True:
            _, raw = self.line(timeout)
            message = json.loads(raw)
            if "method" not in message:
                return message, len(raw)

    def close(self) -> int:
        """EOF on stdin; the exit status."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        return self.proc.wait(timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


@contextlib.contextmanager
def server(*args: str) -> Iterator[ServerProcess]:
    proc = ServerProcess(*args)
    try:
        yield proc
    finally:
        proc.kill()


def _request(rid: Any, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
    if params is not None:
        message["params"] = params
    return message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [3000, 6000, 20000])
def test_each_method_answers_with_its_id_and_the_configured_size(size: int) -> None:
    args = [] if size == 6000 else ["--response-size", str(size)]  # 6000 is the default
    with server(*args) as srv:
        srv.send(_request("init-1", "initialize", {"protocolVersion": "2024-11-05"}))
        init, _ = srv.response()
        assert init["id"] == "init-1"
        assert {"protocolVersion", "serverInfo", "capabilities"} <= set(init["result"])

        for rid, (method, key) in enumerate(
            [("tools/list", "tools"), ("resources/list", "resources"), ("prompts/list", "prompts")],
            start=10,
        ):
            srv.send(_request(rid, method))
            answer, length = srv.response()
            assert answer["id"] == rid
            assert length == size, f"{method}: {length} bytes, configured {size}"
            items = answer["result"][key]
            assert len(items) >= size // 400, f"{method} is padding, not a list of items"
        srv.send(_request(20, "tools/list"))
        tools, _ = srv.response()
        assert "echo" in {tool["name"] for tool in tools["result"]["tools"]}

        text = "héllo wörld"
        srv.send(_request(21, "tools/call", {"name": "echo", "arguments": {"text": text}}))
        echoed, length = srv.response()
        assert echoed["id"] == 21
        assert echoed["result"]["content"] == [{"type": "text", "text": text}]
        assert length == size
        srv.send(
            _request(22, "tools/call", {"name": "echo", "arguments": {"text": text, "pad": False}})
        )
        bare, length = srv.response()
        assert bare["result"]["content"][0]["text"] == text
        assert length < 200
        assert srv.close() == 0


def test_writer_writes_each_line_in_flushed_pieces() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.ops: list[tuple[str, bytes]] = []

        def write(self, data: bytes, /) -> int:
            self.ops.append(("write", bytes(data)))
            return len(data)

        def flush(self) -> None:
            self.ops.append(("flush", b""))

    out = Recorder()
    writer = LineWriter(out, piece_size=100)
    payload = bytes(range(32, 127)) * 11  # 1045 bytes, +1 newline: 10 pieces of 100 and 46
    assert writer.write_line(payload) == 11
    kinds = [kind for kind, _ in out.ops]
    assert kinds == ["write", "flush"] * 11, "every piece must be flushed on its own"
    pieces = [data for kind, data in out.ops if kind == "write"]
    assert [len(p) for p in pieces] == [100] * 10 + [46]
    assert b"".join(pieces) == payload + b"\n"
    assert (writer.lines, writer.pieces) == (1, 11)


@given(data=st.binary(max_size=3000), piece=st.integers(min_value=1, max_value=700))
@settings(max_examples=200, deadline=None)
def test_split_pieces_is_lossless_and_bounded(data: bytes, piece: int) -> None:
    pieces = split_pieces(data, piece)
    assert b"".join(pieces) == data
    assert all(0 < len(p) <= piece for p in pieces) or data == b""
    assert len(pieces) == max(1, -(-len(data) // piece))


@pytest.mark.timeout(30)
def test_one_response_reaches_the_reader_in_several_reads() -> None:
    # Pieces of 100 bytes with 20 ms between them: a reader sees the one line arrive in
    # several reads (with one write of the whole line it would see a single read).
    proc = subprocess.Popen(
        [*SERVER, "--response-size", "1000", "--piece-size", "100", "--piece-delay", "0.02"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(_request(1, "prompts/list")).encode() + b"\n")
        proc.stdin.flush()
        reads: list[bytes] = []
        deadline = time.monotonic() + 10
        while not reads or not reads[-1].endswith(b"\n"):
            assert time.monotonic() < deadline, "no complete response"
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, "the server closed its stdout"
            reads.append(chunk)
        line = b"".join(reads)
        assert len(line) == 1001 and json.loads(line)["id"] == 1
        assert len(reads) > 1, "the response arrived in one piece"
        assert max(len(r) for r in reads) < len(line)
        proc.stdin.close()
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(30)
def test_bad_input_gets_json_rpc_errors_and_the_server_keeps_serving() -> None:
    with server() as srv:
        cases: list[tuple[bytes, Any, int]] = [
            (b"{not json", None, -32700),
            (b"\xff\xfe\x00garbage", None, -32700),
            (b'{"jsonrpc": "2.0", "id": 3, "method": "tools/li', None, -32700),
            (b"[1, 2]", None, -32600),
            (b"42", None, -32600),
            (b'{"jsonrpc": "2.0", "id": 7}', 7, -32600),
            (b'{"jsonrpc": "2.0", "id": {"x": 1}, "method": "ping"}', None, -32600),
            (json.dumps(_request(8, "no/such/method")).encode(), 8, -32601),
            (json.dumps(_request(9, "tools/call", {"name": "nope"})).encode(), 9, -32602),
            (json.dumps(_request(10, "tools/list", cast(Any, 5))).encode(), 10, -32602),
        ]
        for raw, rid, code in cases:
            srv.send(raw)
            answer, _ = srv.response()
            assert answer["id"] == rid, raw
            assert answer["error"]["code"] == code, raw
            assert "result" not in answer
        # Notifications (no id) are never answered, known method or not; blank lines
        # are skipped: the next line is the answer to the next request.
        srv.send({"jsonrpc": "2.0", "method": "no/such/notification"})
        srv.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        srv.send(b"   ")
        srv.send(_request("after", "ping"))
        answer, _ = srv.response()
        assert answer == {"jsonrpc": "2.0", "id": "after", "result": {}}
        assert srv.proc.poll() is None
        assert srv.close() == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("chatter", ["0", "100"])
def test_stdin_eof_exits_zero(chatter: str) -> None:
    with server("--chatter-rate", chatter) as srv:
        srv.send(_request(1, "initialize"))
        assert srv.response()[0]["id"] == 1
        started = time.monotonic()
        assert srv.close() == 0
        assert time.monotonic() - started < 3


@pytest.mark.timeout(30)
def test_chatter_keeps_its_rate_and_never_splits_a_response() -> None:
    rate = 40.0
    size = 4000
    # 63 pieces of 64 bytes with 1 ms between them: each response is being written for
    # tens of ms, during which the chatter thread is due to write a line or two.
    with server(
        "--chatter-rate",
        str(rate),
        "--response-size",
        str(size),
        "--piece-size",
        "64",
        "--piece-delay",
        "0.001",
    ) as srv:
        chatter: list[tuple[float, dict[str, Any]]] = []
        answered = 0
        for rid in range(10):
            srv.send(_request(rid, "resources/list"))
            while True:
                at, raw = srv.line()
                message = json.loads(raw)  # a split line would not parse
                if "method" in message:
                    assert message["method"] == "notifications/message"
                    chatter.append((at, message))
                    continue
                assert message["id"] == rid and len(raw) == size
                answered += 1
                break
        while len(chatter) < 30:
            at, raw = srv.line()
            chatter.append((at, json.loads(raw)))
        assert answered == 10
        seqs = [m["params"]["data"]["seq"] for _, m in chatter]
        assert seqs == list(range(1, len(seqs) + 1)), "chatter lines lost or reordered"
        measured = (len(chatter) - 1) / (chatter[-1][0] - chatter[0][0])
        assert 0.6 * rate <= measured <= 1.5 * rate, f"chatter at {measured:.1f} Hz"
        assert srv.close() == 0


# -- the client, unit level --------------------------------------------------------------


def _bare_client() -> JsonRpcClient:
    """A client that is never started: only its line splitter is used."""
    return JsonRpcClient(cast(Any, None), 1)


@given(
    messages=st.lists(
        st.one_of(
            st.builds(
                lambda n, text: {"jsonrpc": "2.0", "method": "note", "params": {"n": n, "t": text}},
                st.integers(0, 10**6),
                st.text(max_size=40),
            ),
            st.sampled_from(["not json", "[1, 2]", '{"jsonrpc": "2.0", "id": 5, "result": 1}']),
        ),
        max_size=20,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=30),
)
@settings(max_examples=200, deadline=None)
def test_line_splitter_handles_any_chunking(messages: list[Any], cuts: list[int]) -> None:
    text = "".join((json.dumps(m) if isinstance(m, dict) else m) + "\n" for m in messages)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    client = _bare_client()
    for start, end in itertools.pairwise(bounds):
        client.feed(text[start:end])
    assert client.notifications == [m for m in messages if isinstance(m, dict)]
    assert client.stray_lines == sum(1 for m in messages if isinstance(m, str))
    assert client.bytes_received == len(text.encode())
    assert (client.first_byte_at is not None) == bool(text)


def test_notifications_are_bounded() -> None:
    client = JsonRpcClient(cast(Any, None), 1, max_notifications=5)
    client.feed("".join(json.dumps({"method": "m", "params": {"i": i}}) + "\n" for i in range(12)))
    assert [n["params"]["i"] for n in client.notifications] == list(range(7, 12))


# -- the client through the daemon -------------------------------------------------------


@contextlib.asynccontextmanager
async def sandbox(conn: dict[str, str]) -> AsyncIterator[AsyncSandbox]:
    async with await AsyncSandbox.create(**conn) as sbx:
        yield sbx


async def _start(sbx: AsyncSandbox, *args: str) -> int:
    return (await sbx.commands.start([*SERVER, *args])).pid


@pytest.mark.timeout(30)
async def test_initialize_and_refresh(conn: dict[str, str]) -> None:
    async with sandbox(conn) as sbx:
        pid = await _start(sbx)
        async with JsonRpcClient(sbx, pid) as client:
            init = await client.request("initialize", {"protocolVersion": "2024-11-05"})
            assert init["protocolVersion"] and init["serverInfo"]["name"]
            assert client.first_byte_at is not None and client.started_at is not None
            assert client.first_byte_at >= client.started_at
            tools, resources, prompts = await refresh(client, 5.0)
            assert "echo" in {t["name"] for t in tools["tools"]}
            assert resources["resources"] and prompts["prompts"]
            assert client.bytes_received >= 3 * 6000
            assert client.responses == 4 and client.stray_lines == 0 and client.pending == 0


@pytest.mark.timeout(30)
async def test_concurrent_requests_get_their_own_responses(conn: dict[str, str]) -> None:
    async with sandbox(conn) as sbx:
        # Small pieces and chatter: responses span many chunks and mix with notifications.
        pid = await _start(sbx, "--piece-size", "100", "--chatter-rate", "50")
        async with JsonRpcClient(sbx, pid) as client:
            texts = [f"message {i} " + "x" * i for i in range(20)]
            results = await asyncio.gather(
                *(
                    client.request("tools/call", {"name": "echo", "arguments": {"text": t}})
                    for t in texts
                )
            )
            assert [r["content"][0]["text"] for r in results] == texts
            assert client.responses == 20 and client.stray_lines == 0 and client.pending == 0
            # The chatter runs on its own clock (50 Hz from the server's start): twenty
            # quick answers may all come before its first line.
            await poll(lambda: client.notifications, 5, "chatter")
            assert all(n["method"] == "notifications/message" for n in client.notifications)
            with pytest.raises(RpcError) as info:
                await client.request("no/such/method")
            assert info.value.code == -32601


@pytest.mark.timeout(30)
async def test_stray_lines_and_old_responses_are_ignored(conn: dict[str, str]) -> None:
    async with sandbox(conn) as sbx:
        junk = '{"jsonrpc":"2.0","id":"other","result":1}'
        command = f"echo not-json; echo {shlex.quote(junk)}; exec {shlex.join(SERVER)}"
        pid = (await sbx.commands.start(command)).pid
        async with JsonRpcClient(sbx, pid) as first:
            await first.request("initialize")
            await refresh(first, 5.0)
            assert first.stray_lines == 2
        # A second client replaying the whole log sees the first client's four
        # responses; they must not answer its own requests.
        async with JsonRpcClient(sbx, pid, cursor=0) as second:
            init = await second.request("initialize")
            assert "protocolVersion" in init
            assert second.stray_lines == 2 + 4


@pytest.mark.timeout(30)
async def test_a_silent_server_raises_rpc_timeout_after_the_deadline(
    conn: dict[str, str],
) -> None:
    async with sandbox(conn) as sbx:
        pid = (await sbx.commands.start(["sleep", "30"])).pid
        async with JsonRpcClient(sbx, pid) as client:
            started = time.monotonic()
            with pytest.raises(RpcTimeout) as info:
                await client.request("initialize", deadline=0.5)
            elapsed = time.monotonic() - started
            assert 0.45 <= elapsed <= 1.5, elapsed
            assert info.value.method == "initialize" and info.value.deadline == 0.5
            assert isinstance(info.value, TimeoutError)
            assert client.pending == 0


@pytest.mark.timeout(30)
async def test_paused_server_times_out_then_answers_after_resume(conn: dict[str, str]) -> None:
    async with sandbox(conn) as sbx:
        pid = await _start(sbx)
        async with JsonRpcClient(sbx, pid) as client:
            await client.request("initialize")
            await sbx.pause()
            try:
                started = time.monotonic()
                with pytest.raises(RpcTimeout):
                    await client.request("tools/list", deadline=0.5)
                assert 0.45 <= time.monotonic() - started <= 1.5
            finally:
                await sbx.resume()
            # The stdin session refused while paused is replaced; the client recovers.
            tools = await client.request("tools/list", deadline=5.0)
            assert tools["tools"]
            if client.stdin_restarts:
                assert isinstance(client.last_stdin_error, SandboxPaused)


@pytest.mark.timeout(30)
async def test_pending_requests_fail_promptly_when_the_process_exits(
    conn: dict[str, str],
) -> None:
    async with sandbox(conn) as sbx:
        pid = (await sbx.commands.start(["sleep", "30"])).pid
        async with JsonRpcClient(sbx, pid) as client:
            pending = asyncio.ensure_future(client.request("initialize", deadline=20.0))
            deadline = time.monotonic() + 5
            while client.pending == 0:  # a poll: the request is registered
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)  # sleep-ok: poll interval
            started = time.monotonic()
            await sbx.commands.kill(pid)
            with pytest.raises(RpcClosed, match="exited"):
                await pending
            assert time.monotonic() - started < 5
            with pytest.raises(RpcClosed):
                await client.request("initialize")


@pytest.mark.timeout(30)
async def test_close_fails_pending_requests_and_leaves_no_task(conn: dict[str, str]) -> None:
    async with sandbox(conn) as sbx:
        pid = (await sbx.commands.start(["sleep", "30"])).pid
        before = asyncio.all_tasks()
        client = JsonRpcClient(sbx, pid)
        await client.start()
        pending = asyncio.ensure_future(client.request("initialize", deadline=20.0))
        deadline = time.monotonic() + 5
        while client.pending == 0:  # a poll: the request is registered
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)  # sleep-ok: poll interval
        assert asyncio.all_tasks() - before, "start() should be following the stream"
        started = time.monotonic()
        await client.close()
        with pytest.raises(RpcClosed):
            await pending
        assert time.monotonic() - started < 2
        await client.close()  # idempotent
        assert asyncio.all_tasks() - before == set()
        with pytest.raises(RpcClosed):
            await client.request("initialize")
