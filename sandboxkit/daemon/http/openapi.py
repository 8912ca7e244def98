"""The OpenAPI 3.1 document (``GET /openapi.json``), generated from the endpoint table and
the request and response models of :mod:`sandboxkit.daemon.schema`: paths, parameters,
bodies, and for each route exactly the errors it can answer with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from sandboxkit._version import __version__
from sandboxkit.daemon.http.endpoint import Endpoint
from sandboxkit.daemon.http.parsing import MAX_PID
from sandboxkit.daemon.schema import ERROR_SCHEMA, require_sent_fields
from sandboxkit.wire import CONTENT_TYPE

__all__ = ["openapi"]

_REF = "#/components/schemas/{name}"


def _operation_id(ep: Endpoint) -> str:
    words = [w.strip("{}") for w in ep.path.replace(".", "_").split("/") if w]
    return "_".join([ep.method.lower(), *words])


def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A query parameter's schema: absent rather than ``null``."""
    options = [s for s in schema.get("anyOf", []) if s.get("type") != "null"]
    return options[0] if len(options) == 1 else {k: v for k, v in schema.items() if k != "default"}


def openapi(endpoints: Sequence[Endpoint]) -> dict[str, Any]:
    """The document for the routes ``endpoints``."""
    models: list[Any] = []
    for ep in endpoints:
        for model in (ep.body, ep.query, ep.response):
            if model is not None and model is not dict:
                models.append(model)
    schemas, components = msgspec.json.schema_components(models, ref_template=_REF)
    refs = dict(zip(map(repr, models), schemas, strict=True))
    require_sent_fields(components)
    components["Error"] = ERROR_SCHEMA
    paths: dict[str, dict[str, Any]] = {}
    for ep in endpoints:
        params: list[dict[str, Any]] = []
        if "{sid}" in ep.path:
            params.append(
                {"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}}
            )
        if "{pid}" in ep.path:
            params.append(
                {
                    "name": "pid",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "integer", "minimum": -MAX_PID, "maximum": MAX_PID},
                }
            )
        if ep.query is not None:
            query = components[ep.query.__name__]
            params += [
                {"name": name, "in": "query", "required": False, "schema": _not_null(schema)}
                for name, schema in query["properties"].items()
            ]
        if ep.response is None:
            content: dict[str, Any] = {CONTENT_TYPE: {}}
        elif ep.response is dict:
            content = {"application/json": {"schema": {"type": "object"}}}
        else:
            content = {"application/json": {"schema": refs[repr(ep.response)]}}
        responses: dict[str, Any] = {str(ep.status): {"description": "OK", "content": content}}
        for cls in ep.all_errors():
            described = responses.setdefault(
                str(cls.status),
                {
                    "description": "",
                    "content": {
                        "application/json": {"schema": {"$ref": _REF.format(name="Error")}}
                    },
                },
            )
            line = f"`{cls.code}`: {(cls.__doc__ or '').strip().splitlines()[0]}"
            described["description"] = "\n".join(filter(None, [described["description"], line]))
        operation: dict[str, Any] = {
            "summary": ep.summary,
            "operationId": _operation_id(ep),
            "parameters": params,
            "responses": responses,
            "security": [{"bearer": []}],
        }
        if ep.description:
            operation["description"] = ep.description
        if ep.body is not None:
            operation["requestBody"] = {
                "required": False,
                "content": {"application/json": {"schema": refs[repr(ep.body)]}},
            }
        paths.setdefault(ep.path, {})[ep.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "sandboxkit daemon", "version": __version__},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": components,
        },
    }
