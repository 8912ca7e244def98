"""envd's ``process.Process`` service on sandboxkit's daemon core.

``Start`` and ``Connect`` streams are served by an ordinary :class:`Consumer` of the
process's output log: its own cursor and its own sender task, so a reader that stalls (or
a pause-snapshot ghost) never holds up another reader or the process. The consumer's
sandboxkit frames are translated to envd events on the way out (:class:`_EventSink`).

``Connect`` replays from the first output by default, so a reattached reader gets every
byte still in the log (envd itself would send only new output); the header
``X-Sandboxkit-Cursor`` (a seq, or ``head``) chooses where to start instead.

envd has no event for lost output, so a gap (output evicted before this reader got to it,
or a cursor the lab's fan-out did not honour) reaches the SDK as a line of its own where
the loss is, on stderr (on the terminal for a pty process): :func:`gap_line`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import signal as signals
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sandboxkit.daemon.consumers import Consumer
from sandboxkit.daemon.envd import messages as m
from sandboxkit.daemon.envd.connect import (
    MAX_MESSAGE,
    STREAM_CONTENT_TYPE,
    ConnectError,
    EnvelopeReader,
    decode,
    end_stream,
    envelope,
    from_sandboxkit,
)
from sandboxkit.daemon.envd.streaming import StreamBody, StreamGuards
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ManagedProcess, ProcessSpec
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.errors import SandboxkitError
from sandboxkit.vocab import ENVD_ROLE
from sandboxkit.wire import Frame, FrameDecoder, FrameKind

__all__ = ["ProcessService", "RpcService"]

T = TypeVar("T")
SandboxLookup = Callable[[Request, bool], Awaitable[ManagedSandbox]]
"""Finds the sandbox a request is for (``True``: it must be running)."""

ROLE = ENVD_ROLE
"""The consumer role of envd streams, as panels and metrics show it."""

_SIGNALS = {
    "SIGNAL_SIGKILL": signals.SIGKILL,
    "SIGNAL_SIGTERM": signals.SIGTERM,
    int(signals.SIGKILL): signals.SIGKILL,
    int(signals.SIGTERM): signals.SIGTERM,
}


def _event(name: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"event": {name: body}}


def end_event(exit_code: int | None) -> dict[str, Any]:
    """envd's end event. As envd reports it, a process ended by a signal has exit code
    -1, ``exited`` false, and the signal in ``status`` and ``error`` (``signal: killed``)."""
    code = -1 if exit_code is None else exit_code
    if code >= 0:
        return _event("end", {"exitCode": code, "exited": True, "status": f"exit status {code}"})
    try:
        name = _SIGNAL_NAMES.get(-code) or signals.Signals(-code).name.lower().removeprefix("sig")
    except ValueError:
        name = str(-code)
    status = f"signal: {name}"
    return _event("end", {"exitCode": -1, "exited": False, "status": status, "error": status})


_SIGNAL_NAMES = {int(signals.SIGKILL): "killed", int(signals.SIGTERM): "terminated"}


GAP_LINE = "[sandboxkit: {bytes_lost} bytes of output lost here (cursor {cursor}–{first})]"
"""The line an envd reader gets where output was lost: the SDK's ``on_stderr`` (``on_data``
for a pty) sees it, and ``result.stderr`` keeps it."""


def gap_line(meta: dict[str, Any]) -> bytes:
    """The text of a gap frame for an envd reader, a line of its own."""
    text = GAP_LINE.format(
        bytes_lost=meta.get("bytes_lost"),
        cursor=meta.get("cursor"),
        first=meta.get("first_available"),
    )
    if meta.get("reason") == "not_replayed":
        text = text[:-1] + ", not replayed by the sandbox's lab fan-out]"
    return ("\n" + text + "\n").encode()


class _EventSink:
    """A consumer's transport that speaks envd: sandboxkit frames in, envd events out."""

    def __init__(self, out: StreamBody, pid: int, pty: bool = False) -> None:
        self._out = out
        self._pid = pid
        self._gap_stream = "pty" if pty else "stderr"
        self._decoder = FrameDecoder()
        self.tail: bytes | None = None
        """The end-of-stream envelope once the consumer said how the stream ends."""
        self.closed = asyncio.Event()

    async def send(self, data: bytes) -> None:
        for frame in self._decoder.feed(data):
            event = self._translate(frame)
            if event is not None:
                await self._out.write(envelope(event))

    def _translate(self, frame: Frame) -> dict[str, Any] | None:
        kind = frame.kind
        if kind is FrameKind.START:
            return _event("start", {"pid": self._pid})
        if kind is FrameKind.DATA:
            stream = frame.meta.get("stream", "stdout")
            name = stream if stream in ("stdout", "stderr", "pty") else "stdout"
            return _event("data", {name: base64.b64encode(frame.payload).decode()})
        if kind is FrameKind.END:
            self.tail = end_stream()
            return end_event(frame.meta.get("exit_code"))
        if kind is FrameKind.ERROR:
            self.tail = end_stream(from_sandboxkit(frame.error()))
        if kind is FrameKind.GAP:  # envd has no such event: a line where the loss is
            line = base64.b64encode(gap_line(frame.meta)).decode()
            return _event("data", {self._gap_stream: line})
        # keepalive: the response sends its own at the interval the client asked for.
        return None

    async def close(self) -> None:
        self.closed.set()


