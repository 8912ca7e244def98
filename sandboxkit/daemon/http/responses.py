"""How every answer of the HTTP API is written: JSON that cannot fail to encode, a typed
error as its own response, and anything else (a bug) as a typed 500 that leaves the
kept-alive connection valid."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from sandboxkit.daemon.host import Host
from sandboxkit.daemon.schema import encode_json
from sandboxkit.errors import PayloadTooLarge, SandboxkitError, Unauthorized

__all__ = [
    "Handler",
    "JsonArrayResponse",
    "JsonResponse",
    "error_response",
    "guarded",
    "http_error",
]

_T = TypeVar("_T")

Handler = Callable[[Request], Awaitable[Response]]


class JsonResponse(Response):
    """A JSON response that always encodes (see :func:`~sandboxkit.daemon.schema.encode_json`)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return encode_json(content)


class JsonArrayResponse(Response):
    """A JSON array of what ``describe`` makes of each item, each encoded as soon as it is
    made. Why not one list of them encoded at the end: with the whole list of dicts alive
    at once (1,000 sandboxes: ~25,000 containers), the garbage collector's young
    generations filled and now and then it walked the daemon's every object: in a daemon
    with 1,000 sandboxes, one ``GET /sandboxes`` in 120 took 104 ms instead of 5.5 (a
    full collection), and in a process holding more objects every other one did. Made
    and freed one by one, they never fill a generation: in 240 answers, none collected,
    the slowest 16 ms."""

    media_type = "application/json"

    def __init__(self, items: Iterable[_T], describe: Callable[[_T], Any]) -> None:
        super().__init__(b"[" + b",".join([encode_json(describe(i)) for i in items]) + b"]")


def error_response(exc: SandboxkitError) -> Response:
    """The typed error ``exc`` as its response (its status, its wire body)."""
    # Both end the connection (connections.py closes an unauthenticated one once answered):
    # saying so keeps a client from sending its next request into a closing socket.
    closing = isinstance(exc, (PayloadTooLarge, Unauthorized))
    headers = {"connection": "close"} if closing else None
    return JsonResponse(exc.to_wire(), status_code=exc.status, headers=headers)


def guarded(handler: Handler, host: Host) -> Handler:
    """Typed errors become their response here, inside the route: the response is
    complete and the kept-alive connection stays valid. Anything else is a bug, answered
    with a typed 500 and recorded in the journal — never an exception that tears the
    connection down."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except SandboxkitError as exc:
            return error_response(exc)
        except Exception as exc:
            host.journal.record("api.error", reason=type(exc).__name__, error=repr(exc)[:500])
            # Name the cause (an OSError's message carries the file it is about).
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return error_response(SandboxkitError(f"internal error: {cause}"[:500]))

    return run


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own answers (404, 405) in the API's error shape."""
    assert isinstance(exc, HTTPException)
    body = {"code": "http_error", "message": str(exc.detail), "details": {}}
    return JsonResponse(body, status_code=exc.status_code)
