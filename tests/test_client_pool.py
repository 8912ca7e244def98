"""One connection pool per daemon: the sandboxes of a process share one httpx client (no
new client, TLS context or connection per sandbox), closed with the last of them; the
local daemon, once found, is not looked up again while its state file is unchanged."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import httpx
import pytest
from support import poll

from sandboxkit import AsyncSandbox, Sandbox, __version__
from sandboxkit.client import local
from sandboxkit.client.api import ApiClient, http_options
from sandboxkit.client.stream import ProcessStream
from sandboxkit.client.transport import RawTransport
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import CommandExitError, DaemonUnavailable, SandboxNotFound
from sandboxkit.statefile import STATE_FILE_ENV, DaemonState, write_state
from sandboxkit.wire import FrameKind, encode_frame


async def test_sandboxes_share_one_pool_closed_with_the_last(conn: dict[str, str]) -> None:
    first = await AsyncSandbox.create(**conn)
    second = await AsyncSandbox.create(**conn)
    transport = first.backend.api.transport
    assert isinstance(transport, RawTransport)  # a loopback daemon: raw sockets, no httpx
    pool = transport.pool
    assert second.backend.api.transport is transport
    await first.kill()
    assert not pool.closed  # the other sandbox still uses it
    assert (await second.commands.run(["echo", "hi"])).stdout == "hi\n"
    assert pool.connections >= 1
    await second.kill()
    assert pool.closed
    assert pool.connections == 0  # every socket closed with it
    third = await AsyncSandbox.create(**conn)  # a new pool after the last one closed
    assert third.backend.api.transport is not transport
    await third.kill()


def test_plain_http_loads_no_certificates() -> None:
    # The ~20 ms of every client's default TLS context: none for plain HTTP on loopback.
    options = http_options("http://127.0.0.1:8000")
    assert options["verify"].cert_store_stats()["x509_ca"] == 0
    assert options["trust_env"] is False
    assert http_options("https://example.org") == {}  # https: verified as by default


async def test_the_local_daemon_is_found_once(
    daemon: DaemonServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "daemon.json"
    write_state(path, DaemonState(daemon.url, os.getpid(), daemon.token, 1.0, __version__))
    monkeypatch.setenv(STATE_FILE_ENV, str(path))
    monkeypatch.delenv(local.URL_ENV, raising=False)
    probes: list[str] = []
    real_probe = local.probe

    def counting_probe(state: DaemonState, timeout: float = 2.0) -> bool:
        probes.append(state.url)
        return real_probe(state, timeout)

    monkeypatch.setattr(local, "probe", counting_probe)
    for _ in range(3):
        async with await AsyncSandbox.create() as sbx:
            assert sbx.connection.url == daemon.url
    assert len(probes) == 1

    # A new state file (another daemon, or a restart) is read again.
    write_state(path, DaemonState(daemon.url, os.getpid(), daemon.token, 2.0, __version__))
    assert local.resolve().url == daemon.url
    assert len(probes) == 2


async def test_streams_read_off_the_socket_raise_typed_errors(conn: dict[str, str]) -> None:
    # Loopback streams are read below httpx (client/transport/raw_stream.py): the same typed errors.
    api = ApiClient(conn["url"], conn["token"])
    try:
        assert isinstance(api.transport, RawTransport)
        with pytest.raises(SandboxNotFound):
            async with api.stream("/sandboxes/sbx-nope/processes/1/stream"):
                pass
    finally:
        await api.aclose()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nobody listens there
    api = ApiClient(f"http://127.0.0.1:{port}", "token")
    try:
        with pytest.raises(DaemonUnavailable):
            async with api.stream("/sandboxes/s/processes/1/stream"):
                pass
    finally:
        await api.aclose()


async def test_a_stream_from_a_daemon_that_died_ends_with_daemon_unavailable() -> None:
    # A daemon that answers one stream, then dies (its listener and connections close).
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        start = encode_frame(FrameKind.START, {"cursor": 0, "keepalive_interval": 0.2})
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(start), start))
        await writer.drain()
        server.close()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    api = ApiClient(f"http://127.0.0.1:{port}", "token")
    stream = ProcessStream(api, "sbx", 1, cursor=0)
    try:
        # Not the 60 s of reattach_timeout: nobody listens there any more.
        with pytest.raises(DaemonUnavailable, match="refused"):
            await asyncio.wait_for(stream.run(), 10)
    finally:
        await api.aclose()
        await server.wait_closed()
    assert stream.stats.attaches == 1


# Writes until killed, so output is flowing as each stream opens.
WRITER = [sys.executable, "-u", "-c", "while True: print('x' * 100)"]


@pytest.mark.timeout(60)
def test_disconnect_as_the_stream_opens_never_hangs(conn: dict[str, str]) -> None:
    """A disconnect that lands while the stream's connection is opening ends the stream;
    before 3.12 asyncio.wait_for could swallow that cancellation and read on forever."""
    with Sandbox.create(**conn) as sbx:
        for _ in range(60):
            handle = sbx.commands.run(WRITER, background=True)
            handle.disconnect()
            handle.kill()


@pytest.mark.parametrize("via", ["raw sockets", "httpx"])
async def test_either_transport_runs_and_follows_a_command(conn: dict[str, str], via: str) -> None:
    # ApiClient holds one transport and does not ask which: the same calls, the same
    # stream, the same bookkeeping of open streams, over either.
    transport = httpx.AsyncHTTPTransport() if via == "httpx" else None
    async with await AsyncSandbox.create(**conn, transport=transport) as sbx:
        api = sbx.backend.api
        assert isinstance(api.transport, RawTransport) is (via == "raw sockets")
        lines: list[str] = []
        result = await sbx.commands.run(["printf", "a\\nb\\n"], on_stdout=lines.append)
        assert (result.stdout, lines) == ("a\nb\n", ["a", "b"])
        handle = await sbx.commands.run(["cat"], background=True)
        await poll(lambda: len(api.streams) == 1, timeout=10)
        await handle.kill()
        with pytest.raises(CommandExitError):
            await handle.wait(timeout=10)
        assert not api.streams  # closed with the stream's end
