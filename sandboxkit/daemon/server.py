"""Serving the daemon over HTTP with uvicorn: in the foreground (``sandboxkit serve``) or
on a background thread (tests, benchmarks, an in-process daemon)."""

from __future__ import annotations

import asyncio
import atexit
import ipaddress
import math
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from sandboxkit._version import __version__
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.envd import EnvdServer
from sandboxkit.daemon.fds import FdBudget, raise_fd_limit
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.http import create_app
from sandboxkit.daemon.http.connections import ConnectionGuard, guarded_protocol
from sandboxkit.daemon.http.prompt_server import PromptServer
from sandboxkit.daemon.listen import bind_or_say
from sandboxkit.daemon.tcp_peer import SEND_BUFFER
from sandboxkit.statefile import DaemonState, remove_state, write_state

__all__ = ["WORKER_THREADS", "DaemonServer", "UnsafeBind", "is_loopback"]

WORKER_THREADS: Final = "sandboxkit-daemon-worker"
"""The name of the threads a daemon's blocking work runs in (each with a number)."""


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop the daemon serves on: uvloop for ``uvloop``, or for ``auto`` when it is
    installed (Python 3.11+); ``None``: asyncio's own."""
    if choice not in ("auto", "asyncio", "uvloop"):
        raise ValueError(f"event_loop must be auto, asyncio or uvloop, not {choice!r}")
    if choice == "asyncio" or sys.version_info < (3, 11):
        return None
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


_BACKLOG = 4096
"""Connections the kernel queues for accept (capped by ``net.core.somaxconn``): a burst
beyond it waits for SYN retransmits (1 s, then 3 s), whoever sent it."""


class UnsafeBind(ValueError):
    """Refused: no bearer token on an address other machines can reach."""


