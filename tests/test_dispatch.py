"""The daemon's request dispatch (issue 11): the endpoint table's routes are matched by
their path segments and called directly; everything else goes to the Starlette app built
from the same table, so unknown paths, wrong methods and ``HEAD`` answer as before."""

from __future__ import annotations

import re
from typing import Any

import httpx

from sandboxkit.daemon.http import DaemonApp
from sandboxkit.daemon.server import DaemonServer


def test_every_route_of_the_table_takes_the_direct_path(daemon: DaemonServer) -> None:
    app: Any = daemon._server.config.app
    assert isinstance(app, DaemonApp)
    for route in app.app.routes:
        concrete = re.sub(r"\{(\w+)\}", lambda m: "7" if m[1] == "pid" else "sbx-1", route.path)
        for method in route.methods - {"HEAD"}:
            found = app.match(method, concrete)
            assert found is not None, (method, route.path)
            params = found[1]
            assert params == {
                name: ("7" if name == "pid" else "sbx-1") for name in route.param_convertors
            }
    # Not in the table: left to the fallback (404, 405, trailing-slash redirect, HEAD).
    assert app.match("GET", "/nope") is None
    assert app.match("PUT", "/sandboxes") is None
    assert app.match("GET", "/sandboxes/") is None
    assert app.match("GET", "/sandboxes//processes") is None
    assert app.match("HEAD", "/health") is None


def test_what_the_table_lacks_answers_as_starlette_does(daemon: DaemonServer) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        assert http.get("/health").json()["status"] == "ok"
        missing = http.get("/nope")
        assert (missing.status_code, missing.json()["code"]) == (404, "http_error")
        wrong = http.put("/sandboxes")
        assert (wrong.status_code, wrong.json()["code"]) == (405, "http_error")
        assert http.head("/health").status_code == 200
        assert http.get("/sandboxes/", follow_redirects=False).status_code == 307
        bad_pid = http.get("/sandboxes/sbx-x/processes/abc")
        assert bad_pid.status_code in (404, 422)  # unknown sandbox or bad pid: typed
        assert "code" in bad_pid.json()
    with httpx.Client(base_url=daemon.url, timeout=10) as anonymous:
        for path in ("/health", "/nope"):
            refused = anonymous.get(path)
            assert (refused.status_code, refused.json()["code"]) == (401, "unauthorized")
