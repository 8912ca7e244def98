"""Bearer auth: every request without the daemon's token is refused with a typed 401.

(:mod:`sandboxkit.daemon.http.connections` checks the same token per connection, to close an
unauthenticated one once answered and to shed those first.)"""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from sandboxkit.daemon.http.responses import error_response
from sandboxkit.errors import Unauthorized

__all__ = ["BearerAuth"]


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
        await error_response(error)(scope, receive, send)