def is_loopback(host: str) -> bool:
    """True if every address ``host`` names is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


class _Server(PromptServer):
    """uvicorn's server (stopping when told), ending the host's streams before it waits
    for connections."""

    def __init__(self, config: uvicorn.Config, daemon: DaemonServer) -> None:
        super().__init__(config)
        self._daemon = daemon

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self._daemon._on_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            # Open streams would otherwise hold graceful shutdown for its whole timeout.
            await self._daemon.host.close()
            await super().shutdown(sockets)
        finally:
            # uvicorn re-raises a captured SIGTERM/SIGINT as soon as serving ends, which
            # ends the process before DaemonServer.serve's ``finally`` can run.
            self._daemon._unpublish()


class DaemonServer:
    """One daemon: a :class:`Host`, its HTTP app, a loopback socket and a bearer token."""

    def __init__(
        self,
        config: DaemonConfig | None = None,
        *,
        bind: str = "127.0.0.1",
        port: int = 0,
        token: str | None = "",
        state_path: Path | None = None,
        allow_unauthenticated_network: bool = False,
        envd_port: int | None = None,
    ) -> None:
        """``token=""`` generates a random token; ``token=None`` disables auth, which is
        refused (:class:`UnsafeBind`) on a non-loopback ``bind`` unless
        ``allow_unauthenticated_network``: anyone who can reach it could run commands."""
        if token is None and not is_loopback(bind) and not allow_unauthenticated_network:
            raise UnsafeBind(
                f"refusing to serve on {bind} without a bearer token: anyone who can reach "
                "it could run commands (to do it anyway: "
                "--i-understand-anyone-can-run-commands)"
            )
        self.config = config or DaemonConfig()
        self.token = secrets.token_urlsafe(24) if token == "" else token
        # Idle connections and processes share one descriptor limit (see fds).
        raise_fd_limit()
        self.connections = ConnectionGuard(
            token=self.token,
            header_timeout=self.config.header_timeout,
            keepalive_timeout=self.config.keepalive_timeout,
            body_timeout=self.config.body_timeout,
            max_connections=self.config.max_connections,
            fds=FdBudget.current(self.config.fd_reserve),
        )
        if self.config.http not in HTTP_PROTOCOLS:
            raise ValueError(
                f"http must be one of {sorted(HTTP_PROTOCOLS)}, not {self.config.http!r}"
            )
        protocol = guarded_protocol(
            import_from_string(HTTP_PROTOCOLS[self.config.http]), self.connections
        )
        self.state_path = state_path
        # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on an accepted socket only when
        # its ``proto`` says TCP. Without it Nagle holds uvicorn's second write (the body)
        # until the client's delayed ACK, and every request takes ~44 ms.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it (Linux, BSD, macOS).
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        bind_or_say(self._sock, bind, port, "the API")
        self._sock.listen(_BACKLOG)
        self._sock.setblocking(False)
        self.bind, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.bind}:{self.port}"
        self.host = Host(self.config)
        # The envd-compatible endpoint for the e2b SDK (off unless asked for): its own port,
        # under the same deadlines and cap. Its clients authenticate in paths and their own
        # headers (envd/app.py), so none is taken for an unauthenticated idler to shed.
        self.envd_connections = ConnectionGuard(
            token=None,
            header_timeout=self.config.header_timeout,
            keepalive_timeout=self.config.keepalive_timeout,
            body_timeout=self.config.body_timeout,
            max_connections=self.config.max_connections,
            fds=self.connections.fds,
        )
        self.envd = (
            EnvdServer(
                self.host,
                bind=self.bind,
                port=envd_port,
                token=self.token,
                http=guarded_protocol(
                    import_from_string(HTTP_PROTOCOLS[self.config.http]), self.envd_connections
                ),
            )
            if envd_port is not None
            else None
        )
        self._server = _Server(
            uvicorn.Config(
                create_app(self.host, self.token),
                log_level="warning",
                access_log=False,
                lifespan="on",
                loop="asyncio",  # the loop is chosen by run() (see event_loop_factory)
                http=protocol,
                # The guard's deadline is the exact one; uvicorn's own is a backstop.
                timeout_keep_alive=max(1, math.ceil(self.config.keepalive_timeout)),
                # No proxy in front: the peer is who connected (a consumer's ``peer``), not
                # what an X-Forwarded-For header claims; and one middleware less per request.
                proxy_headers=False,
                backlog=_BACKLOG,
                timeout_graceful_shutdown=max(1, int(self.config.shutdown_drain)),
            ),
            self,
        )
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop the daemon serves on, once it does."""

    # -- foreground ------------------------------------------------------------------

    def run(self) -> None:
        """Serve until SIGINT/SIGTERM (from the main thread) or :meth:`stop`."""
        factory = event_loop_factory(self.config.event_loop)
        if factory is None:
            asyncio.run(self.serve())
        else:
            with asyncio.Runner(loop_factory=factory) as runner:  # type: ignore[attr-defined,unused-ignore]
                runner.run(self.serve())

    async def serve(self) -> None:
        """Serve on the running loop until asked to stop."""
        # The threads the daemon's blocking work runs in (off_loop) say whose
        # they are: an in-process daemon's beside its host's own (shut down with the loop).
        self.loop = asyncio.get_running_loop()
        self.loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix=WORKER_THREADS))
        envd = asyncio.ensure_future(self.envd.serve()) if self.envd else None
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            if envd is not None and self.envd is not None:
                self.envd.stop()
                await asyncio.gather(envd, return_exceptions=True)
            self._unpublish()
            self._sock.close()

    def _unpublish(self) -> None:
        if self.state_path is not None:
            remove_state(self.state_path, os.getpid())

    def _on_started(self) -> None:
        if self.state_path is not None:
            write_state(
                self.state_path,
                DaemonState(self.url, os.getpid(), self.token or "", time.time(), __version__),
            )
        self._started.set()

    # -- background thread -------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> DaemonServer:
        """Serve on a background thread; returns once the daemon accepts requests."""

        def target() -> None:
            try:
                self.run()
            except BaseException as exc:  # surfaced by start()/stop()
                self._error = exc
                self._started.set()

        self._thread = threading.Thread(target=target, name="sandboxkit-daemon", daemon=True)
        self._thread.start()
        # An in-process daemon dies with its owner; its sandbox processes must not outlive it.
        atexit.register(self.stop)
        if not self._started.wait(timeout) or self._error is not None:
            raise RuntimeError(f"daemon did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the server to exit (ending streams, killing sandboxes) and wait for it."""
        atexit.unregister(self.stop)
        self._server.should_exit = True
        self._server.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError("daemon thread did not stop in time")

    def __enter__(self) -> DaemonServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
