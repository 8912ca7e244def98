"""The error vocabulary end to end: daemon status codes and JSON bodies, the client's
mapping back to typed errors, the error table itself, and the OpenAPI document."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Route
from support import fast_config, wait_until

import sandboxkit.errors as errors_module
from sandboxkit import AsyncSandbox
from sandboxkit._version import __version__
from sandboxkit.client.api import ApiClient
from sandboxkit.client.local import TOKEN_ENV, URL_ENV
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.http import create_app
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import (
    DAEMON_ERROR_TABLE,
    ERROR_TABLE,
    CommandExitError,
    ConsumerKicked,
    DaemonUnavailable,
    FileNotFound,
    InvalidArgument,
    MalformedFrame,
    NotFound,
    OutputGap,
    OutputIncomplete,
    OutputLost,
    ProcessNotFound,
    ProviderUnavailable,
    ProviderUnsupported,
    ResourceExhausted,
    ResultUnavailable,
    Retriable,
    SandboxClosed,
    SandboxkitError,
    SandboxNotFound,
    StdinBusy,
    StreamInterrupted,
    StreamStalled,
    Unauthorized,
    WaitTimeout,
    error_from_wire,
)
from sandboxkit.wire import FrameDecoder, FrameKind

# -- helpers -------------------------------------------------------------------------


def _http(daemon: DaemonServer) -> httpx.Client:
    return httpx.Client(
        base_url=daemon.url,
        headers={"Authorization": f"Bearer {daemon.token}"},
        timeout=httpx.Timeout(10.0),
    )


def _run_echo(client: httpx.Client, text: str) -> tuple[str, int]:
    """Create a sandbox, run ``echo text`` in it and read its whole stream (raw HTTP).

    Returns the sandbox id and the pid; asserts the output and the exit code."""
    created = client.post("/sandboxes", json={})
    assert created.status_code == 201, created.text
    sid = created.json()["sandbox_id"]
    started = client.post(f"/sandboxes/{sid}/processes", json={"argv": ["echo", text]})
    assert started.status_code == 201, started.text
    pid = started.json()["pid"]
    decoder = FrameDecoder()
    output = b""
    end = None
    with client.stream(
        "GET", f"/sandboxes/{sid}/processes/{pid}/stream", params={"cursor": 0}
    ) as r:
        assert r.status_code == 200
        for data in r.iter_raw():
            for frame in decoder.feed(data):
                if frame.kind is FrameKind.DATA:
                    output += frame.payload
                elif frame.kind is FrameKind.END:
                    end = frame
            if end is not None:
                break
    assert end is not None, "stream ended without an end frame"
    assert end.meta["exit_code"] == 0
    assert output == text.encode() + b"\n"
    return sid, pid


@dataclass
class Ctx:
    """A sandbox with one exited process, as the bad requests' target."""

    sid: str
    pid: int
    head: int
    token: str

    @property
    def unknown_pid(self) -> int:
        return self.pid + 1

    @property
    def proc(self) -> str:
        return f"/sandboxes/{self.sid}/processes"


@dataclass(frozen=True)
class Bad:
    """One bad request: how to send it and what the daemon must answer."""

    name: str
    method: str
    path: Callable[[Ctx], str]
    status: int
    code: str
    content: bytes | None = None
    body: Any = None
    params: Callable[[Ctx], dict[str, Any]] | None = None
    auth: Callable[[Ctx], str | None] | None = None  # None: the right token
    details: Callable[[Ctx], dict[str, Any]] = field(default=lambda c: {})


def _bad_field(name: str, method: str, path: Callable[[Ctx], str], fld: str, **kw: Any) -> Bad:
    return Bad(name, method, path, 422, "invalid_argument", details=lambda c: {"field": fld}, **kw)


def _sbx(c: Ctx) -> str:
    return "/sandboxes"


