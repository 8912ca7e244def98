"""Assembling the daemon's ASGI app: the endpoint table's handlers, guarded so that every
error is a typed response, behind the router and bearer auth; the host starts and closes
with the app's lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route
from starlette.types import ASGIApp

from sandboxkit.daemon.host import Host
from sandboxkit.daemon.http.responses import guarded, http_error
from sandboxkit.daemon.http.router import DaemonApp
from sandboxkit.daemon.http.routes import Api

__all__ = ["create_app"]


def create_app(host: Host, token: str | None) -> ASGIApp:
    """The daemon's ASGI app; starts and closes ``host`` with its lifespan."""
    api = Api(host)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await host.start()
        try:
            yield
        finally:
            await host.close()

    table = [(ep.method, ep.path, guarded(ep.handler, host)) for ep in api.endpoints()]
    app = Starlette(
        routes=[Route(path, handler, methods=[method]) for method, path, handler in table],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    return DaemonApp(app, table, token)
