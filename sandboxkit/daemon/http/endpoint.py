"""What one route declares: the table of these drives the router and the OpenAPI document
alike, so neither can list a route, a model or an error the other lacks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msgspec import Struct

from sandboxkit.daemon.http.responses import Handler
from sandboxkit.errors import (
    InvalidArgument,
    MalformedFrame,
    PayloadTooLarge,
    ResourceExhausted,
    SandboxkitError,
    SandboxNotFound,
    Unauthorized,
)

__all__ = ["Endpoint"]


@dataclass(frozen=True)
class Endpoint:
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
