"""The daemon's ASGI app in front: bearer auth, then the endpoint table's routes matched by
their path segments and called directly; everything else goes to the Starlette app built
from the same table."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from sandboxkit.daemon.http.auth import BearerAuth
from sandboxkit.daemon.http.fast_path import expose_cycle
from sandboxkit.daemon.http.responses import Handler

__all__ = ["DaemonApp"]

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
        expose_cycle(scope, send)
        found = None if scope.get("root_path") else self.match(scope["method"], scope["path"])
        if found is None:
            await self.app(scope, receive, send)
            return
        handler, scope["path_params"] = found
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)
