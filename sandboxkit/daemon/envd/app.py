"""The envd-compatible ASGI app and its server: the official ``e2b`` SDK in debug mode
talks to a sandboxkit daemon through it.

One envd serves one sandbox (E2B's model), so the app maps URLs to sandboxes:

- ``/...`` — the *default* sandbox, created on the first request that needs one (and
  created again if it was killed): ``Sandbox.create(debug=True,
  sandbox_url="http://127.0.0.1:PORT")`` just works.
- ``/sandboxes/<id>/...`` — the sandboxkit sandbox ``<id>``, so the SDK can drive a
  sandbox created (and paused, resumed...) through sandboxkit's own API:
  ``sandbox_url="http://127.0.0.1:PORT/sandboxes/sbx-1a2b3c4d"``.
- ``.../live/...`` (after either form) — the same sandbox, but ``connect(pid)`` starts at
  the live head, as E2B's envd does, instead of replaying the retained output: what an
  E2B user sees (sandboxkit's E2B provider is tested against it).

- ``E2b-Sandbox-Id: <id>`` (a header; the SDK sends it outside debug mode) on a path that
  names no sandbox — the sandbox ``<id>``: one ``sandbox_url`` serves them all.

Auth: with a daemon token, every request must show it, as ``X-Access-Token`` (the header
envd checks) or as the URL prefix ``/k/<token>`` (the SDK in debug mode sends no token
header, but keeps its ``sandbox_url``'s path): :attr:`EnvdServer.url` includes it — or
show the ``envdAccessToken`` the control plane gave out for the sandbox it names.

On the same port, under ``/api``, E2B's control plane
(:mod:`sandboxkit.daemon.envd.control_plane`): the SDK outside debug mode creates,
pauses, resumes, lists and kills sandboxkit sandboxes through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import socket
from collections.abc import Awaitable, Callable, Generator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sandboxkit.daemon.envd.connect import ConnectError
from sandboxkit.daemon.envd.control_plane import API_PREFIX, AccessTokens, create_control_plane
from sandboxkit.daemon.envd.files import error_response, read_file, write_file
from sandboxkit.daemon.envd.filesystem_service import FilesystemService
from sandboxkit.daemon.envd.process_service import ProcessService, RpcService
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.http.prompt_server import PromptServer
from sandboxkit.daemon.listen import bind_or_say
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.errors import SandboxkitError
from sandboxkit.vocab import ENVD_PORT

__all__ = ["DEFAULT_PORT", "EnvdServer", "create_envd_app"]

DEFAULT_PORT = ENVD_PORT
"""envd's port (:data:`sandboxkit.vocab.ENVD_PORT`)."""


class _Sandboxes:
    """Which sandbox a request is for."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.default_id: str | None = None
        self._lock = asyncio.Lock()

    async def lookup(self, request: Request, needs_running: bool) -> ManagedSandbox:
        sid = request.path_params.get("sid")
        if sid is not None:
            return await self.host.access(sid, needs_running=needs_running)
        async with self._lock:
            current = self.host.sandboxes.get(self.default_id or "")
            if current is None or current.state == "killed":
                current = await self.host.create_sandbox(metadata={"envd": "default"})
                self.default_id = current.sandbox_id
        return await self.host.access(current.sandbox_id, needs_running=needs_running)


def _files(
    sandboxes: _Sandboxes, handler: Callable[[ManagedSandbox, Request], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        try:
            sandbox = await sandboxes.lookup(request, False)
            return await handler(sandbox, request)
        except SandboxkitError as exc:
            return error_response(exc)
        except Exception as exc:  # a bug: a typed JSON 500, recorded, never a bare page
            journal = sandboxes.host.journal
            journal.record("envd.error", reason=type(exc).__name__, error=repr(exc)[:500])
            return error_response(SandboxkitError(f"internal error: {type(exc).__name__}"))

    return run


def _routes(sandboxes: _Sandboxes, services: list[RpcService]) -> list[BaseRoute]:
    async def health(request: Request) -> Response:
        return Response(status_code=204)

    routes: list[BaseRoute] = [
        Route("/health", health, methods=["GET"]),
        Route("/files", _files(sandboxes, read_file), methods=["GET"]),
        Route("/files", _files(sandboxes, write_file), methods=["POST"]),
    ]
    for service in services:
        routes += [Route(path, call, methods=["POST"]) for path, call in service.routes().items()]
    return routes


class _Access:
    """Who may reach which sandbox's envd, and which sandbox a request is for.

    A request shows the daemon's token — as ``X-Access-Token`` (envd's header) or as the
    URL prefix ``/k/<token>`` (the e2b SDK in debug mode sends no token header, but keeps
    the path of its ``sandbox_url``) — and may then reach any sandbox; or it shows the
    ``envdAccessToken`` the control plane minted for the sandbox its ``E2b-Sandbox-Id``
    header names (what the SDK sends outside debug mode), and reaches that one only.
    Otherwise: Connect ``unauthenticated``.

    Routing: a path that names no sandbox (``/sandboxes/<id>/...``) is sent to the one
    ``E2b-Sandbox-Id`` names — the SDK sends every sandbox's requests to the same
    ``sandbox_url`` with that header, E2B's proxy routes by it — except the debug mode's
    placeholder ``debug_sandbox_id``, which means the default sandbox.
    """

    def __init__(self, app: ASGIApp, token: str | None, tokens: AccessTokens) -> None:
        self.app = app
        self.expected = token.encode() if token else None
        self.prefix = f"/k/{token}" if token else None
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        path: str = scope["path"]
        named = headers.get(b"e2b-sandbox-id", b"").decode("latin-1")
        if named == _DEBUG_SANDBOX_ID:
            named = ""
        if named and not _SANDBOX_ID.match(named):
            await self._refuse(scope, receive, send, "invalid_argument", "bad E2b-Sandbox-Id")
            return
        scoped = False
        if self.expected is not None and self.prefix is not None:
            given = headers.get(b"x-access-token", b"")
            if path.startswith(self.prefix + "/"):
                path = path[len(self.prefix) :]
            elif secrets.compare_digest(given, self.expected):
                pass
            elif named and self.tokens.opens(named, given):
                scoped = True
            else:
                await self._refuse(
                    scope, receive, send, "unauthenticated", "missing or wrong X-Access-Token"
                )
                return
        in_path = _IN_PATH.match(path)
        if in_path is None and named:
            path = f"/sandboxes/{named}{path}"
        elif scoped and in_path is not None and in_path.group(1) != named:
            await self._refuse(
                scope, receive, send, "permission_denied", "this access token is another sandbox's"
            )
            return
        if path != scope["path"]:
            scope = {**scope, "path": path, "raw_path": None}
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, code: str, message: str) -> None:
        error = ConnectError(code, message)
        await JSONResponse(error.to_json(), error.http_status)(scope, receive, send)


class _Endpoints:
    """One port, two APIs: the control plane under :data:`API_PREFIX`, envd elsewhere."""

    def __init__(self, envd: ASGIApp, api: ASGIApp) -> None:
        self.envd = envd
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == API_PREFIX or path.startswith(API_PREFIX + "/")):
            inner = path[len(API_PREFIX) :] or "/"
            await self.api({**scope, "path": inner, "raw_path": None}, receive, send)
            return
        await self.envd(scope, receive, send)


_DEBUG_SANDBOX_ID = "debug_sandbox_id"
"""The sandbox id the e2b SDK uses in debug mode (no control plane): the default sandbox."""
_SANDBOX_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_IN_PATH = re.compile(r"^/sandboxes/([^/]+)/")


_LIVE = re.compile(r"^(/sandboxes/[^/]+)?/live(/.*)$")


class _LiveHead:
    """The ``/live`` path segment: strip it, and make a ``Connect`` start at the head (as
    if the client had sent ``X-Sandboxkit-Cursor: head``) — envd's own semantics, where a
    reader that reattaches gets only output produced after it reattached."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            match = _LIVE.match(scope["path"])
            if match is not None:
                headers = [(k, v) for k, v in scope["headers"] if k != b"x-sandboxkit-cursor"]
                headers.append((b"x-sandboxkit-cursor", b"head"))
                path = (match.group(1) or "") + match.group(2)
                scope = {**scope, "path": path, "raw_path": None, "headers": headers}
        await self.app(scope, receive, send)