BAD_REQUESTS = [
    # -- unknown things
    Bad(
        "unknown-sandbox-get",
        "GET",
        lambda c: "/sandboxes/sbx-nope",
        404,
        "sandbox_not_found",
        details=lambda c: {"sandbox_id": "sbx-nope"},
    ),
    Bad(
        "unknown-sandbox-start",
        "POST",
        lambda c: "/sandboxes/sbx-nope/processes",
        404,
        "sandbox_not_found",
        body={"cmd": "echo hi"},
        details=lambda c: {"sandbox_id": "sbx-nope"},
    ),
    Bad(
        "unknown-sandbox-delete",
        "DELETE",
        lambda c: "/sandboxes/sbx-nope",
        404,
        "sandbox_not_found",
        details=lambda c: {"sandbox_id": "sbx-nope"},
    ),
    Bad(
        "unknown-pid-kill",
        "POST",
        lambda c: f"{c.proc}/{c.unknown_pid}/kill",
        404,
        "process_not_found",
        details=lambda c: {"sandbox_id": c.sid, "pid": c.unknown_pid},
    ),
    Bad(
        "unknown-pid-get",
        "GET",
        lambda c: f"{c.proc}/{c.unknown_pid}",
        410,
        "result_unavailable",
        details=lambda c: {"sandbox_id": c.sid, "pid": c.unknown_pid, "reason": "unknown"},
    ),
    Bad(
        "unknown-pid-stream",
        "GET",
        lambda c: f"{c.proc}/{c.unknown_pid}/stream",
        410,
        "result_unavailable",
        details=lambda c: {"sandbox_id": c.sid, "pid": c.unknown_pid, "reason": "unknown"},
    ),
    # -- bodies that are not JSON objects
    Bad("malformed-json-create", "POST", _sbx, 400, "malformed_frame", content=b'{"timeout": '),
    Bad(
        "malformed-json-start",
        "POST",
        lambda c: c.proc,
        400,
        "malformed_frame",
        content=b"{cmd: echo}",
    ),
    Bad("invalid-utf8-body", "POST", _sbx, 400, "malformed_frame", content=b"\xff\xfe{}"),
    Bad("json-array-body", "POST", _sbx, 400, "malformed_frame", content=b"[1, 2]"),
    Bad(
        "json-string-body",
        "POST",
        lambda c: c.proc,
        400,
        "malformed_frame",
        content=b'"echo hi"',
    ),
    Bad("json-null-body", "POST", _sbx, 400, "malformed_frame", content=b"null"),
    # -- well-formed requests with bad values
    _bad_field("create-timeout-str", "POST", _sbx, "timeout", body={"timeout": "abc"}),
    _bad_field("create-timeout-bool", "POST", _sbx, "timeout", body={"timeout": True}),
    _bad_field("create-timeout-negative", "POST", _sbx, "timeout", body={"timeout": -1}),
    _bad_field("create-on-timeout", "POST", _sbx, "on_timeout", body={"on_timeout": "explode"}),
    _bad_field("create-on-timeout-int", "POST", _sbx, "on_timeout", body={"on_timeout": 3}),
    _bad_field("create-envs-value", "POST", _sbx, "envs", body={"envs": {"A": 1}}),
    _bad_field("create-envs-list", "POST", _sbx, "envs", body={"envs": ["A=1"]}),
    _bad_field("create-auto-resume", "POST", _sbx, "auto_resume", body={"auto_resume": "yes"}),
    _bad_field("create-fanout", "POST", _sbx, "lab.fanout", body={"lab": {"fanout": "bogus"}}),
    _bad_field("start-argv-str", "POST", lambda c: c.proc, "argv", body={"argv": "echo hi"}),
    _bad_field("start-argv-int", "POST", lambda c: c.proc, "argv", body={"argv": ["echo", 1]}),
    _bad_field("start-argv-empty", "POST", lambda c: c.proc, "argv", body={"argv": []}),
    _bad_field("start-no-command", "POST", lambda c: c.proc, "cmd", body={}),
    _bad_field(
        "start-cmd-and-argv", "POST", lambda c: c.proc, "cmd", body={"cmd": "x", "argv": ["x"]}
    ),
    _bad_field(
        "start-envs", "POST", lambda c: c.proc, "envs", body={"cmd": "true", "envs": {"A": 1}}
    ),
    _bad_field(
        "start-timeout",
        "POST",
        lambda c: c.proc,
        "timeout",
        body={"cmd": "true", "timeout": "abc"},
    ),
    _bad_field("start-cwd", "POST", lambda c: c.proc, "cwd", body={"cmd": "true", "cwd": ["/"]}),
    _bad_field(
        "stream-cursor-beyond-head",
        "GET",
        lambda c: f"{c.proc}/{c.pid}/stream",
        "cursor",
        params=lambda c: {"cursor": c.head + 1},
    ),
    _bad_field(
        "stream-cursor-far-beyond-head",
        "GET",
        lambda c: f"{c.proc}/{c.pid}/stream",
        "cursor",
        params=lambda c: {"cursor": 10**12},
    ),
    _bad_field(
        "stream-cursor-negative",
        "GET",
        lambda c: f"{c.proc}/{c.pid}/stream",
        "cursor",
        params=lambda c: {"cursor": -1},
    ),
    _bad_field(
        "stream-cursor-not-int",
        "GET",
        lambda c: f"{c.proc}/{c.pid}/stream",
        "cursor",
        params=lambda c: {"cursor": "abc"},
    ),
    _bad_field("pid-not-int-get", "GET", lambda c: f"{c.proc}/abc", "pid"),
    _bad_field("pid-not-int-kill", "POST", lambda c: f"{c.proc}/1.5/kill", "pid"),
    _bad_field("pid-not-int-stream", "GET", lambda c: f"{c.proc}/x/stream", "pid"),
    _bad_field(
        "events-since-not-int",
        "GET",
        lambda c: f"/sandboxes/{c.sid}/events",
        "since",
        params=lambda c: {"since": "abc"},
    ),
    _bad_field(
        "stdin-not-base64",
        "POST",
        lambda c: f"{c.proc}/{c.pid}/stdin",
        "data",
        body={"session": "s", "seq": 0, "data": "***"},
    ),
    # -- authentication
    Bad("wrong-token", "GET", _sbx, 401, "unauthorized", auth=lambda c: f"Bearer {c.token}x"),
    Bad("missing-token", "POST", _sbx, 401, "unauthorized", body={}, auth=lambda c: None),
    Bad(
        "wrong-scheme",
        "GET",
        lambda c: "/health",
        401,
        "unauthorized",
        auth=lambda c: f"Token {c.token}",
    ),
    Bad(
        "token-prefix",
        "GET",
        lambda c: "/openapi.json",
        401,
        "unauthorized",
        auth=lambda c: f"Bearer {c.token[:-1]}",
    ),
]


