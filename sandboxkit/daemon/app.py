"""The HTTP API: a thin Starlette layer over :class:`~sandboxkit.daemon.host.Host`.

Every request body and query is decoded into a typed model of
:mod:`sandboxkit.daemon.schema` before a handler touches any state, so a bad input is a
typed 4xx that changes nothing; every response is encoded so that it cannot fail; and the
OpenAPI document is generated from the same models and the endpoint table below.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from asyncio import selector_events
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from msgspec import Struct
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sandboxkit._compat import within
from sandboxkit._version import __version__
from sandboxkit.daemon.consumers import CONSUMER_STATES, Consumer
from sandboxkit.daemon.file_span import FileSpan
from sandboxkit.daemon.files import FileContent, FileEntry, FileQuery, FilesApi, WriteFile
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec, check_exec_size
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.schema import (
    ERROR_SCHEMA,
    ConsumerRow,
    CreateSandbox,
    EventRow,
    EventsQuery,
    Health,
    KilledProcess,
    ProcessInfo,
    SandboxInfo,
    SetTimeout,
    StartProcess,
    StdinAck,
    StdinBatch,
    StreamQuery,
    decode_body,
    decode_query,
    encode_json,
)
from sandboxkit.daemon.sendfile_writer import SpanWriter, TornSpan
from sandboxkit.daemon.tcp_peer import (
    PENDING_BYTES,
    SEND_BUFFER,
    size_send_buffer,
    window_closed_for,
)
from sandboxkit.errors import (
    FileNotFound,
    InvalidArgument,
    IsolationUnavailable,
    MalformedFrame,
    PayloadTooLarge,
    ProcessNotFound,
    ResourceExhausted,
    ResultUnavailable,
    SandboxkitError,
    SandboxNotFound,
    SandboxPaused,
    StdinBusy,
    StdinSeqMismatch,
    Unauthorized,
)
from sandboxkit.wire import CONTENT_TYPE

__all__ = ["DaemonApp", "JsonResponse", "create_app"]

Handler = Callable[[Request], Awaitable[Response]]
M = TypeVar("M", bound=Struct)

_MAX_PID = 2**63 - 1


class JsonResponse(Response):
    """A JSON response that always encodes (see :func:`~sandboxkit.daemon.schema.encode_json`)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return encode_json(content)


