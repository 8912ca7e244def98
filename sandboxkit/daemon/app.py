"""The HTTP API: a thin Starlette layer over :class:`~sandboxkit.daemon.host.Host`."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sandboxkit._compat import within
from sandboxkit._version import __version__
from sandboxkit.daemon.consumers import Consumer
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.errors import (
    ERROR_TABLE,
    InvalidArgument,
    MalformedFrame,
    SandboxkitError,
    Unauthorized,
)
from sandboxkit.wire import CONTENT_TYPE

__all__ = ["create_app"]

Handler = Callable[[Request], Awaitable[Response]]


# -- request parsing -----------------------------------------------------------------


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise MalformedFrame(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise MalformedFrame("request body must be a JSON object")
    return body


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise InvalidArgument(f"{name} has the wrong type", field=name)
    if not isinstance(value, kinds):
        raise InvalidArgument(f"{name} has the wrong type", field=name)
    return value


def _str_map(body: dict[str, Any], name: str) -> dict[str, str]:
    value = _field(body, name, (dict,), {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidArgument(f"{name} must map strings to strings", field=name)
    return dict(value)


def _int_param(request: Request, name: str, default: int | None = None) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"{name} must be an integer", field=name) from None


def _pid(request: Request) -> int:
    try:
        return int(request.path_params["pid"])
    except ValueError:
        raise InvalidArgument("pid must be an integer", field="pid") from None


# -- the stream response -------------------------------------------------------------


class _AsgiSink:
    """A consumer's transport: the body of one chunked HTTP response."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._closing = False
        self.closed = asyncio.Event()

    async def send(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
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
        sink = _AsgiSink(send)
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
    method: str
    path: str
    summary: str
    handler: Handler


class _Api:
    def __init__(self, host: Host) -> None:
        self.host = host

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "version": __version__,
                "started_at": self.host.started_at,
                "sandboxes": len(self.host.sandboxes),
                "closing": self.host.closing,
            }
        )

    async def create_sandbox(self, request: Request) -> Response:
        body = await _body(request)
        on_timeout = _field(body, "on_timeout", (str,), "pause")
        sandbox = await self.host.create_sandbox(
            envs=_str_map(body, "envs"),
            timeout=_field(body, "timeout", (int, float)),
            on_timeout=on_timeout,
            auto_resume=_field(body, "auto_resume", (bool,), False),
            metadata=_str_map(body, "metadata"),
            fanout=_field(body, "fanout", (str,)),
            kick_grace=_field(body, "kick_grace", (int, float)),
            pause_ghosts=_field(body, "pause_ghosts", (bool,), False),
            ghost_buffer=_field(body, "ghost_buffer", (int,)),
        )
        return JSONResponse(sandbox.to_json(), status_code=201)

    async def list_sandboxes(self, request: Request) -> Response:
        return JSONResponse([s.to_json() for s in self.host.sandboxes.values()])

    async def get_sandbox(self, request: Request) -> Response:
        sandbox = await self.host.access(request.path_params["sid"])
        return JSONResponse(sandbox.to_json())

    async def kill_sandbox(self, request: Request) -> Response:
        sandbox = self.host.get(request.path_params["sid"])
        await sandbox.kill(reason="user")
        return JSONResponse(sandbox.to_json())

    async def pause_sandbox(self, request: Request) -> Response:
        sandbox = self.host.get(request.path_params["sid"])
        sandbox.touch()
        if sandbox.state == "killed":
            raise InvalidArgument("the sandbox was killed", field="sandbox_id")
        await sandbox.pause(reason="user")
        return JSONResponse(sandbox.to_json())

    async def resume_sandbox(self, request: Request) -> Response:
        sandbox = self.host.get(request.path_params["sid"])
        sandbox.touch()
        if sandbox.state == "killed":
            raise InvalidArgument("the sandbox was killed", field="sandbox_id")
        await sandbox.resume(reason="user")
        return JSONResponse(sandbox.to_json())

    async def start_process(self, request: Request) -> Response:
        body = await _body(request)
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        argv = _field(body, "argv", (list,))
        if argv is not None and not all(isinstance(a, str) for a in argv):
            raise InvalidArgument("argv must be a list of strings", field="argv")
        spec = ProcessSpec(
            cmd=_field(body, "cmd", (str,)),
            argv=tuple(argv) if argv is not None else None,
            cwd=_field(body, "cwd", (str,)),
            envs=_str_map(body, "envs"),
            pty=_field(body, "pty", (bool,), False),
            timeout=_field(body, "timeout", (int, float)),
            tag=_field(body, "tag", (str,)),
        )
        process = await sandbox.start_process(spec)
        return JSONResponse(process.to_json(), status_code=201)

    async def list_processes(self, request: Request) -> Response:
        sandbox = await self.host.access(request.path_params["sid"])
        return JSONResponse([p.to_json() for p in sandbox.processes.values()])

    async def get_process(self, request: Request) -> Response:
        sandbox = await self.host.access(request.path_params["sid"])
        return JSONResponse(sandbox.result(_pid(request)).to_json())

    async def kill_process(self, request: Request) -> Response:
        sandbox = await self.host.access(request.path_params["sid"])
        process = sandbox.process(_pid(request))
        was_running = process.running
        await process.kill(reason="user")
        return JSONResponse({**process.to_json(), "killed": was_running})

    async def restart_process(self, request: Request) -> Response:
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = await sandbox.restart(_pid(request))
        return JSONResponse(process.to_json(), status_code=201)

    async def write_stdin(self, request: Request) -> Response:
        body = await _body(request)
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = sandbox.process(_pid(request))
        session = _field(body, "session", (str,))
        seq = _field(body, "seq", (int,))
        data = _field(body, "data", (str,))
        if session is None or seq is None or data is None:
            raise InvalidArgument("stdin needs session, seq and data (base64)", field="data")
        try:
            raw = base64.b64decode(data, validate=True)
        except binascii.Error:
            raise InvalidArgument("data must be base64", field="data") from None
        return JSONResponse(process.write_stdin(session, seq, raw))

    async def close_stdin(self, request: Request) -> Response:
        sandbox = await self.host.access(request.path_params["sid"], needs_running=True)
        process = sandbox.process(_pid(request))
        process.close_stdin()
        return JSONResponse(process.to_json())

    async def stream(self, request: Request) -> Response:
        sandbox = await self.host.access(request.path_params["sid"])
        process = sandbox.result(_pid(request))
        client = request.client
        consumer = self.host.consumer(
            process,
            _int_param(request, "cursor"),
            name=request.query_params.get("name"),
            peer=f"{client.host}:{client.port}" if client else None,
        )
        return FrameStreamResponse(self.host, consumer)

    async def events(self, request: Request) -> Response:
        sandbox_id = request.path_params.get("sid")
        if sandbox_id is not None:
            self.host.get(sandbox_id)
        since = _int_param(request, "since", 0) or 0
        events = self.host.journal.since(
            since, sandbox_id=sandbox_id, pid=_int_param(request, "pid")
        )
        return JSONResponse([e.to_json() for e in events])

    async def consumers(self, request: Request) -> Response:
        return JSONResponse(self.host.consumers(request.path_params.get("sid")))

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(_openapi(self.endpoints()))

    def endpoints(self) -> list[_Endpoint]:
        sbx = "/sandboxes/{sid}"
        proc = sbx + "/processes/{pid}"
        return [
            _Endpoint("GET", "/health", "Daemon health", self.health),
            _Endpoint("GET", "/openapi.json", "This OpenAPI document", self.openapi),
            _Endpoint("POST", "/sandboxes", "Create a sandbox", self.create_sandbox),
            _Endpoint("GET", "/sandboxes", "List sandboxes", self.list_sandboxes),
            _Endpoint("GET", sbx, "Get a sandbox", self.get_sandbox),
            _Endpoint("DELETE", sbx, "Kill and delete a sandbox", self.kill_sandbox),
            _Endpoint("POST", sbx + "/pause", "Pause (freeze) a sandbox", self.pause_sandbox),
            _Endpoint("POST", sbx + "/resume", "Resume (thaw) a sandbox", self.resume_sandbox),
            _Endpoint("POST", sbx + "/processes", "Start a process", self.start_process),
            _Endpoint("GET", sbx + "/processes", "List processes", self.list_processes),
            _Endpoint("GET", proc, "Get a process", self.get_process),
            _Endpoint("POST", proc + "/kill", "Kill a process", self.kill_process),
            _Endpoint(
                "POST", proc + "/restart", "Kill and restart a process", self.restart_process
            ),
            _Endpoint("POST", proc + "/stdin", "Write a stdin batch", self.write_stdin),
            _Endpoint("POST", proc + "/stdin/close", "Close stdin", self.close_stdin),
            _Endpoint("GET", proc + "/stream", "Attach a framed output stream", self.stream),
            _Endpoint("GET", "/events", "Event journal", self.events),
            _Endpoint("GET", sbx + "/events", "A sandbox's events", self.events),
            _Endpoint("GET", "/consumers", "Consumer metrics", self.consumers),
            _Endpoint("GET", sbx + "/consumers", "A sandbox's consumer metrics", self.consumers),
        ]


def _operation_id(ep: _Endpoint) -> str:
    words = [w.strip("{}") for w in ep.path.replace(".", "_").split("/") if w]
    return "_".join([ep.method.lower(), *words])


def _openapi(endpoints: list[_Endpoint]) -> dict[str, Any]:
    error = {"$ref": "#/components/schemas/Error"}
    paths: dict[str, dict[str, Any]] = {}
    for ep in endpoints:
        params = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in ("sid", "pid")
            if "{" + name + "}" in ep.path
        ]
        if ep.path.endswith("/stream"):
            params.append({"name": "cursor", "in": "query", "schema": {"type": "integer"}})
            params.append({"name": "name", "in": "query", "schema": {"type": "string"}})
        if ep.path.endswith("/events"):
            params.append({"name": "since", "in": "query", "schema": {"type": "integer"}})
        responses: dict[str, Any] = {
            "200": {
                "description": "OK",
                "content": {
                    CONTENT_TYPE if ep.path.endswith("/stream") else "application/json": {}
                },
            }
        }
        for cls in ERROR_TABLE.values():
            responses.setdefault(
                str(cls.status),
                {
                    "description": cls.__doc__ or cls.code,
                    "content": {"application/json": {"schema": error}},
                },
            )
        paths.setdefault(ep.path, {})[ep.method.lower()] = {
            "summary": ep.summary,
            "operationId": _operation_id(ep),
            "parameters": params,
            "responses": responses,
            "security": [{"bearer": []}],
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "sandboxkit daemon", "version": __version__},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {
                        "code": {"type": "string", "enum": sorted(ERROR_TABLE)},
                        "message": {"type": "string"},
                        "details": {"type": "object"},
                    },
                }
            },
        },
    }


# -- errors and auth -----------------------------------------------------------------


def _error_response(exc: SandboxkitError) -> JSONResponse:
    return JSONResponse(exc.to_wire(), status_code=exc.status)


async def _sandboxkit_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SandboxkitError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    body = {"code": "http_error", "message": str(exc.detail), "details": {}}
    return JSONResponse(body, status_code=exc.status_code)


class BearerAuth:
    """Refuses every request without the daemon's bearer token (401, typed)."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.expected is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = Unauthorized("missing or wrong bearer token")
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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

    routes = [Route(ep.path, ep.handler, methods=[ep.method]) for ep in api.endpoints()]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={SandboxkitError: _sandboxkit_error, HTTPException: _http_error},
    )
    return BearerAuth(app, token)
