"""Connections no client can hold against the others: timeouts, a cap, and shedding.

uvicorn closes a connection only once it has answered a request and then waited
``timeout_keep_alive`` for the next; a connection that sends nothing, or a request head
one byte at a time, stays open for good, and each holds a file descriptor. Enough of them
— from any local process, no token needed — fill the daemon's descriptor limit, after
which ``accept`` fails and every client is locked out. So the HTTP protocol is wrapped
(:func:`guarded_protocol`, whichever of uvicorn's implementations runs) and every
connection has a deadline whenever it is not being answered:

- its first request head must be whole within ``header_timeout`` of the accept, and a
  later one within ``keepalive_timeout`` of the previous response (bytes that trickle in
  do not extend either: that is a slowloris);
- a request body must not pause longer than ``body_timeout``;
- a connection that has not presented the bearer token is closed as soon as its
  response (a 401) is sent.

A request being answered (a stream, above all) has no deadline here: the daemon's own
timers (``stall_timeout``, the keepalive frames) look after it.

:class:`ConnectionGuard` counts connections. When a new one takes the count past
``max_connections``, or its descriptor number reaches the file-descriptor budget's
``shed_at`` (:mod:`sandboxkit.daemon.fds`), idle connections that never presented the
token are closed to make room, oldest first. Only when none is left is the newcomer
itself refused: answered ``503 resource_exhausted`` and closed. An authenticated client
therefore gets through any number of idle or half-open connections. Authenticated idle
connections are not shed: their client may be writing a request to one right now (one
it could not safely resend), and it could do anything it likes anyway; they go by their
keep-alive deadline.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import msgspec

from sandboxkit.daemon.fds import FdBudget
from sandboxkit.errors import ResourceExhausted

__all__ = ["ConnectionGuard", "guarded_protocol"]


class ConnectionGuard:
    """The daemon's connections, their limits, and who is shed first."""

    def __init__(
        self,
        *,
        token: str | None,
        header_timeout: float,
        keepalive_timeout: float,
        body_timeout: float,
        max_connections: int,
        fds: FdBudget,
    ) -> None:
        self._expected = f"Bearer {token}".encode() if token else None
        self.header_timeout = header_timeout
        self.keepalive_timeout = keepalive_timeout
        self.body_timeout = body_timeout
        self.max_connections = max_connections
        self.fds = fds
        self.connections: dict[Any, None] = {}
        """Open connections (protocol objects), oldest first."""
        self.shed = 0
        """Idle connections closed to make room, so far."""
        self.refused = 0
        """Connections answered 503 on arrival, so far."""
        self.timed_out = 0
        """Connections closed by a deadline (head, body, keep-alive), so far."""

    def authorizes(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request with ``headers`` carries the token (or none is needed)."""
        if self._expected is None:
            return True
        for name, value in headers:
            if name == b"authorization":
                return secrets.compare_digest(value, self._expected)
        return False

    def admit(self, conn: Any, transport: asyncio.Transport) -> bool:
        """Count a new connection, shedding idle unauthenticated ones if it takes the
        daemon past its cap or into its descriptor reserve; ``False``: it was refused
        (answered 503)."""
        self.connections[conn] = None
        sock = transport.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        over_count = len(self.connections) - self.max_connections
        over_fds = fd - self.fds.shed_at + 1
        if over_count <= 0 and over_fds <= 0:
            return True
        want = 1
        if over_count > 0:
            want = max(want, over_count + self.max_connections // 16)
        if over_fds > 0:
            want = max(want, over_fds + self.fds.reserve // 4)
        if self._shed(conn, want) == 0 and (over_count > 0 or fd >= self.fds.refuse_at):
            self.refused += 1
            _refuse(transport, over_count > 0, self.max_connections, self.fds.limit)
            return False
        return True

    def forget(self, conn: Any) -> None:
        self.connections.pop(conn, None)

    def _shed(self, newcomer: Any, want: int) -> int:
        # Only connections that never presented the token: an authenticated client could
        # do anything it likes anyway, and its idle connection may be the one it is
        # writing a request to right now (a POST the client could not safely resend).
        # Those go by their keep-alive deadline.
        shed = 0
        for conn in list(self.connections):
            if shed >= want:
                break
            if conn is newcomer or conn.sk_authenticated:
                continue
            if conn.sk_idle() and conn.sk_close():
                shed += 1
        self.shed += shed
        return shed


def _refuse(transport: asyncio.Transport, by_count: bool, cap: int, fd_limit: int) -> None:
    if by_count:
        error = ResourceExhausted(
            f"the daemon has {cap} connections open; retry later", resource="connections", limit=cap
        )
    else:
        error = ResourceExhausted(
            f"the daemon is out of file descriptors (limit {fd_limit}); retry later",
            resource="file_descriptors",
            limit=fd_limit,
        )
    body = msgspec.json.encode(error.to_wire())
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    )
    transport.write(head + body)
    transport.close()


def guarded_protocol(
    base: type[asyncio.Protocol], guard: ConnectionGuard
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class ``base`` (h11 or httptools), with ``guard``'s
    deadlines, token check and shedding. Relies only on what both implementations share:
    ``transport``, ``cycle`` (with ``scope``, ``more_body``, ``response_complete``),
    ``data_received`` and ``on_response_complete``."""

    class Guarded(base):  # type: ignore[valid-type,misc]
        sk_authenticated = False
        _sk_timer: asyncio.TimerHandle | None = None
        _sk_seen: Any = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self.sk_authenticated = guard.authorizes([])
            if guard.admit(self, self.transport):
                self._sk_arm(guard.header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._sk_disarm()
            if self._sk_timer is not None:
                self._sk_timer.cancel()
                self._sk_timer = None
            guard.forget(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._sk_follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                self._sk_disarm()
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                self._sk_follow()  # a pipelined request already started
            elif not self.sk_authenticated:
                self.transport.close()  # answered (401): nothing more for it here
            else:
                self._sk_arm(guard.keepalive_timeout)

        def sk_idle(self) -> bool:
            """No request being answered."""
            cycle = self.cycle
            return cycle is None or bool(cycle.response_complete)

        def sk_close(self) -> bool:
            if self.transport is None or self.transport.is_closing():
                return False
            self.transport.close()
            return True

        def _sk_follow(self) -> None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                return  # waiting for a whole head: its deadline stands
            if cycle is not self._sk_seen:
                self._sk_seen = cycle
                if not self.sk_authenticated:
                    self.sk_authenticated = guard.authorizes(cycle.scope["headers"])
            if cycle.more_body:
                self._sk_arm(guard.body_timeout)
            else:
                self._sk_disarm()

        # One timer per connection that, when it fires, looks at the deadline and sleeps
        # on if it moved later: a request costs two attribute stores, not a timer
        # cancelled and made anew.
        _sk_deadline: float | None = None

        def _sk_arm(self, seconds: float) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + seconds
            self._sk_deadline = deadline
            timer = self._sk_timer
            if timer is not None and timer.when() <= deadline:
                return  # fires first, then sleeps on to the deadline
            if timer is not None:
                timer.cancel()
            self._sk_timer = loop.call_at(deadline, self._sk_expire)

        def _sk_disarm(self) -> None:
            self._sk_deadline = None

        def _sk_expire(self) -> None:
            self._sk_timer = None
            deadline = self._sk_deadline
            if deadline is None:
                return
            loop = asyncio.get_running_loop()
            if loop.time() < deadline:
                self._sk_timer = loop.call_at(deadline, self._sk_expire)
                return
            self._sk_deadline = None
            if self.sk_close():
                guard.timed_out += 1

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded
