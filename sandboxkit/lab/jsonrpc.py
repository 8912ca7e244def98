"""A JSON-RPC 2.0 client for a process in a sandbox: requests through a stdin session,
responses from the process's output stream, matched by id, each with a deadline.

This is how the lab plays an MCP client talking to a stdio server: ``refresh`` after a
reattach is three list requests, and a wedged output stream shows up as
:class:`RpcTimeout` — a definite answer after the deadline, never an endless wait.

Everything runs on the caller's event loop: the output callback, the line splitter and
the futures of pending requests. The client starts no task of its own; the output stream
and the stdin session it opens are cancelled and awaited by :meth:`JsonRpcClient.close`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sandboxkit._compat import within
from sandboxkit.client.stdin import StdinSession

if TYPE_CHECKING:
    from sandboxkit.client.commands import AsyncCommandHandle
    from sandboxkit.client.sandbox import AsyncSandbox
    from sandboxkit.client.stream import Gap

__all__ = ["JsonRpcClient", "RpcClosed", "RpcError", "RpcTimeout", "refresh"]

REFRESH_METHODS = ("tools/list", "resources/list", "prompts/list")
"""What an MCP client asks for after a reattach."""

_MAX_LINE = 64 << 20
"""A line longer than this (no newline yet) is dropped as stray, bounding memory."""


class RpcTimeout(TimeoutError):
    """No response to a request arrived within its deadline."""

    def __init__(self, method: str, id: int, deadline: float) -> None:
        super().__init__(f"no response to {method} (id {id}) within {deadline:g}s")
        self.method = method
        self.id = id
        self.deadline = deadline


class RpcError(Exception):
    """The server answered a request with a JSON-RPC error."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"JSON-RPC error {code}: {message}")
        self.code = code
        self.message = message
        self.data = data


class RpcClosed(ConnectionError):
    """The client was closed, or the process's output stream ended (the process exited
    or the stream was disconnected), before a response arrived."""