def _send(daemon: DaemonServer, ctx: Ctx, bad: Bad) -> httpx.Response:
    headers: dict[str, str] = {}
    if bad.auth is not None:
        value = bad.auth(ctx)
        if value is not None:
            headers["Authorization"] = value
    else:
        headers["Authorization"] = f"Bearer {daemon.token}"
    kwargs: dict[str, Any] = {"headers": headers}
    if bad.content is not None:
        kwargs["content"] = bad.content
        kwargs["headers"]["Content-Type"] = "application/json"
    elif bad.body is not None:
        kwargs["json"] = bad.body
    if bad.params is not None:
        kwargs["params"] = bad.params(ctx)
    with httpx.Client(base_url=daemon.url, timeout=10.0) as raw:
        return raw.request(bad.method, bad.path(ctx), **kwargs)


def _traces(daemon: DaemonServer, probe_sid: str) -> tuple[set[str], set[str]]:
    """Sandbox working directories and sandbox cgroups that exist right now."""
    workdirs = {p.name for p in daemon.host.root.iterdir()}
    cgroups: set[str] = set()
    cg_path = getattr(daemon.host.sandboxes[probe_sid].tree, "path", None)
    if isinstance(cg_path, Path) and cg_path.parent.is_dir():
        cgroups = {p.name for p in cg_path.parent.iterdir() if p.is_dir()}
    return workdirs, cgroups


# -- 1. bad requests: status, body, and the daemon keeps serving ------------------------


@pytest.fixture(scope="module")
def refusing_daemon() -> Iterator[DaemonServer]:
    """One daemon for every bad request of the table: each is refused without changing
    anything, so the daemon that refused all the previous ones must still serve."""
    server = DaemonServer(fast_config()).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=[b.name for b in BAD_REQUESTS])
