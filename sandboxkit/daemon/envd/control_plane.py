"""E2B's control plane — the REST API the official ``e2b`` SDK calls outside its debug
mode — served by the daemon, so the unmodified SDK creates, pauses, resumes, lists and
kills sandboxkit sandboxes on loopback.

It lives on the envd endpoint's port under ``/api`` (:data:`API_PREFIX`); point the SDK
at it with ``E2B_API_URL=http://127.0.0.1:PORT/api``, ``E2B_SANDBOX_URL=http://127.0.0.1:PORT``
and ``E2B_API_KEY=<the daemon's token>``. Each E2B sandbox *is* a sandboxkit sandbox:

- ``POST /v2/sandboxes`` → :meth:`Host.create_sandbox` (the template is recorded, not
  built: every sandbox runs on this machine); ``timeout`` becomes the sandbox's timeout,
  ``autoPause`` its ``on_timeout="pause"``, ``autoResume`` its ``auto_resume``;
- ``POST /sandboxes/{id}/pause`` → pause (the freezer keeps memory, so only ``mode="full"``
  is served); ``POST /v2/sandboxes/{id}/connect`` → resume if paused;
- ``DELETE /sandboxes/{id}`` → kill; ``POST /sandboxes/{id}/timeout`` → ``set_timeout``;
- ``GET /sandboxes/{id}`` and ``GET /v2/sandboxes`` → the daemon's state (every sandbox it
  holds, whoever made it; killed ones are gone, as on E2B).

Auth: ``X-API-KEY`` must be the daemon's token (E2B's 401 otherwise). Creating or
connecting answers with an ``envdAccessToken`` minted for that one sandbox: the SDK sends
it to envd as ``X-Access-Token`` with ``E2b-Sandbox-Id``, and it opens that sandbox's envd
and no other (:class:`AccessTokens`). Errors are E2B's body ``{"code", "message"}`` with
the HTTP status the SDK maps (404 → ``SandboxNotFoundException``, 409 on pausing a paused
sandbox → ``pause()`` returns False, 401 → ``AuthenticationException``).

Requests are validated by msgspec models in the style of :mod:`sandboxkit.daemon.schema`:
a value that is wrong, or an E2B feature sandboxkit cannot honour (network rules, MCP,
volumes, IAM, a filesystem-only pause), is refused with 400 before anything changes.
"""

from __future__ import annotations

import datetime
import os
import re
import secrets
import shutil
import time
import urllib.parse
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sandboxkit.daemon.host import Host
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.schema import MAX_METADATA, MAX_SECONDS, Envs, Label, decode_body
from sandboxkit.errors import (
    InvalidArgument,
    MalformedFrame,
    PayloadTooLarge,
    SandboxkitError,
    SandboxNotFound,
)
from sandboxkit.vocab import DEFAULT_SANDBOX_TIMEOUT

__all__ = [
    "API_PREFIX",
    "DEFAULT_TIMEOUT",
    "ENVD_VERSION",
    "AccessTokens",
    "ApiKeyAuth",
    "create_control_plane",
]

API_PREFIX = "/api"
"""Where the control plane lives on the envd endpoint's port (the SDK's ``api_url``)."""

ENVD_VERSION = "0.6.4"
"""The envd version reported: the newest whose behaviour this SDK gates on
(``e2b.envd.versions``); the endpoint serves what the SDK does at that version."""

DEFAULT_TIMEOUT = DEFAULT_SANDBOX_TIMEOUT
"""Seconds, when a create names no timeout (the SDK's own default, and the Python
client's: :data:`sandboxkit.vocab.DEFAULT_SANDBOX_TIMEOUT`)."""

MAX_BODY = 256 * 1024
_SANDBOX_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FAR_FUTURE = "9999-12-31T23:59:59Z"
_MIB = 1024 * 1024

# -- requests --------------------------------------------------------------------------

Timeout = Annotated[int, Meta(ge=1, le=MAX_SECONDS, description="seconds, >= 1")]
Metadata = Annotated[
    dict[Label, Annotated[str, Meta(max_length=64 * 1024)]], Meta(max_length=MAX_METADATA)
]
Template = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[^\x00]*$")]


class AutoResume(Struct, forbid_unknown_fields=True):
    enabled: bool


