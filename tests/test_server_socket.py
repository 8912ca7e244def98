"""The daemon's listening socket: accepted connections must not sit behind Nagle.

uvicorn writes a response's headers and body in two sends; with Nagle on, the kernel holds
the second until the client's delayed ACK (~40 ms), so every unary request took ~44 ms.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxkit.daemon.server import DaemonServer, UnsafeBind, is_loopback


def _server_side_socket(client: socket.socket) -> socket.socket:
    """A duplicate of the daemon's accepted socket for ``client`` (same process: the
    in-process daemon's file descriptors are ours to inspect)."""
    want_local, want_peer = client.getpeername(), client.getsockname()
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family == socket.AF_INET and sock.type == socket.SOCK_STREAM:
                with contextlib.suppress(OSError):
                    if sock.getsockname() == want_local and sock.getpeername() == want_peer:
                        return sock
        except OSError:
            pass
        sock.close()
    raise AssertionError("the daemon's side of the connection was not found")


def test_accepted_connections_have_tcp_nodelay(daemon: DaemonServer) -> None:
    with socket.create_connection((daemon.bind, daemon.port)) as client:
        # A full request/response proves the daemon accepted (and served) the connection.
        client.sendall(
            b"GET /health HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {daemon.token}\r\n\r\n".encode()
        )
        assert client.recv(65536).startswith(b"HTTP/1.1 200")
        server_side = _server_side_socket(client)
        with server_side:
            assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_no_auth_is_refused_on_a_reachable_address(tmp_path: Path) -> None:
    for bind in ("0.0.0.0", "::"):
        with pytest.raises(UnsafeBind):
            DaemonServer(bind=bind, token=None)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    # Loopback without auth stays possible (tests, a single-user machine).
    with DaemonServer(bind="127.0.0.1", token=None) as open_daemon:  # stopped: no root left
        assert open_daemon.token is None
    # The CLI refuses before binding anything, and says how to insist.
    state = tmp_path / "daemon.json"
    argv = ["serve", "--host", "0.0.0.0", "--no-auth", "--state-file", str(state)]
    done = subprocess.run(
        [sys.executable, "-m", "sandboxkit", *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "--i-understand-anyone-can-run-commands" in done.stderr
    assert not state.exists()