def test_bad_request_is_typed_and_daemon_keeps_serving(
    refusing_daemon: DaemonServer, bad: Bad
) -> None:
    daemon = refusing_daemon
    with _http(daemon) as client:
        sid, pid = _run_echo(client, "target")
        wait_until(
            lambda: client.get(f"/sandboxes/{sid}/processes/{pid}").json()["state"] != "running",
            what="the echo process to exit",
        )
        head = client.get(f"/sandboxes/{sid}/processes/{pid}").json()["head"]
        assert head >= 1
        ctx = Ctx(sid, pid, head, daemon.token or "")
        # The sandbox made ahead for the next create (daemon/spare.py) is remade once the
        # daemon is quiet after the create took it: on the daemon's schedule, not the
        # request's, so before the traces are taken.
        spare = daemon.host.spare
        wait_until(lambda: spare is None or spare.sandbox is not None, what="the spare made")
        sandboxes_before = {s["sandbox_id"] for s in client.get("/sandboxes").json()}
        traces_before = _traces(daemon, sid)

        response = _send(daemon, ctx, bad)

        assert response.status_code == bad.status, response.text
        assert response.headers["content-type"].startswith("application/json")
        body = response.json()
        assert set(body) == {"code", "message", "details"}
        assert body["code"] == bad.code
        assert isinstance(body["message"], str) and body["message"]
        for key, value in bad.details(ctx).items():
            assert body["details"].get(key) == value, body
        # The client turns this body into the class the table names, with the same fields.
        error = error_from_wire(body, response.status_code)
        assert type(error) is ERROR_TABLE[bad.code]
        assert error.status == bad.status
        for key, value in bad.details(ctx).items():
            assert getattr(error, key) == value

        # A refused request changes nothing: no sandbox, no directory, no cgroup left over.
        assert {s["sandbox_id"] for s in client.get("/sandboxes").json()} == sandboxes_before
        assert _traces(daemon, sid) == traces_before

        # ... and the daemon keeps serving: a fresh sandbox runs a command end to end.
        _run_echo(client, f"still serving after {bad.name}")
        health = client.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "ok"


# -- 1b. the SDK raises the typed errors with their fields ---------------------------------


@pytest.mark.timeout(30)
async def test_sdk_not_found_and_unavailable(conn: dict[str, str]) -> None:
    with pytest.raises(SandboxNotFound) as missing:
        await AsyncSandbox.connect("sbx-missing", **conn)
    assert missing.value.sandbox_id == "sbx-missing"
    assert missing.value.status == 404

    async with await AsyncSandbox.create(**conn) as sbx:
        result = await sbx.commands.run("echo hi")
        assert result.pid is not None
        unknown = result.pid + 1
        api = ApiClient(conn["url"], conn["token"])
        try:
            with pytest.raises(ProcessNotFound) as not_found:
                await api.call("POST", f"/sandboxes/{sbx.sandbox_id}/processes/{unknown}/kill")
            assert (not_found.value.sandbox_id, not_found.value.pid) == (sbx.sandbox_id, unknown)
        finally:
            await api.aclose()
        # The SDK's kill() turns exactly that error into False.
        assert await sbx.commands.kill(unknown) is False

        with pytest.raises(ResultUnavailable) as gone:
            await sbx.commands.get(unknown)
        assert gone.value.pid == unknown
        assert gone.value.sandbox_id == sbx.sandbox_id
        assert gone.value.reason == "unknown"

        # connect() itself raises: no handle of a process that cannot be followed.
        with pytest.raises(ResultUnavailable) as gone_stream:
            await sbx.commands.connect(unknown)
        assert gone_stream.value.pid == unknown
        assert gone_stream.value.reason == "unknown"

        # The sandbox is unharmed.
        assert (await sbx.commands.run("echo after")).stdout == "after\n"