def create_envd_app(
    host: Host, token: str | None, closers: list[Callable[[], None]] | None = None
) -> ASGIApp:
    """The envd-compatible app on ``host`` (which its owner starts and closes); what the
    app holds beyond requests (directory watchers) is released by the callables it adds
    to ``closers``."""
    sandboxes = _Sandboxes(host)
    filesystem = FilesystemService(host, sandboxes.lookup)
    if closers is not None:
        closers.append(filesystem.close)
    services: list[RpcService] = [ProcessService(host, sandboxes.lookup), filesystem]
    routes = _routes(sandboxes, services)
    app = Starlette(routes=[*routes, Mount("/sandboxes/{sid}", routes=routes)])
    app.state.sandboxes = sandboxes
    tokens = AccessTokens(host)
    envd = _Access(_LiveHead(app), token, tokens)
    return _Endpoints(envd, create_control_plane(host, token, tokens))


class _Server(PromptServer):
    """uvicorn's server (stopping when told) without signal handling: the daemon's own
    server owns SIGINT and SIGTERM, and stops this one when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class EnvdServer:
    """The envd app on its own socket, served on the daemon's loop next to its API."""

    def __init__(
        self,
        host: Host,
        *,
        bind: str,
        port: int,
        token: str | None,
        http: type[asyncio.Protocol] | None = None,
    ) -> None:
        """``http``: uvicorn's HTTP protocol class to serve with (the daemon's, wrapped in
        its connection guard: the same deadlines and cap as its API)."""
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bind_or_say(self._sock, bind, port, "the envd endpoint (--envd)")
        self._sock.listen(512)
        self._sock.setblocking(False)
        self.bind, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.bind}:{self.port}" + (f"/k/{token}" if token else "")
        """What the SDK's ``sandbox_url`` should be in debug mode (the default sandbox);
        append ``/sandboxes/<id>`` for another sandbox."""
        self.api_url = f"http://{self.bind}:{self.port}{API_PREFIX}"
        """The control plane: the SDK's ``api_url`` (``E2B_API_URL``) outside debug mode,
        with the daemon's token as its API key."""
        self.sandbox_url = f"http://{self.bind}:{self.port}"
        """The SDK's ``sandbox_url`` (``E2B_SANDBOX_URL``) outside debug mode: every
        sandbox's envd, told apart by the ``E2b-Sandbox-Id`` header the SDK sends."""
        self._closers: list[Callable[[], None]] = []
        self._server = _Server(
            uvicorn.Config(
                create_envd_app(host, token, self._closers),
                log_level="warning",
                access_log=False,
                lifespan="off",  # the daemon's own app starts and closes the host
                loop="asyncio",
                http=http or "auto",
                timeout_graceful_shutdown=1,
            )
        )

    async def serve(self) -> None:
        """Serve until :meth:`stop`; closes the socket."""
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            self._sock.close()
            for close in self._closers:
                close()

    def stop(self) -> None:
        """Ask the server to exit (it finishes on its loop)."""
        self._server.should_exit = True
        self._server.wake()
