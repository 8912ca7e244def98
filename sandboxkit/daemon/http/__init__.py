"""The daemon's HTTP API over :class:`~sandboxkit.daemon.host.Host` (served by uvicorn,
:mod:`sandboxkit.daemon.server`).

========================  ===============================================================
module                    concept
========================  ===============================================================
``routes.py``             the endpoint table and its handlers
``endpoint.py``           what one route declares (models, status, errors)
``parsing.py``            reading a request: body within its limit, query, ``pid``
``responses.py``          JSON answers; typed errors as responses; a bug as a typed 500
``openapi.py``            the OpenAPI document, generated from the table and the models
``auth.py``               bearer auth
``router.py``             matching the table's routes directly; Starlette for the rest
``stream.py``             the frame stream's response
``fast_path.py``          body chunks straight to uvicorn's connection: the one module
                          that relies on uvicorn's and asyncio's private internals
``app.py``                assembling the app (``create_app``)
========================  ===============================================================
"""

from sandboxkit.daemon.http.app import create_app
from sandboxkit.daemon.http.responses import JsonResponse
from sandboxkit.daemon.http.router import DaemonApp

__all__ = ["DaemonApp", "JsonResponse", "create_app"]