@pytest.mark.timeout(30)
async def test_sdk_invalid_arguments_and_malformed_bodies(conn: dict[str, str]) -> None:
    bad_creates: list[tuple[dict[str, Any], str]] = [
        ({"timeout": "abc"}, "timeout"),
        ({"on_timeout": "explode"}, "on_timeout"),
        ({"envs": {"A": 1}}, "envs"),
    ]
    for kwargs, fld in bad_creates:
        with pytest.raises(InvalidArgument) as bad:
            await AsyncSandbox.create(**kwargs, **conn)
        assert bad.value.field == fld, kwargs

    async with await AsyncSandbox.create(**conn) as sbx:
        with pytest.raises(InvalidArgument) as bad_argv:
            await sbx.commands.run(["echo", 1])  # type: ignore[list-item]
        assert bad_argv.value.field == "argv"
        with pytest.raises(InvalidArgument) as bad_envs:
            await sbx.commands.run("true", envs={"A": 1})  # type: ignore[dict-item]
        assert bad_envs.value.field == "envs"
        with pytest.raises(InvalidArgument) as bad_timeout:
            await sbx.commands.run("true", timeout="abc")  # type: ignore[arg-type]
        assert bad_timeout.value.field == "timeout"

        result = await sbx.commands.run("echo one")
        info = await sbx.commands.get(result.pid or 0)
        for cursor in (info.head + 1, -1):
            with pytest.raises(InvalidArgument) as bad_cursor:  # at connect, not at wait
                await sbx.commands.connect(info.pid, cursor=cursor)
            assert bad_cursor.value.field == "cursor"
        # Cursor == head is valid: nothing more to read, just the exit.
        at_head = await sbx.commands.connect(info.pid, cursor=info.head)
        assert (await asyncio.wait_for(at_head.wait(), 10)).exit_code == 0

        api = ApiClient(conn["url"], conn["token"])
        try:
            path = f"/sandboxes/{sbx.sandbox_id}/processes"
            with pytest.raises(MalformedFrame):
                await api.call("POST", path, json=["echo", "hi"])
            with pytest.raises(MalformedFrame):
                await api.call("POST", path, json="echo hi")
            with pytest.raises(InvalidArgument) as bad_pid:
                await api.call("GET", f"{path}/abc")
            assert bad_pid.value.field == "pid"
        finally:
            await api.aclose()

        assert (await sbx.commands.run("echo two")).stdout == "two\n"


