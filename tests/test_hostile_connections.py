"""Hostile connections cannot lock a healthy client out (issue 19, point 3).

Each test runs ``sandboxkit serve`` as a child with a lowered file-descriptor limit
(soft = hard, so the daemon cannot raise it), which makes exhausting it cheap: a few
hundred silent or partial-header connections, or a few dozen live processes. Throughout
each attack an authenticated client's ``/health`` must answer; what it takes is printed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from freezer_support import cli_env
from support import end_process

from sandboxkit import Sandbox
from sandboxkit.errors import ResourceExhausted

FD_LIMIT = 256
HEADER_TIMEOUT = 1.0


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    url: str
    token: str


def _limit_fds(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


@contextlib.contextmanager
def _served(tmp: Path, *args: str, fd_limit: int = FD_LIMIT) -> Iterator[Daemon]:
    state_file = tmp / "daemon.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state_file), *args],
        env=cli_env(state_file),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_limit_fds(fd_limit),
    )
    try:
        deadline = time.monotonic() + 30
        while not state_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("sandboxkit serve did not publish its state file")
            time.sleep(0.02)  # sleep-ok: poll interval
        published = json.loads(state_file.read_text())
        host, port = published["url"].removeprefix("http://").rsplit(":", 1)
        yield Daemon(proc, host, int(port), published["url"], published["token"])
    finally:
        end_process(proc)


def _health(daemon: Daemon, timeout: float = 5.0) -> float:
    """Seconds an authenticated ``GET /health`` takes on a new connection."""
    start = time.monotonic()
    request = (
        f"GET /health HTTP/1.1\r\nHost: {daemon.host}\r\n"
        f"Authorization: Bearer {daemon.token}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((daemon.host, daemon.port), timeout=timeout) as sock:
        sock.settimeout(max(0.01, timeout - (time.monotonic() - start)))
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(4096)
            if not data:
                break
            answer += data
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return time.monotonic() - start


class Attackers:
    """Up to ``count`` connections that send ``opening`` (maybe nothing) and then stay
    silent; those the daemon closes are counted and replaced by ``top_up``."""

    def __init__(self, daemon: Daemon, count: int, opening: bytes = b"", batch: int = 0) -> None:
        self.daemon = daemon
        self.count = count
        self.opening = opening
        self.batch = batch  # at most this many new connections per top_up (0: no bound)
        self.socks: list[socket.socket] = []
        self.closed_by_daemon = 0

    def top_up(self) -> None:
        self.reap()
        goal = self.count if not self.batch else min(self.count, len(self.socks) + self.batch)
        while len(self.socks) < goal:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((self.daemon.host, self.daemon.port))
            if code not in (0, errno.EINPROGRESS):
                sock.close()
                break
            if self.opening:
                with contextlib.suppress(OSError):
                    sock.send(self.opening)
            self.socks.append(sock)

    def reap(self) -> None:
        """Drop the connections the daemon closed (readable with EOF, or reset)."""
        if not self.socks:
            return
        poller = select.poll()
        by_fd = {s.fileno(): s for s in self.socks}
        for fd in by_fd:
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        for fd, _ in poller.poll(0):
            sock = by_fd[fd]
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self.socks.remove(sock)
                sock.close()
                self.closed_by_daemon += 1

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks.clear()


def _attack(daemon: Daemon, attackers: Attackers, seconds: float) -> list[float]:
    """/health latencies while ``attackers`` keep their connections open for ``seconds``."""
    latencies: list[float] = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            attackers.top_up()
            latencies.append(_health(daemon))
    finally:
        attackers.close()
    return latencies


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "opening",
    [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"],
    ids=["silent", "partial-header"],
)
def test_a_connection_flood_does_not_lock_out_a_healthy_client(
    tmp_path: Path, opening: bytes
) -> None:
    ticker = (
        "import time\nwhile True:\n    print(time.time(), flush=True)\n"
        "    time.sleep(0.05)"  # sleep-ok: the child's pace
    )
    arrivals: list[float] = []
    with (
        _served(tmp_path, "--header-timeout", str(HEADER_TIMEOUT)) as daemon,
        Sandbox.create(url=daemon.url, token=daemon.token) as sbx,
    ):
        # A live stream, attached before the attack: its lines must keep coming.
        handle = sbx.commands.run(
            f"{sys.executable} -c '{ticker}'",
            background=True,
            on_stdout=lambda _: arrivals.append(time.monotonic()),
        )
        deadline = time.monotonic() + 10
        while len(arrivals) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # sleep-ok: poll interval
        start = time.monotonic()
        attackers = Attackers(daemon, 2 * FD_LIMIT, opening)
        latencies = _attack(daemon, attackers, 3 * HEADER_TIMEOUT)
        end = time.monotonic()
        assert latencies, "no /health got through"
        assert attackers.closed_by_daemon > FD_LIMIT
        # The pressure over, the daemon serves as before.
        assert _health(daemon) < 5.0
        handle.kill()
    during = [t for t in arrivals if start <= t <= end]
    assert during, "the live stream delivered nothing during the attack"
    gaps = [b - a for a, b in zip([start, *during], [*during, end], strict=True)]
    print(
        f"{opening!r}: {len(latencies)} /health, max {max(latencies) * 1000:.0f} ms; "
        f"live stream: {len(during)} lines, longest gap {max(gaps) * 1000:.0f} ms; "
        f"{attackers.closed_by_daemon} attacker connections shed or timed out"
    )


@pytest.mark.timeout(60)
def test_at_the_cap_idle_unauthenticated_connections_are_shed_and_authenticated_kept(
    tmp_path: Path,
) -> None:
    cap = 50
    args = ("--max-connections", str(cap), "--keepalive-timeout", "30", "--header-timeout", "30")
    with _served(tmp_path, *args, fd_limit=4096) as daemon:
        request = (
            f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {daemon.token}\r\n\r\n"
        ).encode()

        def ask(sock: socket.socket) -> bytes:
            sock.sendall(request)
            answer = b""
            while b"}" not in answer:
                data = sock.recv(4096)
                if not data:
                    break
                answer += data
            return answer

        with socket.create_connection((daemon.host, daemon.port), timeout=10) as kept:
            assert ask(kept).startswith(b"HTTP/1.1 200")
            # Now idle, authenticated; then 4x the cap of silent connections arrive.
            attackers = Attackers(daemon, 4 * cap)
            try:
                attackers.top_up()
                assert _health(daemon) < 5.0
                deadline = time.monotonic() + 10
                while attackers.closed_by_daemon < 3 * cap and time.monotonic() < deadline:
                    attackers.top_up()
                assert attackers.closed_by_daemon >= 3 * cap, attackers.closed_by_daemon
                # The authenticated connection was kept: it carries another request.
                assert ask(kept).startswith(b"HTTP/1.1 200")
            finally:
                attackers.close()


@pytest.mark.timeout(60)
def test_a_slowloris_connection_is_closed_after_the_header_timeout(tmp_path: Path) -> None:
    with _served(tmp_path, "--header-timeout", str(HEADER_TIMEOUT)) as daemon:
        sock = socket.create_connection((daemon.host, daemon.port), timeout=5)
        with sock:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            opened = time.monotonic()
            sock.settimeout(0.2)
            closed_after = None
            while time.monotonic() - opened < 10 * HEADER_TIMEOUT:
                with contextlib.suppress(OSError):
                    sock.send(b"X")  # one header byte at a time: never a whole head
                try:
                    if sock.recv(4096) == b"":
                        closed_after = time.monotonic() - opened
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed_after = time.monotonic() - opened
                    break
        assert closed_after is not None, "a slowloris connection was never closed"
        assert closed_after >= 0.8 * HEADER_TIMEOUT
    print(f"slowloris closed {closed_after:.2f}s after it opened")


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the daemon closes ``sock`` (sending ``trickle`` a byte at a time
    meanwhile), or ``None`` if it stays open ``seconds``."""
    opened = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - opened < seconds:
        if trickle:
            with contextlib.suppress(OSError):
                sock.send(trickle[:1])
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - opened
        if data == b"":
            return time.monotonic() - opened
    return None


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_stalled_request_body_is_abandoned_after_the_body_timeout(tmp_path: Path) -> None:
    with _served(tmp_path, "--body-timeout", "1") as daemon:
        with socket.create_connection((daemon.host, daemon.port), timeout=5) as sock:
            sock.sendall(
                b"POST /sandboxes HTTP/1.1\r\nHost: x\r\n"
                + f"Authorization: Bearer {daemon.token}\r\n".encode()
                + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            closed_after = _closed_within(sock, 10.0)
        assert closed_after is not None, "a stalled body held its connection"
        assert _health(daemon) < 5.0
    print(f"stalled body: connection closed {closed_after:.2f}s after it stalled")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_kept_alive_connection_trickling_its_next_head_is_closed(tmp_path: Path) -> None:
    with _served(tmp_path, "--keepalive-timeout", "1") as daemon:
        with socket.create_connection((daemon.host, daemon.port), timeout=5) as sock:
            request = (
                f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {daemon.token}\r\n\r\n"
            ).encode()
            sock.sendall(request)
            answer = b""
            while b"}" not in answer:  # the whole (small) JSON answer
                answer += sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            # Authenticated and kept alive: now a slowloris on the next request head.
            closed_after = _closed_within(sock, 10.0, trickle=b"G")
        assert closed_after is not None, "a trickled second head held its connection"
    print(f"trickled second head: connection closed {closed_after:.2f}s after the response")


@pytest.mark.timeout(60)
def test_an_unauthenticated_request_gets_401_and_its_connection_closed(tmp_path: Path) -> None:
    # A long keep-alive: the close must come from the missing token, not from idling.
    with _served(tmp_path, "--keepalive-timeout", "60") as daemon:
        with socket.create_connection((daemon.host, daemon.port), timeout=30) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            sent = time.monotonic()
            answer = b""
            while True:
                data = sock.recv(4096)
                if not data:
                    break
                answer += data
            closed_after = time.monotonic() - sent
        assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
        assert closed_after < 20, closed_after  # at once, not after the keep-alive
    print(f"unauthenticated connection closed {closed_after * 1000:.0f} ms after its request")


_SLEEP = "sleep 60"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fd_exhaustion_by_processes_is_a_typed_503_and_passes(tmp_path: Path) -> None:
    with _served(tmp_path) as daemon, Sandbox.create(url=daemon.url, token=daemon.token) as sbx:
        started = 0
        with pytest.raises(ResourceExhausted) as exhausted:
            for _ in range(FD_LIMIT):
                sbx.commands.run(_SLEEP, background=True)
                started += 1
        assert exhausted.value.resource == "file_descriptors"
        assert 0 < started < FD_LIMIT
        health = _health(daemon)  # still answering, on a new connection
        for process in sbx.commands.list():
            sbx.commands.kill(process.pid)
        # The pressure over, processes start again.
        handle = sbx.commands.run("echo back", background=True)
        assert handle.wait().stdout == "back\n"
    print(f"{started} processes before ResourceExhausted; /health then {health * 1000:.0f} ms")


def test_the_daemon_raises_its_soft_fd_limit_to_the_hard_limit(tmp_path: Path) -> None:
    def soft_low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, 2 * FD_LIMIT))

    state_file = tmp_path / "daemon.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state_file)],
        env=cli_env(state_file),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=soft_low,
    )
    try:
        deadline = time.monotonic() + 30
        while not state_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.02)  # sleep-ok: poll interval
        soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        assert (soft, hard) == (2 * FD_LIMIT, 2 * FD_LIMIT)
    finally:
        end_process(proc)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ten_thousand_idle_connections_leave_authenticated_requests_served(
    tmp_path: Path,
) -> None:
    count = 10_000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < count + 512:
        pytest.skip(f"this test needs {count + 512} file descriptors (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (count + 512, hard))
    try:
        with _served(tmp_path, fd_limit=hard) as daemon:
            # Opened a thousand at a time (the kernel's accept queue holds 4,096: a
            # burst of 10,000 SYNs is another attack), then kept open and reopened.
            attackers = Attackers(daemon, count, batch=1_000)
            latencies = _attack(daemon, attackers, 5.0)
        assert latencies
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    worst = ", ".join(f"{x * 1000:.0f}" for x in sorted(latencies)[-5:])
    print(
        f"10,000 idle: {len(latencies)} /health, slowest (ms): {worst}; "
        f"first {latencies[0] * 1000:.0f} ms"
    )


@pytest.mark.timeout(60)
def test_the_envd_endpoint_closes_a_slowloris_connection_too(tmp_path: Path) -> None:
    """The e2b SDK's port is the daemon's as much as its API: the same deadlines hold."""
    envd_port = _free_port()
    with _served(
        tmp_path, "--header-timeout", str(HEADER_TIMEOUT), "--envd", str(envd_port)
    ) as daemon:
        sock = socket.create_connection((daemon.host, envd_port), timeout=5)
        with sock:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            closed_after = _closed_within(sock, 10 * HEADER_TIMEOUT, trickle=b"X" * 1000)
        assert closed_after is not None, "a slowloris connection to envd was never closed"
        assert closed_after >= 0.8 * HEADER_TIMEOUT
        assert _health(daemon) < 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