class EventStream(Response):
    """A ``Start``/``Connect`` response: one consumer's output as envd events, with
    keepalives every ``keepalive`` seconds (``None``: none) and a ``deadline``."""

    def __init__(
        self,
        host: Host,
        consumer: Consumer,
        keepalive: float | None,
        deadline: float | None,
        process: ManagedProcess | None = None,
    ) -> None:
        super().__init__(media_type=STREAM_CONTENT_TYPE)
        self.host = host
        self.consumer = consumer
        self.keepalive = keepalive
        self.deadline = deadline
        self.process = process
        """For ``Start``: the process that the same deadline kills. Its timer starts before
        this stream's, so its end can arrive first; the call still ended by its deadline."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", STREAM_CONTENT_TYPE.encode())],
            }
        )
        out = StreamBody(send)
        source = self.consumer.source
        sink = _EventSink(out, source.pid, pty=getattr(getattr(source, "spec", None), "pty", False))
        stream = self.host.start_stream(self.consumer, sink)
        keepalive = envelope(_event("keepalive", {}))
        guards = StreamGuards(receive, out, keepalive, self.keepalive, self.deadline)
        guards.tasks.add(asyncio.ensure_future(sink.closed.wait()))
        try:
            await asyncio.wait({stream, *guards.tasks}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ghosted = sink.closed.is_set() and not stream.done()
            if not ghosted:
                # The client left, or the deadline passed: this consumer goes. (If only
                # the sink closed, a pause snapshot made the consumer a ghost: it lives
                # on in the daemon while this client's connection is cut.)
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
            await guards.cancel()
            timed_out = self.process is not None and self.process.kill_reason == "timeout"
            if sink.tail is not None and not timed_out:
                tail = sink.tail
            elif ghosted:
                tail = end_stream(
                    ConnectError(
                        "aborted",
                        "the stream was cut by a sandbox pause/resume; "
                        "reconnect with commands.connect(pid)",
                    )
                )
            elif timed_out or guards.expired:
                tail = end_stream(
                    ConnectError("deadline_exceeded", "the stream reached its timeout")
                )
            else:  # the client left (nobody reads this), or the daemon is shutting down
                tail = end_stream(ConnectError("unavailable", "the daemon is shutting down"))
            await out.finish(tail)


def _error_stream(error: ConnectError) -> Response:
    return Response(end_stream(error), media_type=STREAM_CONTENT_TYPE)


def keepalive_interval(request: Request) -> float | None:
    """Seconds between keepalives the client asked for; ``None`` for none (absent, 0,
    negative or unreadable: a bad header must not cost the stream)."""
    raw = request.headers.get("keepalive-ping-interval")
    try:
        value = float(raw) if raw is not None else 0.0
    except ValueError:
        return None
    return value if 0 < value < 1e6 else None


def timeout(request: Request) -> float | None:
    """The call's deadline in seconds (``Connect-Timeout-Ms``), ``None`` for none."""
    raw = request.headers.get("connect-timeout-ms")
    if raw is None:
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise ConnectError("invalid_argument", "Connect-Timeout-Ms must be an integer") from None
    if ms <= 0:
        raise ConnectError("deadline_exceeded", "the call's deadline had passed")
    return ms / 1000


class _StdinState:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.seq = 0