class NewSandbox(Struct, forbid_unknown_fields=True):
    """``POST /v2/sandboxes`` (E2B's ``NewSandboxV2``)."""

    template_id: Template = msgspec.field(name="templateID")
    timeout: Timeout | None = None
    auto_pause: bool = msgspec.field(default=False, name="autoPause")
    auto_pause_memory: bool | None = msgspec.field(default=None, name="autoPauseMemory")
    auto_resume: AutoResume | None = msgspec.field(default=None, name="autoResume")
    allow_internet_access: bool | None = None
    metadata: Metadata = {}
    env_vars: Envs = msgspec.field(default_factory=dict, name="envVars")
    # E2B features sandboxkit cannot honour: accepted by shape, refused if used.
    network: dict[str, Any] | None = None
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None
    volume_mounts: list[Any] | None = msgspec.field(default=None, name="volumeMounts")


class ConnectSandbox(Struct, forbid_unknown_fields=True):
    """``POST /v2/sandboxes/{id}/connect``: ``memory: false`` asks for a cold boot."""

    timeout: Timeout | None = None
    memory: bool | None = None


class PauseSandbox(Struct, forbid_unknown_fields=True):
    """``POST /sandboxes/{id}/pause``: ``memory: false`` asks for a filesystem-only pause."""

    memory: bool | None = None
    require_healthy_guest: bool | None = msgspec.field(default=None, name="requireHealthyGuest")


class SetTimeout(Struct, forbid_unknown_fields=True):
    """``POST /sandboxes/{id}/timeout``."""

    timeout: Timeout


class ListQuery(Struct):
    """Query of ``GET /v2/sandboxes``."""

    metadata: str | None = None
    state: str | None = None
    order: Literal["asc", "desc"] = "asc"
    limit: Annotated[int, Meta(ge=1, le=100)] = 100
    next_token: Annotated[int, Meta(ge=0)] = msgspec.field(default=0, name="nextToken")
    template: str | None = None
    started_after: str | None = msgspec.field(default=None, name="startedAfter")


# -- errors ----------------------------------------------------------------------------


class ApiError(Exception):
    """An E2B API error: its HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> Response:
        body = msgspec.json.encode({"code": self.status, "message": self.message})
        return Response(body, self.status, media_type="application/json")


def _api_error(exc: SandboxkitError) -> ApiError:
    """E2B's status for a sandboxkit error: 404 for anything not found, 400 for bad input
    (E2B's, where sandboxkit's own API says 422), 413 too large, else 500."""
    if isinstance(exc, SandboxNotFound):
        return ApiError(404, str(exc))
    if isinstance(exc, (InvalidArgument, MalformedFrame)):
        return ApiError(400, f"{exc.code}: {exc}")
    if isinstance(exc, PayloadTooLarge):
        return ApiError(413, str(exc))
    return ApiError(exc.status if exc.status < 500 else 500, f"{exc.code}: {exc}")


def _unsupported(feature: str) -> ApiError:
    return ApiError(400, f"{feature} is not served by a sandboxkit daemon (see docs/e2b.md)")


# -- per-sandbox envd tokens -----------------------------------------------------------


class AccessTokens:
    """The ``envdAccessToken`` of each sandbox the control plane handed out: it opens
    that sandbox's envd (with ``E2b-Sandbox-Id`` naming it) and no other."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._tokens: dict[str, str] = {}

    def mint(self, sandbox_id: str) -> str:
        for gone in [sid for sid in self._tokens if sid not in self.host.sandboxes]:
            del self._tokens[gone]
        token = self._tokens.get(sandbox_id)
        if token is None:
            token = self._tokens[sandbox_id] = secrets.token_urlsafe(24)
        return token

    def opens(self, sandbox_id: str, token: bytes) -> bool:
        expected = self._tokens.get(sandbox_id)
        return expected is not None and secrets.compare_digest(token, expected.encode())

    def forget(self, sandbox_id: str) -> None:
        self._tokens.pop(sandbox_id, None)


