"""Ghost makers: real consumers that stop reading, each the way it happens in the wild.

* :class:`LeakyClient` attaches to a stream and never reads again, without closing — an
  HTTP/2 stream that was never reset, a response nobody closed (F4).
* :class:`FrozenClient` is a reader in a separate process that gets SIGSTOP.
* Pause-snapshot ghosts are made by the daemon itself: create the sandbox with
  ``lab=LabOptions(pause_ghosts=True)`` and every stream open at a pause becomes a ghost
  on resume.

Each ghost's receive buffer is small by default (``buffer``). For a pause-snapshot ghost
that is the whole path (a socket pair of ``buffer`` bytes), so a wedge shows after a
response or two, as in the public reports. The client-side ghosts are TCP peers of the
daemon: ``buffer`` bounds only their receive buffer, while the daemon's side (the kernel's
autotuned send buffer plus the HTTP server's 64 KiB write buffer) still takes a couple of
hundred KiB (about 250 KiB on Linux loopback) before a send blocks. They wedge once that
much output has gone by: use a larger ``response_size`` (e.g. 100_000) or more cycles.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from urllib.parse import urlsplit

from sandboxkit.lab_options import GHOST_BUFFER, GHOST_KINDS
from sandboxkit.vocab import GHOST_ROLE

__all__ = ["GHOST_KINDS", "FrozenClient", "Ghost", "LeakyClient", "make_ghost"]


def _request(url: str, token: str | None, sandbox_id: str, pid: int, name: str) -> bytes:
    # role=ghost: consumer metrics (and the notebook's chart) tell the lab's ghosts apart.
    path = f"/sandboxes/{sandbox_id}/processes/{pid}/stream?name={name}&role={GHOST_ROLE}"
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    host = urlsplit(url).netloc
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode()


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


class Ghost:
    """A consumer that stopped reading. Close it to release it."""

    kind = "none"

    def close(self) -> None:
        """Release the ghost (its socket or its process)."""


class LeakyClient(Ghost):
    """Attaches to a process's stream, reads the response head, then never reads again
    and never closes (until :meth:`close`)."""

    kind = "leaky"

    def __init__(
        self, url: str, token: str | None, sandbox_id: str, pid: int, *, buffer: int = GHOST_BUFFER
    ):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Set before connect, so the advertised window is small from the start.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        self.sock.settimeout(10)
        self.sock.connect(_address(url))
        self.sock.sendall(_request(url, token, sandbox_id, pid, "ghost-leaky"))
        head = b""
        while b"\r\n\r\n" not in head:
            data = self.sock.recv(1)
            if not data:
                raise ConnectionError("daemon closed the ghost's stream at once")
            head += data
        if not head.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(head.split(b"\r\n", 1)[0].decode(errors="replace"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


_FROZEN_READER = """
import socket, sys
host, port, request, buffer = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
try:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    sock.settimeout(10)
    sock.connect((host, port))
    sock.sendall(request.encode())
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        data = sock.recv(1)
        if not data:
            break
        head += data
except OSError as exc:
    print(f"cannot attach: {exc}", flush=True)
    sys.exit(1)
status = head.split(b"\\r\\n", 1)[0].decode(errors="replace")
if not status.startswith("HTTP/1.1 200"):
    # An error response is no stream: there is nothing to freeze.
    print(status or "daemon closed the ghost's stream at once", flush=True)
    sys.exit(1)
sock.settimeout(None)
print("attached", flush=True)
while sock.recv(65536):
    pass
"""


class FrozenClient(Ghost):
    """A reader in its own process, stopped with SIGSTOP once it is attached."""

    kind = "frozen"

    def __init__(
        self, url: str, token: str | None, sandbox_id: str, pid: int, *, buffer: int = GHOST_BUFFER
    ):
        host, port = _address(url)
        request = _request(url, token, sandbox_id, pid, "ghost-frozen").decode()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _FROZEN_READER,
                host,
                str(port),
                request,
                str(buffer),
            ],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # blocks until its stream's response head
        if line.strip() != b"attached":
            self.close()
            reason = line.strip().decode(errors="replace") or "the reader exited"
            raise ConnectionError(f"frozen-client reader failed to attach: {reason}")
        os.kill(self.process.pid, signal.SIGSTOP)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
            os.kill(self.process.pid, signal.SIGCONT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


async def make_ghost(
    kind: str, url: str, token: str | None, sandbox_id: str, pid: int, *, buffer: int = GHOST_BUFFER
) -> Ghost | None:
    """A client-side ghost of ``kind`` attached to ``pid`` (``None`` for the kinds the
    daemon makes itself or for ``none``)."""
    if kind == "leaky":
        return await asyncio.to_thread(LeakyClient, url, token, sandbox_id, pid, buffer=buffer)
    if kind == "frozen":
        return await asyncio.to_thread(FrozenClient, url, token, sandbox_id, pid, buffer=buffer)
    if kind in ("pause-snapshot", "none"):
        return None
    raise ValueError(f"ghost must be one of {', '.join(GHOST_KINDS)}")