# -- request parsing -----------------------------------------------------------------


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 past ``limit`` bytes (announced or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes is over {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _pid(request: Request) -> int:
    raw = request.path_params["pid"]
    try:
        pid = int(raw)
    except ValueError:
        raise InvalidArgument("pid must be an integer", field="pid") from None
    if not -_MAX_PID <= pid <= _MAX_PID:
        raise InvalidArgument("pid is out of range", field="pid")
    return pid


def _query(request: Request, model: type[M]) -> M:
    return decode_query(dict(request.query_params), model)


# -- the stream response -------------------------------------------------------------


_CYCLE = "sandboxkit.http_cycle"
"""Scope key of uvicorn's request cycle for this request (see :class:`_ExposeCycle`)."""


_SELECTOR_TRANSPORT: Any = getattr(selector_events, "_SelectorSocketTransport", ())
"""asyncio's own socket transport (private, hence looked up: ``()`` matches nothing), and
uvloop's, which writes its socket the same way (directly while it holds nothing)."""
with contextlib.suppress(ImportError):
    import uvloop

    _SELECTOR_TRANSPORT = (_SELECTOR_TRANSPORT, uvloop.loop.TCPTransport)  # type: ignore[attr-defined]
_IOV_MAX = 1024


def _split(
    parts: list[bytes | memoryview], n: int
) -> tuple[list[bytes | memoryview], list[bytes | memoryview]]:
    """The concatenation of ``parts`` cut after its first ``n`` bytes, as two lists of
    the same objects (a part cut in two becomes two views of it: nothing is copied)."""
    for i, part in enumerate(parts):
        if n < len(part):
            if n == 0:
                return parts[:i], parts[i:]
            view = memoryview(part)
            return [*parts[:i], view[:n]], [view[n:], *parts[i + 1 :]]
        n -= len(part)
    return parts, []


class _AsgiSink:
    """A consumer's transport: the body of one chunked HTTP response.

    Given uvicorn's request cycle (an HTTP/1.1 response, so chunked), body chunks go
    straight to its connection, framed as uvicorn would frame them and after the same flow
    control: the ASGI wrappers and h11 cost more per send than the socket write itself at
    full rate (benchmarks/compare.py, P7). The response's start and end still go through
    ASGI, so the server's own state stays right."""

    def __init__(self, send: Send, cycle: Any = None) -> None:
        self._send = send
        self._cycle = cycle
        transport = getattr(cycle, "transport", None)
        self._socket = None if transport is None else transport.get_extra_info("socket")
        self._send_buffer = SEND_BUFFER  # inherited from the listener
        self._fd: int | None = None  # asyncio's own transport: see send_parts
        self._limits: tuple[int, int] | None = None
        if isinstance(transport, _SELECTOR_TRANSPORT) and self._socket is not None:
            self._fd = self._socket.fileno()
            # Paused as soon as it holds a byte, resumed once it holds none: what this
            # stream hands it is then all the transport holds (see send_parts).
            self._limits = transport.get_write_buffer_limits()
            transport.set_write_buffer_limits(high=0)
        self._closing = False
        self._torn = False  # a body chunk was cut short (see send_parts)
        self._spans: SpanWriter | None = None  # made by the first send_file
        self._gone = asyncio.Event()  # never set: waited on until the stream is cancelled
        self.closed = asyncio.Event()

    def window_closed_for(self) -> float | None:
        """How long the peer has taken no bytes while some wait in the socket."""
        return None if self._socket is None else window_closed_for(self._socket)

    def size_send_buffer(self, nbytes: int) -> None:
        """Let the kernel hold about ``nbytes`` for this peer (see tcp_peer)."""
        if self._socket is not None:
            self._send_buffer = size_send_buffer(self._socket, nbytes, self._send_buffer)

    async def send_parts(self, parts: list[bytes | memoryview], size: int) -> None:
        """Send the concatenation of ``parts`` as one body chunk.

        The parts are the consumer's chunks as the log holds them (shared by every
        consumer, or views of a mapped segment): they are written as they are, and what
        the kernel does not take waits in ``parts``, not in a copy. asyncio's transport
        copies what it is given, so it is given at most :data:`PENDING_BYTES` at a time,
        and the next part goes to the socket once it wrote that (issue 19: a 1 MiB send's
        rest, copied, per consumer, was most of the daemon's memory at 400 consumers).
        uvloop's keeps references to the parts themselves: it gets the whole send."""
        cycle = self._cycle
        if cycle is None or self._torn:
            await self.send(b"".join(parts))
            return
        # One chunk of the chunked body (after what a span left owed: see SpanWriter).
        owed = self._spans.take_pending() if self._spans is not None else b""
        chunk = [owed + b"%x\r\n" % size, *parts, b"\r\n"]
        if self._fd is None:
            await self._writable()
            cycle.transport.writelines(chunk)
            return
        await self._writable()
        while chunk:
            # The transport holds nothing now (its limits pause it at one byte): the
            # socket can be written here, in order, gathered.
            batch = chunk[:_IOV_MAX]
            try:
                sent = os.writev(self._fd, batch)
            except OSError:  # full, or broken: the transport reports that its own way
                sent = 0
            chunk = _split(batch, sent)[1] + chunk[_IOV_MAX:]
            if chunk:
                # The kernel is full: a bounded copy to the transport, which writes it
                # when the socket takes more and resumes this stream once it is empty.
                piece, chunk = _split(chunk, PENDING_BYTES)
                cycle.transport.write(b"".join(piece))
            if chunk:
                try:
                    await self._writable()
                except BaseException:
                    # Cancelled (a kick, the peer gone) inside a body chunk: nothing
                    # may follow it on this connection, which ends after what the
                    # transport holds; the client reattaches from its cursor.
                    self._torn = True
                    cycle.transport.close()
                    raise

    async def send_file(self, span: FileSpan) -> None:
        """Send a span of a segment file as one body chunk, with ``sendfile`` (see
        :mod:`~sandboxkit.daemon.sendfile_writer`); copied where the socket is not ours
        to write."""
        if self._cycle is None or self._fd is None or self._torn:
            data = span.read()
            if data is not None:  # (a file shrunk under it: the next read tells the gap)
                await self.send(data)
            return
        await self._writable()
        if self._spans is None:
            self._spans = SpanWriter(self._fd)
        try:
            await self._spans.send(span, self._cycle.transport, self._writable)
        except BaseException as exc:
            # Cut inside a body chunk (cancelled, or the file shorter than its span):
            # nothing may follow on this connection; the client reattaches.
            self._torn = True
            self._cycle.transport.close()
            if isinstance(exc, TornSpan):
                await self._gone.wait()
            raise

    async def _writable(self) -> None:
        """Returns once the connection takes more bytes; waits for the stream to be
        cancelled if its peer is gone."""
        cycle = self._cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected or cycle.transport.is_closing():
            # The peer is gone (the transport may know before uvicorn does): nothing more
            # to write. Wait for the disconnect to cancel this stream rather than drop
            # bytes in a loop that never yields.
            await self._gone.wait()

    async def send(self, data: bytes) -> None:
        if self._torn:
            return  # a body chunk was cut short: the connection is closing
        if self._cycle is not None and data:
            await self.send_parts([data], len(data))
            return
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._spans is not None:
            owed = self._spans.take_pending()
            self._spans.close()
            if owed and not self._torn and not self._cycle.transport.is_closing():
                self._cycle.transport.write(owed)  # (before the body's end, in order)
        if self._torn:
            self.closed.set()
            return
        if self._limits is not None and not self._cycle.transport.is_closing():
            low, high = self._limits
            self._cycle.transport.set_write_buffer_limits(high, low)
        # A peer that stopped reading must not hold this up: bounded, best effort.
        with contextlib.suppress(Exception):
            await within(
                self._send({"type": "http.response.body", "body": b"", "more_body": False}),
                0.1,
            )
        self.closed.set()


class FrameStreamResponse(Response):
    """Streams one consumer's frames; detaches it when the client goes away."""

    def __init__(self, host: Host, consumer: Consumer) -> None:
        super().__init__(media_type=CONTENT_TYPE)
        self.host = host
        self.consumer = consumer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", CONTENT_TYPE.encode()),
                    (b"cache-control", b"no-store"),
                    (b"x-sandboxkit-consumer", self.consumer.consumer_id.encode()),
                ],
            }
        )
        cycle = scope.get(_CYCLE) if scope.get("http_version") == "1.1" else None
        sink = _AsgiSink(send, cycle)
        stream = self.host.start_stream(self.consumer, sink)
        gone = asyncio.ensure_future(_disconnected(receive))
        closed = asyncio.ensure_future(sink.closed.wait())
        try:
            await asyncio.wait({stream, gone, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The client left (or this request is cancelled): the consumer goes too. If
            # only the sink closed, the consumer lives on elsewhere (a snapshot ghost).
            if not closed.done():
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
            for task in (gone, closed):
                task.cancel()
            await asyncio.gather(gone, closed, return_exceptions=True)


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


# -- endpoints -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Endpoint:
    """One route: the table drives both the router and the OpenAPI document."""

    method: str
    path: str
    summary: str
    handler: Handler
    body: type[Struct] | None = None
    query: type[Struct] | None = None
    response: Any = None
    """The 2xx body's model (``list[Model]`` for lists); ``None``: the frame stream."""
    status: int = 200
    errors: tuple[type[SandboxkitError], ...] = ()
    """Errors beyond those the path, query and body imply (see :meth:`all_errors`)."""
    description: str = field(default="")

    def all_errors(self) -> list[type[SandboxkitError]]:
        """Every error this route can answer with."""
        # Any request may find the daemon at its connection or descriptor limit.
        implied: list[type[SandboxkitError]] = [Unauthorized, ResourceExhausted]
        if "{sid}" in self.path:
            implied.append(SandboxNotFound)
        if self.body is not None:
            implied += [MalformedFrame, InvalidArgument, PayloadTooLarge]
        if self.query is not None or "{pid}" in self.path:
            implied.append(InvalidArgument)
        return list(dict.fromkeys([*implied, *self.errors]))


class _Api:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.files = FilesApi(host)  # sbx.files: sandboxkit/daemon/files.py

    async def _decode(self, request: Request, model: type[M]) -> M:
        raw = await _read_body(request, self.host.config.max_body)
        return decode_body(raw, model)

    async def health(self, request: Request) -> Response:
        return JsonResponse(
            {
                "status": "ok",
                "version": __version__,
                "started_at": self.host.started_at,
                "sandboxes": len(self.host.sandboxes),
                "closing": self.host.closing,
                "isolation": self.host.isolation_support(),
                "root": str(self.host.root),
                "root_missing": not self.host.root.is_dir(),
                "next_event": self.host.journal.next_seq,
            }
        )

    async def create_sandbox(self, request: Request) -> Response:
        body = await self._decode(request, CreateSandbox)
        # The sandbox's environment goes to every process: refuse one no process could use.
        check_exec_size(["/bin/sh", "-c", ""], body.envs)
        sandbox = await self.host.create_sandbox(
            envs=body.envs,
            timeout=body.timeout,
            on_timeout=body.on_timeout,
            auto_resume=body.auto_resume,
            metadata=body.metadata,
            lab=body.lab,
            isolation=body.isolation,
            allow_internet_access=body.allow_internet_access,
            limits=body.limits,
        )
        return JsonResponse(sandbox.to_json(), status_code=201)

    async def list_sandboxes(self, request: Request) -> Response:
        return JsonResponse([s.to_json() for s in self.host.sandboxes.values()])

    # Looking is not activity (docs/protocol.md, "What keeps a sandbox alive"): the read
    # routes look a sandbox up with host.get, which neither restarts its idle timer nor
    # resumes it; host.access is for commands, stdin, file writes and streams.

    async def get_sandbox(self, request: Request) -> Response:
        sandbox = self.host.get(request.path_params["sid"])
        return JsonResponse(sandbox.to_json())

    async def kill_sandbox(self, request: Request) -> Response:
        sandbox = self.host.get(request.path_params["sid"])
        await sandbox.kill(reason="user")
        return JsonResponse(sandbox.to_json())

    async def pause_sandbox(self, request: Request) -> Response:
        sandbox = self._alive(request)
        await sandbox.pause(reason="user")
        return JsonResponse(sandbox.to_json())

    async def resume_sandbox(self, request: Request) -> Response:
        sandbox = self._alive(request)
        await sandbox.resume(reason="user")
        return JsonResponse(sandbox.to_json())

    async def set_timeout(self, request: Request) -> Response:
        body = await self._decode(request, SetTimeout)
        sandbox = self._alive(request)
        sandbox.set_timeout(body.timeout)
        return JsonResponse(sandbox.to_json())

    def _alive(self, request: Request) -> ManagedSandbox:
        sid = request.path_params["sid"]
        sandbox = self.host.get(sid)
        sandbox.touch()
        if sandbox.state == "killed":
            raise SandboxNotFound(f"sandbox {sid} was killed", sandbox_id=sid)
        return sandbox

    async def start_process(self, request: Request) -> Response:
        body = await self._decode(request, StartProcess)
        # Validated before the sandbox is looked up: access() may auto-resume it.
        spec = ProcessSpec(
            cmd=body.cmd,
            argv=tuple(body.argv) if body.argv is not None else None,
            cwd=body.cwd,
            envs=body.envs,
            pty=body.pty,
            timeout=body.timeout,
            tag=body.tag,
        )
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = await sandbox.start_process(spec)
        return JsonResponse(process.to_json(), status_code=201)

    async def list_processes(self, request: Request) -> Response:
        sandbox = self.host.get(request.path_params["sid"])
        return JsonResponse([p.to_json() for p in sandbox.processes.values()])

    async def get_process(self, request: Request) -> Response:
        pid = _pid(request)
        sandbox = self.host.get(request.path_params["sid"])
        return JsonResponse(sandbox.retained_process(pid).to_json())

    async def kill_process(self, request: Request) -> Response:
        pid = _pid(request)
        sandbox = await self.host.access(request.path_params["sid"])
        process = sandbox.process(pid)
        was_running = process.running
        await process.kill(reason="user")
        return JsonResponse({**process.to_json(), "killed": was_running})

    async def restart_process(self, request: Request) -> Response:
        pid = _pid(request)
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = await sandbox.restart(pid)
        return JsonResponse(process.to_json(), status_code=201)

    async def write_stdin(self, request: Request) -> Response:
        body = await self._decode(request, StdinBatch)
        pid = _pid(request)
        if body.end:
            if body.data:
                raise InvalidArgument("a batch that ends its session carries no data", field="data")
            sandbox = await self.host.access(request.path_params["sid"])
            return JsonResponse(sandbox.process(pid).end_stdin_session(body.session))
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = sandbox.process(pid)
        return JsonResponse(await process.write_stdin(body.session, body.seq, body.data))

    async def close_stdin(self, request: Request) -> Response:
        pid = _pid(request)
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = sandbox.process(pid)
        process.close_stdin()
        return JsonResponse(process.to_json())

    async def stream(self, request: Request) -> Response:
        query = _query(request, StreamQuery)
        pid = _pid(request)
        sandbox = await self.host.access(request.path_params["sid"])
        process = sandbox.retained_process(pid)
        client = request.client
        consumer = self.host.open_consumer(
            process,
            query.cursor,
            name=query.name,
            role=query.role,
            peer=f"{client.host}:{client.port}" if client else None,
        )
        return FrameStreamResponse(self.host, consumer)

    async def events(self, request: Request) -> Response:
        query = _query(request, EventsQuery)
        sandbox_id = request.path_params.get("sid")
        if sandbox_id is not None:
            self.host.get(sandbox_id)
        journal = self.host.journal
        events = journal.since(query.since, sandbox_id=sandbox_id, pid=query.pid)
        deadline = time.monotonic() + min(query.wait, self.host.config.events_wait_max)
        while not events and (left := deadline - time.monotonic()) > 0:
            await journal.wait(left, sandbox_id=sandbox_id)
            events = journal.since(query.since, sandbox_id=sandbox_id, pid=query.pid)
        return JsonResponse([e.to_json() for e in events])

    async def consumers(self, request: Request) -> Response:
        return JsonResponse(self.host.consumer_metrics(request.path_params.get("sid")))

    async def openapi(self, request: Request) -> Response:
        return JsonResponse(_openapi(self.endpoints()))

    def endpoints(self) -> list[_Endpoint]:
        sbx = "/sandboxes/{sid}"
        proc = sbx + "/processes/{pid}"
        ep = _Endpoint
        paused = (SandboxPaused,)
        consumers_doc = "Consumer states: " + "; ".join(
            f"`{name}`: {meaning}" for name, meaning in CONSUMER_STATES.items()
        )
        return [
            ep("GET", "/health", "Daemon health", self.health, response=Health),
            ep("GET", "/openapi.json", "This OpenAPI document", self.openapi, response=dict),
            ep(
                "POST",
                "/sandboxes",
                "Create a sandbox",
                self.create_sandbox,
                body=CreateSandbox,
                response=SandboxInfo,
                status=201,
                errors=(IsolationUnavailable,),
            ),
            ep(
                "GET",
                "/sandboxes",
                "List sandboxes",
                self.list_sandboxes,
                response=list[SandboxInfo],
            ),
            ep("GET", sbx, "Get a sandbox", self.get_sandbox, response=SandboxInfo),
            ep("DELETE", sbx, "Kill and delete a sandbox", self.kill_sandbox, response=SandboxInfo),
            ep(
                "POST",
                sbx + "/pause",
                "Pause (freeze) a sandbox",
                self.pause_sandbox,
                response=SandboxInfo,
            ),
            ep(
                "POST",
                sbx + "/resume",
                "Resume (thaw) a sandbox",
                self.resume_sandbox,
                response=SandboxInfo,
            ),
            ep(
                "POST",
                sbx + "/timeout",
                "Set the idle timeout (restarts it)",
                self.set_timeout,
                body=SetTimeout,
                response=SandboxInfo,
            ),
            ep(
                "POST",
                sbx + "/processes",
                "Start a process",
                self.start_process,
                body=StartProcess,
                response=ProcessInfo,
                status=201,
                errors=paused,
            ),
            ep(
                "GET",
                sbx + "/processes",
                "List processes",
                self.list_processes,
                response=list[ProcessInfo],
            ),
            ep(
                "GET",
                proc,
                "Get a process",
                self.get_process,
                response=ProcessInfo,
                errors=(ResultUnavailable,),
            ),
            ep(
                "POST",
                proc + "/kill",
                "Kill a process",
                self.kill_process,
                response=KilledProcess,
                errors=(ProcessNotFound,),
            ),
            ep(
                "POST",
                proc + "/restart",
                "Kill and restart a process",
                self.restart_process,
                response=ProcessInfo,
                status=201,
                errors=(SandboxPaused, ProcessNotFound),
            ),
            ep(
                "POST",
                proc + "/stdin",
                "Write a stdin batch (exactly once per session and seq)",
                self.write_stdin,
                body=StdinBatch,
                response=StdinAck,
                errors=(SandboxPaused, ProcessNotFound, StdinSeqMismatch, StdinBusy),
            ),
            ep(
                "POST",
                proc + "/stdin/close",
                "Close stdin",
                self.close_stdin,
                response=ProcessInfo,
                errors=(SandboxPaused, ProcessNotFound),
            ),
            ep(
                "GET",
                proc + "/stream",
                "Attach a framed output stream",
                self.stream,
                query=StreamQuery,
                errors=(ResultUnavailable,),
                description="`role` labels the consumer in the metrics (default `sdk`).",
            ),
            ep(
                "GET",
                "/events",
                "Event journal",
                self.events,
                query=EventsQuery,
                response=list[EventRow],
            ),
            ep(
                "GET",
                sbx + "/events",
                "A sandbox's events",
                self.events,
                query=EventsQuery,
                response=list[EventRow],
            ),
            ep(
                "GET",
                "/consumers",
                "Consumer metrics",
                self.consumers,
                response=list[ConsumerRow],
                description=consumers_doc,
            ),
            ep(
                "GET",
                sbx + "/consumers",
                "A sandbox's consumer metrics",
                self.consumers,
                response=list[ConsumerRow],
                description=consumers_doc,
            ),
            ep(
                "PUT",
                sbx + "/files",
                "Write a file",
                self.files.write,
                body=WriteFile,
                response=FileEntry,
                status=201,
                errors=(FileNotFound,),
            ),
            ep(
                "GET",
                sbx + "/files",
                "Read a file",
                self.files.read,
                query=FileQuery,
                response=FileContent,
                errors=(FileNotFound, PayloadTooLarge),
            ),
            ep(
                "GET",
                sbx + "/files/list",
                "List a directory",
                self.files.list,
                query=FileQuery,
                response=list[FileEntry],
                errors=(FileNotFound,),
            ),
        ]


# -- the OpenAPI document --------------------------------------------------------------

_REF = "#/components/schemas/{name}"


def _operation_id(ep: _Endpoint) -> str:
    words = [w.strip("{}") for w in ep.path.replace(".", "_").split("/") if w]
    return "_".join([ep.method.lower(), *words])


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A query parameter's schema: absent rather than ``null``."""
    options = [s for s in schema.get("anyOf", []) if s.get("type") != "null"]
    return options[0] if len(options) == 1 else {k: v for k, v in schema.items() if k != "default"}


def _openapi(endpoints: list[_Endpoint]) -> dict[str, Any]:
    models: list[Any] = []
    for ep in endpoints:
        for model in (ep.body, ep.query, ep.response):
            if model is not None and model is not dict:
                models.append(model)
    schemas, components = msgspec.json.schema_components(models, ref_template=_REF)
    refs = dict(zip(map(repr, models), schemas, strict=True))
    components["Error"] = ERROR_SCHEMA
    paths: dict[str, dict[str, Any]] = {}
    for ep in endpoints:
        params: list[dict[str, Any]] = []
        if "{sid}" in ep.path:
            params.append(
                {"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}}
            )
        if "{pid}" in ep.path:
            params.append(
                {
                    "name": "pid",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "integer", "minimum": -_MAX_PID, "maximum": _MAX_PID},
                }
            )
        if ep.query is not None:
            query = components[ep.query.__name__]
            params += [
                {"name": name, "in": "query", "required": False, "schema": _not_null(schema)}
                for name, schema in query["properties"].items()
            ]
        if ep.response is None:
            content: dict[str, Any] = {CONTENT_TYPE: {}}
        elif ep.response is dict:
            content = {"application/json": {"schema": {"type": "object"}}}
        else:
            content = {"application/json": {"schema": refs[repr(ep.response)]}}
        responses: dict[str, Any] = {str(ep.status): {"description": "OK", "content": content}}
        for cls in ep.all_errors():
            described = responses.setdefault(
                str(cls.status),
                {
                    "description": "",
                    "content": {
                        "application/json": {"schema": {"$ref": _REF.format(name="Error")}}
                    },
                },
            )
            line = f"`{cls.code}`: {(cls.__doc__ or '').strip().splitlines()[0]}"
            described["description"] = "\n".join(filter(None, [described["description"], line]))
        operation: dict[str, Any] = {
            "summary": ep.summary,
            "operationId": _operation_id(ep),
            "parameters": params,
            "responses": responses,
            "security": [{"bearer": []}],
        }
        if ep.description:
            operation["description"] = ep.description
        if ep.body is not None:
            operation["requestBody"] = {
                "required": False,
                "content": {"application/json": {"schema": refs[repr(ep.body)]}},
            }
        paths.setdefault(ep.path, {})[ep.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "sandboxkit daemon", "version": __version__},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": components,
        },
    }