@pytest.mark.timeout(30)
async def test_sdk_unauthorized(
    daemon: DaemonServer, conn: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(URL_ENV, raising=False)
    with pytest.raises(Unauthorized) as wrong:
        await AsyncSandbox.create(url=conn["url"], token=conn["token"] + "x")
    assert wrong.value.status == 401
    with pytest.raises(Unauthorized):
        await AsyncSandbox.list(url=conn["url"], token=None)
    api = ApiClient(conn["url"], None)
    try:
        with pytest.raises(Unauthorized):
            await api.call("GET", "/health")
        with pytest.raises(Unauthorized):
            async with api.stream("/sandboxes/sbx-x/processes/1/stream"):
                pass
    finally:
        await api.aclose()
    assert daemon.host.sandboxes == {}, "a refused request must not create anything"
    assert await AsyncSandbox.list(**conn) == []


# -- 2. the error table and the tree -----------------------------------------------------

DOCS = Path(__file__).resolve().parent.parent / "docs" / "errors.md"
CATEGORIES: tuple[type[SandboxkitError], ...] = (NotFound, StreamInterrupted, Retriable, OutputLost)


def _markdown_table(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with ``| header |``, cells
    stripped of their backticks."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows: list[list[str]] = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("`", "") for cell in line.strip("|").split("|")])
    return rows


def _names(cell: str) -> set[str]:
    return set() if cell == "—" else {name.strip() for name in cell.split(",")}


def test_docs_table_matches_the_code() -> None:
    rows = _markdown_table(DOCS.read_text(), "code")
    documented = {row[0]: row for row in rows}
    assert len(documented) == len(rows), "a code is listed twice"
    assert set(documented) == set(ERROR_TABLE)
    for code, (_, name, status, origin, categories, meaning) in documented.items():
        cls = ERROR_TABLE[code]
        assert (name, int(status), origin) == (cls.__name__, cls.status, cls.origin), code
        assert _names(categories) == {c.__name__ for c in CATEGORIES if issubclass(cls, c)}
        assert meaning, code
    members = {row[0]: _names(row[2]) for row in _markdown_table(DOCS.read_text(), "category")}
    assert members == {
        c.__name__: {e.__name__ for e in ERROR_TABLE.values() if issubclass(e, c)}
        for c in CATEGORIES
    }
    # Codes are unique keys naming their own class; all errors share the base class.
    for code, cls in ERROR_TABLE.items():
        assert cls.code == code
        assert issubclass(cls, SandboxkitError) and cls not in (SandboxkitError, *CATEGORIES)
    # Every public error class is in the table; the categories are not (no wire code).
    public = {
        obj
        for name in errors_module.__all__
        if isinstance(obj := getattr(errors_module, name), type)
        and issubclass(obj, SandboxkitError)
        and obj is not SandboxkitError
    }
    assert public == set(ERROR_TABLE.values()) | set(CATEGORIES)
    assert {c.code for c in CATEGORIES} == {"internal"}
    # The public package exports them all.
    import sandboxkit

    assert {cls.__name__ for cls in public} <= set(sandboxkit.__all__)


def test_module_docstring_tree_is_the_class_tree() -> None:
    doc = errors_module.__doc__ or ""
    block = doc[doc.index("::\n") + 3 :].strip("\n").split("\n\n")[0]
    edges: set[tuple[str, str]] = set()
    parents: list[str] = []
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip())) // 4 - 1
        name = line.strip()
        del parents[depth:]
        if parents:
            edges.add((parents[-1], name))
        parents.append(name)
    classes = [*ERROR_TABLE.values(), *CATEGORIES]
    actual = {(base.__name__, cls.__name__) for cls in classes for base in cls.__bases__}
    assert edges == actual


@pytest.mark.parametrize("category", CATEGORIES, ids=lambda c: c.__name__)
def test_a_category_catches_its_members_and_nothing_else(
    category: type[SandboxkitError],
) -> None:
    members = {
        NotFound: {SandboxNotFound, ProcessNotFound, ResultUnavailable, FileNotFound},
        StreamInterrupted: {ConsumerKicked, StreamStalled, DaemonUnavailable, MalformedFrame},
        Retriable: {ConsumerKicked, StreamStalled, DaemonUnavailable, StdinBusy, ResourceExhausted},
        OutputLost: {OutputGap, OutputIncomplete},
    }[category]
    for cls in ERROR_TABLE.values():
        try:
            raise cls("x")
        except category:
            caught = True
        except SandboxkitError:
            caught = False
        assert caught == (cls in members), cls


def test_client_only_errors_are_never_the_daemons() -> None:
    client_only = {
        SandboxClosed,
        StreamStalled,
        CommandExitError,
        DaemonUnavailable,
        OutputGap,
        OutputIncomplete,
        WaitTimeout,
        ProviderUnavailable,
        ProviderUnsupported,
    }
    assert {cls for cls in ERROR_TABLE.values() if cls.origin == "client"} == client_only
    assert set(DAEMON_ERROR_TABLE.values()) == set(ERROR_TABLE.values()) - client_only
    # The bottom layer names no client type: errors.py imports nothing of the client.
    source = Path(errors_module.__file__ or "").read_text()
    assert "sandboxkit.client" not in source


_json_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)


def _field_values(cls: type[SandboxkitError]) -> st.SearchStrategy[dict[str, Any]]:
    # ``result`` holds a CommandResult, which is not JSON: it never crosses the wire.
    return st.fixed_dictionaries(
        {name: st.none() if name == "result" else _json_scalar for name in cls.fields}
    )


@pytest.mark.parametrize("cls", list(ERROR_TABLE.values()), ids=list(ERROR_TABLE))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), message=st.text(min_size=1, max_size=40))
def test_every_error_round_trips_through_the_wire(
    cls: type[SandboxkitError], data: st.DataObject, message: str
) -> None:
    values = data.draw(_field_values(cls))
    original = cls(message, **values)
    wire = json.loads(json.dumps(original.to_wire()))  # really over the wire
    assert wire["code"] == cls.code
    again = error_from_wire(wire, cls.status)
    assert type(again) is cls
    assert again.message == message
    assert again.details == original.details == values
    for name, value in values.items():
        assert getattr(again, name) == value


def test_non_json_result_is_dropped_not_fatal() -> None:
    from sandboxkit import CommandResult

    result = CommandResult("out", "err", 3, 7)
    error = CommandExitError("exited 3", pid=7, exit_code=3, result=result)
    assert error.result is result
    wire = json.loads(json.dumps(error.to_wire()))
    again = error_from_wire(wire)
    assert type(again) is CommandExitError
    assert (again.pid, again.exit_code, again.result) == (7, 3, None)


def test_unknown_fields_are_refused_locally_and_ignored_from_the_wire() -> None:
    with pytest.raises(TypeError):
        SandboxNotFound("x", pid=3)  # type: ignore[call-arg]
    body = {"code": "sandbox_not_found", "message": "m", "details": {"sandbox_id": "s", "x": 1}}
    error = error_from_wire(body, 404)
    assert type(error) is SandboxNotFound
    assert error.sandbox_id == "s"
    odd = error_from_wire({"code": "process_not_found", "message": "m", "details": [1]}, 404)
    assert type(odd) is ProcessNotFound and odd.pid is None
    unknown = error_from_wire({"code": "no_such_code", "message": "hello"}, 418)
    assert type(unknown) is SandboxkitError and unknown.message == "hello"
    for body_ in (None, "text", [1, 2], {"message": "no code"}, {"code": 5}):
        fallback = error_from_wire(body_, 502)
        assert type(fallback) is SandboxkitError
        assert "502" in fallback.message


_SAMPLES: dict[str, Any] = {
    "sandbox_id": "sbx-1234abcd",
    "pid": 4242,
    "reason": "evicted",
    "cursor": 17,
    "first_available": 23,
    "bytes_lost": 999,
    "blocked_for": 5.5,
    "silence": 2.25,
    "exit_code": 3,
    "expected": 2,
    "got": 5,
    "buffered": 2048,
    "sessions": 7,
    "resource": "file_descriptors",
    "limit": 1024,
    "url": "http://127.0.0.1:1",
    "field": "timeout",
    "result": None,
    "path": "sub/missing.txt",
    "timeout": 1.5,
    "missing": "bubblewrap is not installed",
    "provider": "e2b",
    "operation": "pause",
}


def _sample(cls: type[SandboxkitError]) -> SandboxkitError:
    missing = set(cls.fields) - set(_SAMPLES)
    assert not missing, f"add samples for {missing}"
    return cls(f"scripted {cls.code}", **{name: _SAMPLES[name] for name in cls.fields})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cls", list(ERROR_TABLE.values()), ids=list(ERROR_TABLE))
async def test_client_maps_http_error_to_class(cls: type[SandboxkitError]) -> None:
    expected = _sample(cls)
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(cls.status, json=expected.to_wire())

    api = ApiClient("http://daemon.test", "tok", transport=httpx.MockTransport(handler))
    try:
        with pytest.raises(cls) as raised:
            await api.call("POST", "/sandboxes", json={"a": 1}, cursor=None)
        assert type(raised.value) is cls
        assert raised.value.message == expected.message
        assert raised.value.details == expected.details
        with pytest.raises(cls) as raised_stream:
            async with api.stream("/sandboxes/s/processes/1/stream", cursor=3):
                pytest.fail("a stream answered with an error must not open")
        assert raised_stream.value.details == expected.details
    finally:
        await api.aclose()
    assert len(seen) == 2
    assert all(r.headers["authorization"] == "Bearer tok" for r in seen)
    assert json.loads(seen[0].content) == {"a": 1}
    assert "cursor" not in seen[0].url.params  # None parameters are not sent
    assert seen[1].url.params["cursor"] == "3"


@pytest.mark.timeout(30)
async def test_client_survives_non_json_and_odd_responses() -> None:
    answers = iter(
        [
            httpx.Response(500, content=b"<html>Internal Server Error</html>"),
            httpx.Response(502, content=b""),
            httpx.Response(404, json={"code": "http_error", "message": "Not Found", "details": {}}),
            httpx.Response(200, content=b"not json at all"),
            httpx.Response(500, content=b"Internal Server Error"),
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return next(answers)

    api = ApiClient("http://daemon.test", "tok", transport=httpx.MockTransport(handler))
    try:
        with pytest.raises(SandboxkitError) as html:
            await api.call("GET", "/health")
        assert type(html.value) is SandboxkitError
        assert "500" in html.value.message
        with pytest.raises(SandboxkitError) as empty:
            await api.call("GET", "/health")
        assert type(empty.value) is SandboxkitError
        assert "502" in empty.value.message
        with pytest.raises(SandboxkitError) as unknown:
            await api.call("GET", "/nowhere")
        assert type(unknown.value) is SandboxkitError
        assert unknown.value.message == "Not Found"
        with pytest.raises(MalformedFrame):
            await api.call("GET", "/health")
        with pytest.raises(SandboxkitError) as stream_500:
            async with api.stream("/x"):
                pytest.fail("must not open")
        assert type(stream_500.value) is SandboxkitError
    finally:
        await api.aclose()


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A loopback URL nothing listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield f"http://127.0.0.1:{port}"


@pytest.mark.timeout(30)
async def test_connection_refused_is_daemon_unavailable(dead_url: str) -> None:
    api = ApiClient(dead_url, "tok")
    try:
        with pytest.raises(DaemonUnavailable) as call:
            await api.call("GET", "/health")
        assert call.value.url == dead_url
        assert call.value.status == 503
        # A loopback daemon is reached below httpx (client/raw_unary.py): the OS's error.
        assert isinstance(call.value.__cause__, ConnectionRefusedError)
        with pytest.raises(DaemonUnavailable) as stream:
            async with api.stream("/sandboxes/s/processes/1/stream"):
                pytest.fail("must not open")
        assert stream.value.url == dead_url
    finally:
        await api.aclose()
    with pytest.raises(DaemonUnavailable):
        await AsyncSandbox.create(url=dead_url, token="tok")


# -- 3. the OpenAPI document ---------------------------------------------------------------


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


@pytest.mark.timeout(30)
async def test_openapi_lists_every_route(daemon: DaemonServer) -> None:
    async with httpx.AsyncClient(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}
    ) as client:
        response = await client.get("/openapi.json")
    assert response.status_code == 200
    doc = response.json()

    assert re.fullmatch(r"3\.\d+\.\d+", doc["openapi"])
    assert doc["info"]["title"]
    assert doc["info"]["version"] == __version__
    assert isinstance(doc["paths"], dict) and doc["paths"]

    host = Host(fast_config())
    try:
        starlette_app: Any = create_app(host, "tok")
        while not isinstance(starlette_app, Starlette):  # under the ASGI middlewares
            starlette_app = starlette_app.app
        assert all(isinstance(r, Route) for r in starlette_app.routes)
        routes = {
            (r.path, method)
            for r in starlette_app.routes
            for method in (r.methods or set())
            if method != "HEAD"
        }
    finally:
        await host.close()
    documented = {
        (path, method.upper()) for path, operations in doc["paths"].items() for method in operations
    }
    assert documented == routes
    assert ("/openapi.json", "GET") in routes and ("/health", "GET") in routes

    schemes = doc["components"]["securitySchemes"]
    error_schema = doc["components"]["schemas"]["Error"]
    assert {"code", "message"} <= set(error_schema["required"])
    enum = error_schema["properties"]["code"]["enum"]
    assert len(enum) == len(set(enum))
    # Only what the daemon can answer with: no client-side error (a watchdog, a closed
    # client, a non-zero exit) is advertised.
    assert set(enum) == set(DAEMON_ERROR_TABLE)
    statuses = {str(cls.status) for cls in DAEMON_ERROR_TABLE.values()}
    health = doc["paths"]["/health"]["get"]["responses"]
    assert set(health) == {"200", "401", "503"}, health

    operation_ids: list[str] = []
    for path, operations in doc["paths"].items():
        placeholders = set(re.findall(r"{(\w+)}", path))
        for method, op in operations.items():
            assert method in {"get", "post", "put", "delete", "patch"}
            assert op["summary"]
            operation_ids.append(op["operationId"])
            params = op["parameters"]
            keys = [(p["name"], p["in"]) for p in params]
            assert len(keys) == len(set(keys)), (path, method)
            in_path = {p["name"] for p in params if p["in"] == "path"}
            assert in_path == placeholders, (path, method)
            assert all(p["required"] for p in params if p["in"] == "path")
            assert all(p["in"] in {"path", "query", "header"} for p in params)
            assert {"200", "201"} & set(op["responses"]), (path, method)
            # Each route lists only the errors it can return (401 on every one).
            listed = set(op["responses"]) - {"200", "201"}
            assert "401" in listed and listed <= statuses, (path, method)
            for status in listed:
                answer = op["responses"][status]
                assert answer["description"]
                codes = set(re.findall(r"^`(\w+)`:", answer["description"], re.MULTILINE))
                assert codes and codes <= set(DAEMON_ERROR_TABLE), (path, method, codes)
                assert all(DAEMON_ERROR_TABLE[c].status == int(status) for c in codes)
                schema = answer["content"]["application/json"]["schema"]
                assert _resolve(doc, schema["$ref"]) is error_schema
            for requirement in op["security"]:
                assert set(requirement) <= set(schemes)
    assert len(operation_ids) == len(set(operation_ids))
    assert schemes["bearer"] == {"type": "http", "scheme": "bearer"}
