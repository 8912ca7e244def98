"""The daemon's HTTP layer relies on private internals of uvicorn and asyncio in one
module, ``sandboxkit/daemon/http/fast_path.py``. These tests check each of them on the
real classes of the installed versions, for every HTTP implementation uvicorn can load
here and every event loop installed, so that an upgrade that changes them fails here,
naming the attribute and the version, instead of streams misbehaving; and they check
that the daemon takes the plain ASGI path, not a broken one, when they are missing."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import socket
import sys
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from sandboxkit.daemon.http import fast_path
from sandboxkit.daemon.http.responses import JsonArrayResponse
from sandboxkit.daemon.schema import encode_json


def _implementations() -> list[str]:
    """uvicorn's HTTP implementations that load here (``auto`` is one of them)."""
    loadable = []
    for name, path in HTTP_PROTOCOLS.items():
        if name == "auto":
            continue
        try:
            import_from_string(path)
        except ImportError:
            continue
        loadable.append(name)
    return loadable


def _loops() -> list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]]:
    loops: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [
        ("asyncio", asyncio.new_event_loop)
    ]
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        pass
    else:
        loops.append(("uvloop", uvloop.new_event_loop))
    return loops


def _request_through_uvicorn(http: str, new_loop: Callable[[], asyncio.AbstractEventLoop]) -> Any:
    """One HTTP/1.1 request served by a real uvicorn (``http`` implementation) on a
    loopback socket: the scope and ``send`` its app was called with, after
    :func:`fast_path.expose_cycle` saw them."""
    seen: list[tuple[dict[str, Any], Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        fast_path.expose_cycle(scope, send)
        seen.append((scope, send))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    class Server(uvicorn.Server):
        started_event: asyncio.Event

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            self.started_event.set()

    async def main() -> None:
        config = uvicorn.Config(app, http=http, lifespan="off", log_level="warning")
        server = Server(config)
        server.started_event = asyncio.Event()
        sock = socket.create_server(("127.0.0.1", 0))
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        try:
            await asyncio.wait_for(server.started_event.wait(), 10)
            reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200"), answer
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10)
            sock.close()

    errors: list[BaseException] = []

    def run() -> None:  # on its own thread: uvicorn installs no signal handlers there
        loop = new_loop()
        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            errors.append(exc)
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="uvicorn-internals")
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "uvicorn did not stop"
    if errors:
        raise errors[0]
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("loop_name,new_loop", _loops(), ids=[n for n, _ in _loops()])
@pytest.mark.parametrize("http", _implementations())
def test_uvicorns_request_cycle_has_what_the_fast_path_uses(
    http: str, loop_name: str, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    scope, send = _request_through_uvicorn(http, new_loop)
    cycle = getattr(send, "__self__", None)
    where = f"uvicorn {uvicorn.__version__} (http={http}, loop={loop_name})"
    assert cycle is not None, (
        f"{where}: the app's send is not a method of a request cycle "
        f"({send!r}); sandboxkit/daemon/http/fast_path.py reads the cycle through it"
    )
    kind = f"{type(cycle).__module__}.{type(cycle).__qualname__}"
    missing = fast_path.missing_internals(cycle)
    assert not missing, (
        f"{where}: {kind} has no {', '.join(missing)}, which "
        "sandboxkit/daemon/http/fast_path.py relies on (streams now take the plain ASGI path)"
    )
    assert scope.get(fast_path.CYCLE) is cycle, f"{where}: expose_cycle did not take {kind}"
    # What connections.py reads of the same cycle (its deadlines and token check).
    for name in ("scope", "more_body", "response_complete"):
        assert hasattr(cycle, name), (
            f"{where}: {kind} has no attribute {name!r}, which "
            "sandboxkit/daemon/http/connections.py relies on"
        )
    transport = cycle.transport
    for name in ("write", "writelines", "is_closing", "close", "get_extra_info"):
        assert hasattr(transport, name), f"{where}: {type(transport)} has no {name}()"
    assert transport.get_extra_info("socket") is not None, (
        f"{where}: the transport names no socket (tcp_peer.py reads its state)"
    )
    if loop_name == "asyncio":
        assert fast_path.SELECTOR_TRANSPORT != (), (
            f"Python {sys.version.split()[0]}: asyncio.selector_events has no "
            "_SelectorSocketTransport, which sandboxkit/daemon/http/fast_path.py writes "
            "beside (sends are now copied whole into the transport)"
        )
        assert isinstance(transport, fast_path.SELECTOR_TRANSPORT), (
            f"Python {sys.version.split()[0]}: a TCP connection's transport is "
            f"{type(transport)}, not asyncio.selector_events._SelectorSocketTransport"
        )
        for name in ("get_write_buffer_limits", "set_write_buffer_limits"):
            assert hasattr(transport, name), f"{where}: {type(transport)} has no {name}()"
    if loop_name == "uvloop":
        assert isinstance(transport, fast_path.SELECTOR_TRANSPORT), (
            f"{where}: a TCP connection's transport is {type(transport)}, not "
            "uvloop.loop.TCPTransport, which sandboxkit/daemon/http/fast_path.py writes "
            "beside (sends are now handed whole to the transport)"
        )


class _UvicornLikeCycle:
    """uvicorn's cycle's shape, except that its flow control lacks ``drain()``."""

    __module__ = "uvicorn.protocols.http.fake_impl"

    def __init__(self) -> None:
        self.transport = object()
        self.flow = SimpleNamespace(write_paused=False)
        self.disconnected = False

    async def send(self, message: Any) -> None:
        pass


def test_a_cycle_without_what_the_fast_path_uses_gets_the_plain_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A uvicorn whose cycle changed shape: the stream takes the plain ASGI path (not an
    AttributeError in the middle of a stream), and the log says what is missing, once."""
    cycle = _UvicornLikeCycle()
    scope: dict[str, Any] = {}
    with caplog.at_level(logging.WARNING, logger=fast_path.__name__):
        fast_path.expose_cycle(scope, cycle.send)
        fast_path.expose_cycle(scope, _UvicornLikeCycle().send)
    assert fast_path.CYCLE not in scope
    warnings = [r.getMessage() for r in caplog.records if r.name == fast_path.__name__]
    assert len(warnings) == 1, warnings
    assert "flow.drain" in warnings[0] and uvicorn.__version__ in warnings[0]
    # A plain function (a test client, another server): the plain path, no warning.
    fast_path.expose_cycle(scope, cycle.send.__func__)
    assert fast_path.CYCLE not in scope


def test_uvicorns_server_has_what_the_prompt_stop_uses() -> None:
    """``daemon/http/prompt_server.py`` overrides uvicorn's ``Server.main_loop`` and
    ``shutdown`` and reads its state: a uvicorn without them would serve on without the
    fast stop (or fail), so a version that changed them fails here, by name."""
    import uvicorn
    from uvicorn.server import ServerState

    where = f"uvicorn {uvicorn.__version__}"
    for name in ("main_loop", "shutdown", "on_tick", "handle_exit", "serve"):
        assert callable(getattr(uvicorn.Server, name, None)), (
            f"{where}: Server has no {name}(), which sandboxkit/daemon/http/prompt_server.py "
            "overrides or calls"
        )
    server = uvicorn.Server(uvicorn.Config(app=lambda *a: None))
    source = inspect.getsource(uvicorn.Server)  # some are set only once it starts
    for name in ("servers", "server_state", "lifespan", "force_exit", "should_exit"):
        assert hasattr(server, name) or f"self.{name} =" in source, (
            f"{where}: Server has no attribute {name!r}, which "
            "sandboxkit/daemon/http/prompt_server.py reads"
        )
    state = ServerState()
    for name in ("connections", "tasks"):
        assert hasattr(state, name), (
            f"{where}: ServerState has no {name!r}, which "
            "sandboxkit/daemon/http/prompt_server.py waits on"
        )


@pytest.mark.parametrize(
    "items",
    [
        [],
        [{"a": 1}],
        [{"name": "caf\udce9"}, {"x": float("nan")}, {"nested": {"k": [1, 2.5, None]}}],
    ],
)
def test_a_json_array_answer_is_the_list_encoded_each_item_repaired_alone(
    items: list[dict[str, Any]],
) -> None:
    # GET /sandboxes, …/processes and /events encode item by item (the garbage
    # collector never sees the whole list of dicts): the same JSON as the list, and an
    # item that needs repair (a lone surrogate, NaN) spoils none of the others.
    body = JsonArrayResponse(items, dict).body
    assert json.loads(body) == json.loads(encode_json(items))
    assert body == encode_json(items)