# -- errors and auth -----------------------------------------------------------------


def _error_response(exc: SandboxkitError) -> Response:
    # Both end the connection (connections.py closes an unauthenticated one once answered):
    # saying so keeps a client from sending its next request into a closing socket.
    closing = isinstance(exc, (PayloadTooLarge, Unauthorized))
    headers = {"connection": "close"} if closing else None
    return JsonResponse(exc.to_wire(), status_code=exc.status, headers=headers)


def _guarded(handler: Handler, host: Host) -> Handler:
    """Typed errors become their response here, inside the route: the response is
    complete and the kept-alive connection stays valid. Anything else is a bug, answered
    with a typed 500 and recorded in the journal — never an exception that tears the
    connection down."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except SandboxkitError as exc:
            return _error_response(exc)
        except Exception as exc:
            host.journal.record("api.error", reason=type(exc).__name__, error=repr(exc)[:500])
            # Name the cause (an OSError's message carries the file it is about).
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return _error_response(SandboxkitError(f"internal error: {cause}"[:500]))

    return run


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    body = {"code": "http_error", "message": str(exc.detail), "details": {}}
    return JsonResponse(body, status_code=exc.status_code)


class BearerAuth:
    """Refuses every request without the daemon's bearer token (401, typed)."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.allows(scope):
            await self.refuse(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def allows(self, scope: Scope) -> bool:
        """Whether the request carries the token (or none is needed)."""
        if self.expected is None:
            return True
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        return secrets.compare_digest(given, self.expected)

    @staticmethod
    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        error = Unauthorized("missing or wrong bearer token")
        await _error_response(error)(scope, receive, send)


def _expose_cycle(scope: Scope, send: Send) -> None:
    """Puts uvicorn's request cycle into the scope, for a stream to read its socket's state
    (a peer that takes no more bytes shows as blocked at once, not once the server's
    buffers are full) and to write body chunks straight to its connection. uvicorn's
    ``send`` is a method of that cycle; a server whose ``send`` has not the same shape
    (transport, flow control, disconnected) gets the plain ASGI path."""
    cycle = getattr(send, "__self__", None)
    if all(hasattr(cycle, name) for name in ("transport", "flow", "disconnected")):
        scope[_CYCLE] = cycle


_Route = tuple[tuple[tuple[int, str], ...], tuple[tuple[int, str], ...], Handler]
"""A compiled path template: (index, literal) segments, (index, name) parameters, handler."""


class DaemonApp:
    """The daemon's ASGI app: bearer auth, then the endpoint table's routes called directly.

    A unary request's daemon CPU is mostly per-request machinery, not its handler: Starlette's
    router tries each route's regex in turn, and its two exception middlewares wrap every
    ``send``. Here a request whose method and path match the table is matched by its path
    segments and its handler called with a plain :class:`~starlette.requests.Request`;
    everything else (unknown paths, wrong methods, ``HEAD``, the lifespan) goes to the
    Starlette app built from the same table, so its answers are unchanged."""

    def __init__(
        self, fallback: ASGIApp, routes: list[tuple[str, str, Handler]], token: str | None
    ) -> None:
        self.app = fallback
        """The Starlette app of the same table: what the fast path does not serve."""
        self.auth = BearerAuth(fallback, token)
        self._routes: dict[tuple[str, int], list[_Route]] = {}
        for method, path, handler in routes:
            parts = path.split("/")
            literals = tuple((i, p) for i, p in enumerate(parts) if not p.startswith("{"))
            params = tuple((i, p[1:-1]) for i, p in enumerate(parts) if p.startswith("{"))
            self._routes.setdefault((method, len(parts)), []).append((literals, params, handler))

    def match(self, method: str, path: str) -> tuple[Handler, dict[str, str]] | None:
        """The handler and path parameters of a request, if the table has its route."""
        parts = path.split("/")
        for literals, params, handler in self._routes.get((method, len(parts)), ()):
            if all(parts[i] == literal for i, literal in literals) and all(
                parts[i] for i, _ in params
            ):
                return handler, {name: parts[i] for i, name in params}
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.auth.allows(scope):
            await self.auth.refuse(scope, receive, send)
            return
        _expose_cycle(scope, send)
        found = None if scope.get("root_path") else self.match(scope["method"], scope["path"])
        if found is None:
            await self.app(scope, receive, send)
            return
        handler, scope["path_params"] = found
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


def create_app(host: Host, token: str | None) -> ASGIApp:
    """The daemon's ASGI app; starts and closes ``host`` with its lifespan."""
    api = _Api(host)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await host.start()
        try:
            yield
        finally:
            await host.close()

    table = [(ep.method, ep.path, _guarded(ep.handler, host)) for ep in api.endpoints()]
    app = Starlette(
        routes=[Route(path, handler, methods=[method]) for method, path, handler in table],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error},
    )
    return DaemonApp(app, table, token)
