"""Reading a request: its body within the size limit, decoded into a typed model; its
query; its ``pid`` path parameter. Every failure is a typed 4xx raised before a handler
touches any state."""

from __future__ import annotations

from typing import TypeVar

from msgspec import Struct
from starlette.requests import Request

from sandboxkit.daemon.schema import decode_body, decode_query
from sandboxkit.errors import InvalidArgument, PayloadTooLarge

__all__ = ["MAX_PID", "decode", "pid", "query", "read_body"]

M = TypeVar("M", bound=Struct)

MAX_PID = 2**63 - 1
"""The largest ``pid`` a path may name (either sign): what the OpenAPI document says too."""


async def read_body(request: Request, limit: int) -> bytes:
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


async def decode(request: Request, model: type[M], limit: int) -> M:
    """The body (at most ``limit`` bytes) as a ``model``."""
    return decode_body(await read_body(request, limit), model)


def pid(request: Request) -> int:
    """The ``pid`` path parameter, an integer within :data:`MAX_PID`."""
    raw = request.path_params["pid"]
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument("pid must be an integer", field="pid") from None
    if not -MAX_PID <= value <= MAX_PID:
        raise InvalidArgument("pid is out of range", field="pid")
    return value


def query(request: Request, model: type[M]) -> M:
    """The query string as a ``model``."""
    return decode_query(dict(request.query_params), model)
