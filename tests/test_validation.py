"""No request can break the daemon: every bad input found by probing (issue 10) gets a typed
4xx *before* anything changes, and afterwards the list and the journal still answer and the
same kept-alive connection still serves."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from support import fast_config

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.server import DaemonServer

BODY_LIMIT = 1024 * 1024


@pytest.fixture
def daemon_config() -> DaemonConfig:
    return fast_config(max_body=BODY_LIMIT)


@dataclass(frozen=True)
class Probe:
    name: str
    path: str  # "{sid}" and "{pid}" are filled in
    body: bytes
    status: int
    code: str
    field: str | None = None
    method: str = "POST"


def _j(value: Any) -> bytes:
    return json.dumps(value).encode()


_PROC = "/sandboxes/{sid}/processes"
_STDIN = "/sandboxes/{sid}/processes/{pid}/stdin"

PROBES = [
    # Values Python's json accepts but that cannot be served back (the poison of issue 10).
    Probe(
        "create-timeout-nan", "/sandboxes", b'{"timeout": NaN}', 422, "invalid_argument", "timeout"
    ),
    Probe(
        "create-timeout-infinity",
        "/sandboxes",
        b'{"timeout": Infinity}',
        422,
        "invalid_argument",
        "timeout",
    ),
    Probe(
        "create-kick-grace-nan",
        "/sandboxes",
        b'{"lab": {"fanout": "kick", "kick_grace": NaN}}',
        422,
        "invalid_argument",
        "lab.kick_grace",
    ),
    Probe(
        "create-kick-grace-huge",
        "/sandboxes",
        b'{"lab": {"kick_grace": 1e308}}',
        422,
        "invalid_argument",
        "lab.kick_grace",
    ),
    Probe(
        "start-timeout-infinity",
        _PROC,
        b'{"cmd": "true", "timeout": -Infinity}',
        422,
        "invalid_argument",
        "timeout",
    ),
    Probe(
        "start-timeout-1e400",
        _PROC,
        b'{"cmd": "true", "timeout": 1e400}',
        422,
        "invalid_argument",
        "timeout",
    ),
    Probe(
        "create-metadata-lone-surrogate",
        "/sandboxes",
        b'{"metadata": {"k": "\\udcff"}}',
        422,
        "invalid_argument",
        "metadata",
    ),
    Probe(
        "start-cmd-lone-surrogate",
        _PROC,
        b'{"cmd": "echo \\ud800"}',
        422,
        "invalid_argument",
        "cmd",
    ),
    Probe(
        "create-envs-lone-surrogate-key",
        "/sandboxes",
        b'{"envs": {"\\udfff": "x"}}',
        422,
        "invalid_argument",
        "envs",
    ),
    # Strings the kernel refuses at exec.
    Probe("start-cmd-nul", _PROC, _j({"cmd": "echo a\x00b"}), 422, "invalid_argument", "cmd"),
    Probe(
        "start-argv-nul", _PROC, _j({"argv": ["echo", "a\x00"]}), 422, "invalid_argument", "argv"
    ),
    Probe(
        "start-env-value-nul",
        _PROC,
        _j({"cmd": "true", "envs": {"A": "\x00"}}),
        422,
        "invalid_argument",
        "envs",
    ),
    Probe(
        "start-env-key-equals",
        _PROC,
        _j({"cmd": "true", "envs": {"A=B": "1"}}),
        422,
        "invalid_argument",
        "envs",
    ),
    Probe(
        "create-env-key-equals",
        "/sandboxes",
        _j({"envs": {"=": "1"}}),
        422,
        "invalid_argument",
        "envs",
    ),
    Probe(
        "start-cwd-nul", _PROC, _j({"cmd": "true", "cwd": "a\x00"}), 422, "invalid_argument", "cwd"
    ),
    # Argument lists the kernel refuses (E2BIG), though the body fits the limit.
    Probe("start-cmd-300k", _PROC, _j({"cmd": "x" * 300_000}), 422, "invalid_argument", "cmd"),
    Probe(
        "start-argv-many",
        _PROC,
        _j({"argv": ["echo", *(["y" * 100] * 9000)]}),
        422,
        "invalid_argument",
        "argv",
    ),
    Probe(
        "create-50k-envs",
        "/sandboxes",
        _j({"envs": {f"V{i}": "1" for i in range(50_000)}}),
        422,
        "invalid_argument",
        "envs",
    ),
    # Stdin.
    Probe(
        "stdin-non-ascii-base64",
        _STDIN,
        _j({"session": "s", "seq": 0, "data": "é"}),
        422,
        "invalid_argument",
        "data",
    ),
    Probe(
        "stdin-seq-huge",
        _STDIN,
        _j({"session": "s", "seq": 2**70, "data": ""}),
        422,
        "invalid_argument",
        "seq",
    ),
    # Shapes.
    Probe("nested-json", "/sandboxes", b"[" * 100_000 + b"]" * 100_000, 400, "malformed_frame"),
    Probe(
        "nested-json-in-field",
        "/sandboxes",
        b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        422,
        "invalid_argument",
        "metadata",
    ),
    Probe(
        "unknown-field",
        "/sandboxes",
        b'{"timeout": 5, "timeuot": 5}',
        422,
        "invalid_argument",
        "timeuot",
    ),
    Probe(
        "create-ghost-buffer-2-62",
        "/sandboxes",
        _j({"lab": {"pause_ghosts": True, "ghost_buffer": 2**62}}),
        422,
        "invalid_argument",
        "lab.ghost_buffer",
    ),
    # The body limit.
    Probe(
        "metadata-over-body-limit",
        "/sandboxes",
        _j({"metadata": {"big": "m" * (BODY_LIMIT + 1)}}),
        413,
        "payload_too_large",
    ),
]


@pytest.fixture
def target(daemon: DaemonServer) -> Iterator[tuple[httpx.Client, dict[str, str]]]:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=30) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        pid = http.post(f"/sandboxes/{sid}/processes", json={"cmd": "cat"}).json()["pid"]
        yield http, {"sid": sid, "pid": str(pid)}
        http.delete(f"/sandboxes/{sid}")


def _snapshot(http: httpx.Client, sid: str) -> tuple[Any, ...]:
    sandboxes = http.get("/sandboxes")
    events = http.get("/events")
    assert sandboxes.status_code == 200, sandboxes.text
    assert events.status_code == 200, events.text
    processes = http.get(f"/sandboxes/{sid}/processes")
    assert processes.status_code == 200
    return (
        sorted(s["sandbox_id"] for s in sandboxes.json()),
        [p["pid"] for p in processes.json()],
        [e["kind"] for e in events.json()],
    )


@pytest.mark.parametrize("probe", PROBES, ids=[p.name for p in PROBES])
def test_bad_input_is_refused_before_anything_changes(
    daemon: DaemonServer, target: tuple[httpx.Client, dict[str, str]], probe: Probe
) -> None:
    http, ids = target
    before = _snapshot(http, ids["sid"])
    response = http.request(
        probe.method,
        probe.path.format(**ids),
        content=probe.body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == probe.status, response.text[:500]
    body = response.json()
    assert body["code"] == probe.code
    assert body["message"]
    if probe.field is not None:
        assert body["details"]["field"] == probe.field, body
    # Nothing changed, and what the daemon serves still serialises.
    assert _snapshot(http, ids["sid"]) == before
    # The sandbox still works.
    echoed = http.post(f"/sandboxes/{ids['sid']}/processes", json={"argv": ["echo", "ok"]})
    assert echoed.status_code == 201


def _exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send one request and read one whole response (content-length bodies only)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a body"
        rest += chunk
    return head


def _request(method: str, path: str, token: str, body: bytes = b"") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@pytest.mark.parametrize(
    "bad", [b'{"timeout": NaN}', b"[" * 50_000, b'{"envs": {"A=": "1"}}', b'{"metadata": 1}']
)
def test_connection_stays_valid_after_an_error(daemon: DaemonServer, bad: bytes) -> None:
    token = daemon.token or ""
    with socket.create_connection((daemon.bind, daemon.port), timeout=10) as sock:
        for _ in range(3):
            head = _exchange(sock, _request("POST", "/sandboxes", token, bad))
            assert head.split(b" ")[1][:1] == b"4", head
            assert b"connection: close" not in head.lower()
            head = _exchange(sock, _request("GET", "/sandboxes", token))
            assert head.startswith(b"HTTP/1.1 200"), head
    assert daemon.host.sandboxes == {}


def test_oversized_body_by_content_length_is_refused_unread(daemon: DaemonServer) -> None:
    # A client announcing 100 MB gets 413 at once, without the daemon buffering it.
    token = daemon.token or ""
    with socket.create_connection((daemon.bind, daemon.port), timeout=10) as sock:
        sock.sendall(
            (
                "POST /sandboxes HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {100 * 1024 * 1024}\r\n\r\n"
            ).encode()
            + b'{"metadata": {"x": "'
        )
        head = _exchange(sock, b"")
        assert head.startswith(b"HTTP/1.1 413"), head
    assert daemon.host.sandboxes == {}


def test_whatever_is_stored_still_serialises(daemon: DaemonServer) -> None:
    # Defence in depth: even a value that slipped past validation (set here behind the
    # API's back) must not take the list or the journal down with it.
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        sandbox = daemon.host.sandboxes[sid]
        sandbox.timeout = float("nan")
        sandbox.metadata["k\udcff"] = "v\ud800"
        daemon.host.journal.record("test.odd", sandbox_id=sid, value=float("inf"), text="\udfff")
        for path in ("/sandboxes", f"/sandboxes/{sid}", "/events", f"/sandboxes/{sid}/events"):
            response = http.get(path)
            assert response.status_code == 200, (path, response.text)
            response.json()  # valid JSON
        listed = http.get(f"/sandboxes/{sid}").json()
        assert listed["timeout"] is None
        assert listed["metadata"] == {"k\ufffd": "v\ufffd"}
        sandbox.timeout = None
        http.delete(f"/sandboxes/{sid}")


def test_openapi_lists_only_the_errors_each_route_can_return(daemon: DaemonServer) -> None:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as http:
        doc = http.get("/openapi.json").json()
    paths = doc["paths"]

    def statuses(path: str, method: str) -> set[str]:
        return set(paths[path][method]["responses"])

    # 503 on every route: the daemon at its connection or file-descriptor limit.
    assert statuses("/health", "get") == {"200", "401", "503"}
    assert statuses("/sandboxes", "get") == {"200", "401", "503"}
    assert statuses("/sandboxes", "post") == {"201", "400", "401", "413", "422", "501", "503"}
    assert statuses("/sandboxes/{sid}/pause", "post") == {"200", "401", "404", "503"}
    assert statuses("/sandboxes/{sid}/processes/{pid}/stream", "get") == {
        "200",
        "401",
        "404",
        "410",
        "422",
        "503",
    }
    stdin = paths["/sandboxes/{sid}/processes/{pid}/stdin"]["post"]
    assert "stdin_seq_mismatch" in stdin["responses"]["409"]["description"]
    # Request bodies come from the models, with their bounds.
    create = doc["components"]["schemas"]["CreateSandbox"]
    assert create["additionalProperties"] is False
    timeout = next(s for s in create["properties"]["timeout"]["anyOf"] if s["type"] == "number")
    assert timeout["exclusiveMinimum"] == 0 and timeout["maximum"] > 0
    # The consumer states are documented where the rows are.
    row = doc["components"]["schemas"]["ConsumerRow"]
    assert set(row["properties"]["state"]["enum"]) == {
        "streaming",
        "blocked",
        "starved",
        "kicked",
        "closed",
    }
    assert "starved" in paths["/consumers"]["get"]["description"]