class ApiKeyAuth:
    """Refuses control-plane requests whose ``X-API-KEY`` is not the daemon's token (401,
    E2B's body). No token (``--no-auth``): the door is as open as the daemon's."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.expected = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.expected is not None:
            given = dict(scope["headers"]).get(b"x-api-key", b"")
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(401, "missing or wrong X-API-KEY (the daemon's token)")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- the API ---------------------------------------------------------------------------


def _iso(ts: float) -> str:
    moment = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def _memory_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // _MIB
    except (ValueError, OSError):
        return 0


class _ControlPlane:
    def __init__(self, host: Host, tokens: AccessTokens) -> None:
        self.host = host
        self.tokens = tokens
        self.templates: dict[str, str] = {}
        """The template each sandbox was created from (recorded, not built)."""
        self._idempotent: dict[str, str] = {}
        """``Idempotency-Key`` → the sandbox it created (a retried create makes none)."""

    # -- helpers ---------------------------------------------------------------------

    def _sandbox(self, request: Request) -> ManagedSandbox:
        sid = request.path_params["sid"]
        sandbox = self.host.sandboxes.get(sid) if _SANDBOX_ID.match(sid) else None
        if sandbox is None or sandbox.state == "killed":
            raise ApiError(404, f"sandbox {sid} not found")
        return sandbox

    async def _body(self, request: Request, model: type[Any]) -> Any:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"request body over {MAX_BODY} bytes")
        try:
            return decode_body(bytes(raw), model)
        except SandboxkitError as exc:
            raise _api_error(exc) from None

    def _end_at(self, sandbox: ManagedSandbox) -> str:
        if sandbox.timeout is None:
            return _FAR_FUTURE
        idle = time.monotonic() - sandbox.last_activity
        return _iso(time.time() + max(0.0, sandbox.timeout - idle))

    def _created(self, sandbox: ManagedSandbox) -> dict[str, Any]:
        """E2B's ``Sandbox`` (create and connect answers)."""
        return {
            "templateID": self.templates.get(sandbox.sandbox_id, "sandboxkit"),
            "sandboxID": sandbox.sandbox_id,
            "clientID": "sandboxkit",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.tokens.mint(sandbox.sandbox_id),
        }

    def _listed(self, sandbox: ManagedSandbox) -> dict[str, Any]:
        """E2B's ``ListedSandbox``; the sizes are this machine's (sandboxes share it)."""
        return {
            "templateID": self.templates.get(sandbox.sandbox_id, "sandboxkit"),
            "sandboxID": sandbox.sandbox_id,
            "clientID": "sandboxkit",
            "startedAt": _iso(sandbox.created_at),
            "endAt": self._end_at(sandbox),
            "cpuCount": os.cpu_count() or 1,
            "memoryMB": _memory_mb(),
            "diskSizeMB": shutil.disk_usage(self.host.root).total // _MIB,
            "state": sandbox.state,
            "envdVersion": ENVD_VERSION,
            "metadata": sandbox.metadata,
        }

    def _detail(self, sandbox: ManagedSandbox) -> dict[str, Any]:
        return {
            **self._listed(sandbox),
            "lifecycle": {"onTimeout": sandbox.on_timeout, "autoResume": sandbox.auto_resume},
        }

    @staticmethod
    def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
        return Response(msgspec.json.encode(data), status, headers, "application/json")

    # -- routes ----------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        body: NewSandbox = await self._body(request, NewSandbox)
        key = request.headers.get("idempotency-key")
        if key is not None and key in self._idempotent:
            earlier = self.host.sandboxes.get(self._idempotent[key])
            if earlier is not None and earlier.state != "killed":
                return self._json(self._created(earlier), 201)
        for name, value in (
            ("network", body.network),
            ("mcp", body.mcp),
            ("iam", body.iam),
            ("volumeMounts", body.volume_mounts),
        ):
            if value:
                raise _unsupported(name)
        if body.auto_pause and body.auto_pause_memory is False:
            raise _unsupported("a filesystem-only auto-pause")
        try:
            sandbox = await self.host.create_sandbox(
                envs=body.env_vars,
                timeout=body.timeout or DEFAULT_TIMEOUT,
                on_timeout="pause" if body.auto_pause else "kill",
                auto_resume=bool(body.auto_resume and body.auto_resume.enabled),
                metadata=body.metadata,
                # E2B's own name; refused (IsolationUnavailable) where namespaces are not.
                allow_internet_access=body.allow_internet_access is not False,
                isolation=None if body.allow_internet_access is not False else "namespaces",
            )
        except SandboxkitError as exc:
            raise _api_error(exc) from None
        self.templates[sandbox.sandbox_id] = body.template_id
        if key is not None:
            if len(self._idempotent) >= 10_000:
                self._idempotent.pop(next(iter(self._idempotent)))
            self._idempotent[key] = sandbox.sandbox_id
        return self._json(self._created(sandbox), 201)

    async def list(self, request: Request) -> Response:
        try:
            query = msgspec.convert(dict(request.query_params), ListQuery, strict=False)
        except msgspec.ValidationError as exc:
            raise ApiError(400, f"invalid_argument: {exc}") from None
        states = set(query.state.split(",")) if query.state else {"running", "paused"}
        if not states <= {"running", "paused"}:
            raise ApiError(400, f"invalid_argument: unknown state in {query.state!r}")
        wanted = {}
        if query.metadata:
            pairs = urllib.parse.parse_qsl(query.metadata, keep_blank_values=True)
            wanted = {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}
        after = None
        if query.started_after:
            try:
                after = datetime.datetime.fromisoformat(query.started_after).timestamp()
            except ValueError:
                raise ApiError(400, "invalid_argument: startedAfter is not a date") from None
        found = [
            s
            for s in self.host.sandboxes.values()
            if s.state in states
            and all(s.metadata.get(k) == v for k, v in wanted.items())
            and (after is None or s.created_at >= after)
            and (query.template is None or self.templates.get(s.sandbox_id) == query.template)
        ]
        found.sort(key=lambda s: s.created_at, reverse=query.order == "desc")
        page = found[query.next_token : query.next_token + query.limit]
        headers = {}
        if query.next_token + query.limit < len(found):
            headers["x-next-token"] = str(query.next_token + query.limit)
        return self._json([self._listed(s) for s in page], headers=headers)

    async def get(self, request: Request) -> Response:
        return self._json(self._detail(self._sandbox(request)))

    async def kill(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        await sandbox.kill(reason="user")
        self.tokens.forget(sandbox.sandbox_id)
        return Response(status_code=204)

    async def pause(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        body: PauseSandbox = await self._body(request, PauseSandbox)
        if body.memory is False:
            raise _unsupported('a filesystem-only pause (mode="filesystem")')
        if sandbox.state == "paused":
            raise ApiError(409, f"sandbox {sandbox.sandbox_id} is already paused")
        await sandbox.pause(reason="user")
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        body: ConnectSandbox = await self._body(request, ConnectSandbox)
        resumed = sandbox.state == "paused"
        if resumed and body.memory is False:
            raise _unsupported('on_resume="reboot"')
        if resumed:
            await sandbox.resume(reason="user")
        if body.timeout is not None and (
            resumed or sandbox.timeout is None or body.timeout > sandbox.timeout
        ):
            sandbox.set_timeout(body.timeout)
        else:
            sandbox.touch()
        return self._json(self._created(sandbox), 201 if resumed else 200)

    async def set_timeout(self, request: Request) -> Response:
        sandbox = self._sandbox(request)
        body: SetTimeout = await self._body(request, SetTimeout)
        sandbox.set_timeout(body.timeout)
        return Response(status_code=204)


def _guarded(
    handler: Any,
) -> Any:
    async def run(request: Request) -> Response:
        try:
            response: Response = await handler(request)
            return response
        except ApiError as exc:
            return exc.response()
        except SandboxkitError as exc:
            return _api_error(exc).response()

    return run


def create_control_plane(host: Host, token: str | None, tokens: AccessTokens) -> ASGIApp:
    """The control-plane app (its paths without :data:`API_PREFIX`), behind
    :class:`ApiKeyAuth`."""
    api = _ControlPlane(host, tokens)

    async def not_found(request: Request, exc: Exception) -> Response:
        # An E2B route sandboxkit does not serve (snapshots, metrics, templates...): 501,
        # which the SDK shows as it is — not 404, which it reports as "sandbox not found".
        status = getattr(exc, "status_code", 404)
        what = f"{request.method} {request.url.path}"
        if status == 404:
            return ApiError(501, f"{what} is not served by a sandboxkit daemon").response()
        return ApiError(status, f"no route {what}").response()

    routes = [
        Route("/v2/sandboxes", _guarded(api.create), methods=["POST"]),
        Route("/v2/sandboxes", _guarded(api.list), methods=["GET"]),
        Route("/sandboxes/{sid}", _guarded(api.get), methods=["GET"]),
        Route("/sandboxes/{sid}", _guarded(api.kill), methods=["DELETE"]),
        Route("/sandboxes/{sid}/pause", _guarded(api.pause), methods=["POST"]),
        Route("/v2/sandboxes/{sid}/connect", _guarded(api.connect), methods=["POST"]),
        Route("/sandboxes/{sid}/timeout", _guarded(api.set_timeout), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    return ApiKeyAuth(app, token)