class RpcService:
    """What every envd service shares: typed errors become Connect errors, unary calls
    answer JSON, ``lookup`` maps a request to its sandbox."""

    def __init__(self, host: Host, lookup: SandboxLookup) -> None:
        self.host = host
        self.lookup = lookup

    def routes(self) -> dict[str, Callable[[Request], Awaitable[Response]]]:
        """Method path → handler."""
        raise NotImplementedError

    # -- protocol --------------------------------------------------------------------

    def _unary(
        self, handler: Callable[[Request, bytes], Awaitable[dict[str, Any]]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                body = await read_body(request)
                result = await self._typed(handler(request, body))
            except ConnectError as error:
                return _unary_error(error)
            return Response(_json(result), media_type="application/json")

        return run

    def _streaming(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                return await self._typed(handler(request))
            except ConnectError as error:
                return _error_stream(error)

        return run

    async def _typed(self, work: Awaitable[T]) -> T:
        """Run ``work``, turning sandboxkit's typed errors into Connect errors; anything
        else is a bug, answered ``internal`` and recorded, never a torn connection."""
        try:
            return await work
        except ConnectError:
            raise
        except SandboxkitError as exc:
            raise from_sandboxkit(exc) from exc
        except Exception as exc:
            self.host.journal.record("envd.error", reason=type(exc).__name__, error=repr(exc)[:500])
            raise ConnectError("internal", f"internal error: {type(exc).__name__}") from exc


class ProcessService(RpcService):
    """The ``process.Process`` handlers."""

    def __init__(self, host: Host, lookup: SandboxLookup) -> None:
        super().__init__(host, lookup)
        self._session = "envd-" + secrets.token_hex(8)
        # Per process: the next batch of this endpoint's stdin session, and the lock that
        # keeps batches in order. Weak: an evicted process takes its entry with it.
        self._stdin: weakref.WeakKeyDictionary[ManagedProcess, _StdinState] = (
            weakref.WeakKeyDictionary()
        )

    def routes(self) -> dict[str, Callable[[Request], Awaitable[Response]]]:
        """Method path → handler."""
        return {
            "/process.Process/Start": self._streaming(self.start),
            "/process.Process/Connect": self._streaming(self.connect),
            "/process.Process/List": self._unary(self.list),
            "/process.Process/SendInput": self._unary(self.send_input),
            "/process.Process/SendSignal": self._unary(self.send_signal),
            "/process.Process/CloseStdin": self._unary(self.close_stdin),
            "/process.Process/Update": self._unary(self.update),
            "/process.Process/StreamInput": self._streaming(self.stream_input),
        }

    async def _one_message(self, request: Request, model: type[T]) -> T:
        reader = EnvelopeReader()
        found = reader.feed(await read_body(request))
        if len(found) != 1 or reader.pending:
            raise ConnectError("invalid_argument", "expected exactly one request message")
        return decode(found[0], model)

    def _process(self, sandbox: ManagedSandbox, selector: m.ProcessSelector) -> ManagedProcess:
        if selector.pid is not None:
            return sandbox.process(selector.pid)
        if selector.tag is not None:
            for process in sandbox.processes.values():
                if process.spec.tag == selector.tag and process.running:
                    return process
            raise ConnectError("not_found", f"no running process tagged {selector.tag!r}")
        raise ConnectError("invalid_argument", "the process selector names no pid or tag")

    # -- streams ---------------------------------------------------------------------

    async def start(self, request: Request) -> Response:
        body = await self._one_message(request, m.StartRequest)
        deadline = timeout(request)
        config = body.process
        spec = ProcessSpec(
            argv=(config.cmd, *config.args),
            cwd=config.cwd or None,
            envs=config.envs,
            pty=body.pty is not None,
            timeout=deadline,
            tag=body.tag or None,
            user=basic_user(request),
        )
        size = body.pty.size if body.pty is not None else None
        if size is not None and (size.cols, size.rows) != (0, 0):
            _check_size(size)
        sandbox = await self.lookup(request, True)
        process = await sandbox.start_process(spec)
        if size is not None and (size.cols, size.rows) != (0, 0):
            process.resize_pty(size.cols, size.rows)
        if not body.stdin and body.pty is None:  # a pty always takes input (envd's too)
            process.close_stdin()
        consumer = self.host.open_consumer(
            process, 0, name="envd start", peer=_peer(request), role=ROLE
        )
        return EventStream(self.host, consumer, keepalive_interval(request), deadline, process)

    async def connect(self, request: Request) -> Response:
        body = await self._one_message(request, m.ConnectRequest)
        deadline = timeout(request)
        sandbox = await self.lookup(request, False)
        process = self._process(sandbox, body.process)
        raw = request.headers.get("x-sandboxkit-cursor")
        cursor: int | None
        if raw is None:
            cursor = None
        elif raw == "head":
            cursor = process.log.head
        else:
            try:
                cursor = int(raw)
            except ValueError:
                message = "X-Sandboxkit-Cursor must be a seq or head"
                raise ConnectError("invalid_argument", message) from None
        consumer = self.host.open_consumer(
            process, cursor, name="envd connect", peer=_peer(request), role=ROLE
        )
        return EventStream(self.host, consumer, keepalive_interval(request), deadline)

    async def stream_input(self, request: Request) -> Response:
        """Client stream: a ``start`` naming the process, then ``data`` messages, each
        written as it arrives; answered with one empty message and the stream's end."""
        sandbox = await self.lookup(request, True)
        reader = EnvelopeReader()
        process: ManagedProcess | None = None
        async for chunk in request.stream():
            for raw in reader.feed(chunk):
                message = decode(raw, m.StreamInputRequest)
                if message.start is not None:
                    process = self._process(sandbox, message.start.process)
                elif message.data is not None:
                    if process is None:
                        raise ConnectError("invalid_argument", "data before the start message")
                    data = message.data.input.data if message.data.input else b""
                    await self._write_stdin(process, data)
        if reader.pending:
            raise ConnectError("invalid_argument", "the request stream ended mid-message")
        return Response(envelope({}) + end_stream(), media_type=STREAM_CONTENT_TYPE)

    # -- unary -----------------------------------------------------------------------

    async def list(self, request: Request, body: bytes) -> dict[str, Any]:
        sandbox = await self.lookup(request, False)
        infos = []
        for process in sandbox.processes.values():
            if not process.running:
                continue
            argv = process.spec.command_line()
            config: dict[str, Any] = {"cmd": argv[0], "args": argv[1:], "envs": process.spec.envs}
            if process.spec.cwd:
                config["cwd"] = process.spec.cwd
            info: dict[str, Any] = {"config": config, "pid": process.pid}
            if process.spec.tag:
                info["tag"] = process.spec.tag
            infos.append(info)
        return {"processes": infos}

    async def send_input(self, request: Request, body: bytes) -> dict[str, Any]:
        message = decode(body, m.SendInputRequest)
        sandbox = await self.lookup(request, True)
        process = self._process(sandbox, message.process)
        await self._write_stdin(process, message.input.data if message.input else b"")
        return {}

    async def _write_stdin(self, process: ManagedProcess, data: bytes) -> None:
        # Each write is one batch of the endpoint's stdin session, so a batch the daemon
        # refused (stdin_busy) can be sent again without being written twice.
        state = self._stdin.setdefault(process, _StdinState())
        async with state.lock:
            await process.write_stdin(self._session, state.seq, data)
            state.seq += 1

    async def send_signal(self, request: Request, body: bytes) -> dict[str, Any]:
        message = decode(body, m.SendSignalRequest)
        sig = _SIGNALS.get(message.signal)
        if sig is None:
            raise ConnectError("invalid_argument", f"unsupported signal {message.signal!r}")
        sandbox = await self.lookup(request, False)
        process = self._process(sandbox, message.process)
        if not process.running:
            raise ConnectError("not_found", f"process {process.pid} is not running")
        process.kill_reason = process.kill_reason or "user"
        process.signal_tree(sig)
        return {}

    async def close_stdin(self, request: Request, body: bytes) -> dict[str, Any]:
        message = decode(body, m.CloseStdinRequest)
        sandbox = await self.lookup(request, False)
        self._process(sandbox, message.process).close_stdin()
        return {}

    async def update(self, request: Request, body: bytes) -> dict[str, Any]:
        message = decode(body, m.UpdateRequest)
        sandbox = await self.lookup(request, False)
        process = self._process(sandbox, message.process)
        if message.pty is not None and message.pty.size is not None:
            _check_size(message.pty.size)
            process.resize_pty(message.pty.size.cols, message.pty.size.rows)
        return {}


def _check_size(size: m.PtySize) -> None:
    if not (0 < size.cols < 65536 and 0 < size.rows < 65536):
        raise ConnectError("invalid_argument", "a pty size needs 1-65535 columns and rows")


def basic_user(request: Request) -> str | None:
    """The user of envd's ``Authorization: Basic <user:>`` header (the e2b SDK sends the
    ``user`` of a call there); ``None`` when absent or unreadable."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return decoded.partition(":")[0] or None


async def read_body(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MESSAGE:
            raise ConnectError("invalid_argument", "the request is too large")
    return bytes(body)


def _unary_error(error: ConnectError) -> Response:
    return Response(
        _json(error.to_json()), status_code=error.http_status, media_type="application/json"
    )


def _json(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _peer(request: Request) -> str | None:
    client = request.client
    return f"{client.host}:{client.port}" if client else None