class JsonRpcClient:
    """Talks JSON-RPC to process ``pid`` of ``sbx`` over newline-delimited JSON.

    Requests are written through an exactly-once stdin session
    (``sbx.commands.stdin_session(pid, **stdin_options)``); responses are read from the
    process's output stream, followed from ``cursor`` (``None``: the oldest retained
    output). Ids start at a random base and increase, so responses an earlier client
    left in the log are never mistaken for this client's (they count as stray lines).

    Attributes: ``first_byte_at`` (monotonic time of the first stdout byte after
    :meth:`start`), ``bytes_received``, ``stray_lines`` (non-JSON lines, responses with
    unknown ids), ``notifications`` (the last ``max_notifications`` server-initiated
    messages), ``stdin_restarts`` (stdin sessions replaced after they failed, e.g. on a
    paused sandbox), ``last_stdin_error`` and ``gaps`` (output this reader was told it
    will not get: a lab policy that delivers new output only skips what came before, and
    the experiment counts those itself, so no warning is raised for them).
    """

    def __init__(
        self,
        sbx: AsyncSandbox,
        pid: int,
        *,
        cursor: int | None = None,
        stdin_options: dict[str, Any] | None = None,
        first_id: int | None = None,
        max_notifications: int = 1000,
    ) -> None:
        self.sbx = sbx
        self.pid = pid
        self.cursor = cursor
        self.stdin_options = dict(stdin_options or {})
        self.max_notifications = max_notifications
        self.first_byte_at: float | None = None
        self.started_at: float | None = None
        self.bytes_received = 0
        self.stray_lines = 0
        self.responses = 0
        self.notifications: list[dict[str, Any]] = []
        self.stdin_restarts = 0
        self.gaps: list[Gap] = []
        self.last_stdin_error: BaseException | None = None
        self._next_id = first_id if first_id is not None else secrets.randbelow(1 << 30) + 1
        self._pending: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        self._buffer: list[str] = []
        self._buffered = 0
        self._handle: AsyncCommandHandle | None = None
        self._session: StdinSession | None = None
        self._ended: BaseException | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Follow the process's stdout and open the stdin session."""
        if self._closed:
            raise RpcClosed("the client is closed")
        if self._handle is not None:
            raise RuntimeError("the client is already started")
        self.started_at = time.monotonic()
        # on_end: a callback when the stream ends (exit, error or disconnect), not a
        # watcher task, so nothing is left to cancel.
        self._handle = await self.sbx.commands.connect(
            self.pid,
            self.cursor,
            on_stdout=self.feed,
            lines=False,
            on_end=self._on_stream_done,
            on_gap=self.gaps.append,
        )
        self._session = self._open_session()

    async def close(self) -> None:
        """Stop following output and abort the stdin session; pending requests fail with
        :class:`RpcClosed`. Idempotent; leaves no task behind."""
        if self._closed:
            return
        self._closed = True
        self._fail_pending(RpcClosed("the client was closed"))
        handle, self._handle = self._handle, None
        session, self._session = self._session, None
        try:
            if handle is not None:
                await handle.disconnect()
        finally:
            if session is not None:
                await session.abort()

    async def __aenter__(self) -> JsonRpcClient:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def pending(self) -> int:
        """Requests waiting for their response."""
        return len(self._pending)

    @property
    def handle(self) -> AsyncCommandHandle | None:
        """The output stream's handle (``None`` before start and after close)."""
        return self._handle

    # -- requests --------------------------------------------------------------------

    async def request(
        self, method: str, params: dict[str, Any] | None = None, *, deadline: float = 5.0
    ) -> Any:
        """Send a request and return its result.

        Raises :class:`RpcTimeout` when no response arrives within ``deadline`` seconds
        (writing the request counts against the deadline), :class:`RpcError` for an
        error response, and the stream's error (or :class:`RpcClosed`) if the output
        stream ends or the client is closed first.
        """
        self._check_open()
        request_id = self._next_id
        self._next_id += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (method, future)
        try:
            return await within(self._roundtrip(message, future), deadline)
        except TimeoutError:
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise  # the stream's own error happened to be a TimeoutError
            raise RpcTimeout(method, request_id, deadline) from None
        finally:
            self._pending.pop(request_id, None)
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # mark retrieved: we may have stopped waiting for it

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        """Send a notification (no id, no response)."""
        self._check_open()
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        await self._send(message)

    async def _roundtrip(self, message: dict[str, Any], future: asyncio.Future[Any]) -> Any:
        await self._send(message)
        return await future

    async def _send(self, message: dict[str, Any]) -> None:
        line = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        session = self._session
        if session is None:
            raise RpcClosed("the client is not started or is closed")
        try:
            await session.write(line)
            return
        except Exception as exc:
            # write() raises only when the session already died on an earlier batch (for
            # example with SandboxPaused while the sandbox was paused). Its unacked lines
            # are dropped (their requests time out); carry on in a fresh session.
            if self._closed:
                raise RpcClosed("the client was closed") from exc
            self.last_stdin_error = exc
        if self._session is session:
            self.stdin_restarts += 1
            self._session = self._open_session()
            await session.abort()
        if self._session is None:
            raise RpcClosed("the client was closed")
        await self._session.write(line)

    def _open_session(self) -> StdinSession:
        return self.sbx.commands.stdin_session(self.pid, **self.stdin_options)

    def _check_open(self) -> None:
        if self._closed:
            raise RpcClosed("the client is closed")
        if self._handle is None:
            raise RuntimeError("call start() first")
        if self._ended is not None:
            raise RpcClosed(f"the output stream of process {self.pid} ended") from self._ended

    # -- output ----------------------------------------------------------------------

    def feed(self, text: str) -> None:
        """Take a piece of the process's stdout (the stream's ``on_stdout`` callback):
        split it into lines, which may arrive split across pieces or several per piece,
        and route each message."""
        if not text:
            return
        if self.first_byte_at is None:
            self.first_byte_at = time.monotonic()
        self.bytes_received += len(text.encode("utf-8", "surrogatepass"))
        start = 0
        while True:
            newline = text.find("\n", start)
            if newline < 0:
                break
            self._buffer.append(text[start:newline])
            line = "".join(self._buffer)
            self._buffer.clear()
            self._buffered = 0
            start = newline + 1
            self._line(line)
        rest = text[start:]
        if rest:
            self._buffer.append(rest)
            self._buffered += len(rest)
            if self._buffered > _MAX_LINE:
                self._buffer.clear()
                self._buffered = 0
                self.stray_lines += 1

    def _line(self, line: str) -> None:
        if not line.strip():
            return
        try:
            message = json.loads(line)
        except ValueError:
            self.stray_lines += 1
            return
        if not isinstance(message, dict):
            self.stray_lines += 1
            return
        if isinstance(message.get("method"), str):
            # Server-initiated: a notification, or a request we do not answer.
            self.notifications.append(message)
            if len(self.notifications) > self.max_notifications:
                del self.notifications[: len(self.notifications) - self.max_notifications]
            return
        request_id = message.get("id")
        entry = self._pending.get(request_id) if isinstance(request_id, int) else None
        if entry is None or entry[1].done():
            self.stray_lines += 1
            return
        future = entry[1]
        self.responses += 1
        error = message.get("error")
        if error is not None:
            if isinstance(error, dict):
                future.set_exception(
                    RpcError(
                        int(error.get("code", 0)),
                        str(error.get("message", "")),
                        error.get("data"),
                    )
                )
            else:
                future.set_exception(RpcError(0, str(error)))
        elif "result" in message:
            future.set_result(message["result"])
        else:
            self.responses -= 1
            self.stray_lines += 1

    def _on_stream_done(self, handle: AsyncCommandHandle) -> None:
        error: BaseException
        if handle.error is not None:
            error = handle.error
        elif handle.stream.ended:
            error = RpcClosed(
                f"process {self.pid} exited (code {handle.exit_code}) before responding"
            )
        else:
            error = RpcClosed(f"the output stream of process {self.pid} was closed")
        if self._ended is None:
            self._ended = error
        self._fail_pending(error)

    def _fail_pending(self, error: BaseException) -> None:
        for _, future in list(self._pending.values()):
            if not future.done():
                future.set_exception(error)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "ended" if self._ended else "open"
        return f"<JsonRpcClient pid={self.pid} {state} pending={len(self._pending)}>"


async def refresh(client: JsonRpcClient, deadline: float) -> list[Any]:
    """An MCP client's refresh after a reattach: ``tools/list``, ``resources/list`` and
    ``prompts/list``, one after another, each within ``deadline``; their results."""
    return [await client.request(method, {}, deadline=deadline) for method in REFRESH_METHODS]
