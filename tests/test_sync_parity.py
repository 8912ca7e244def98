"""The sync client (``sandboxkit/client/sync.py``) mirrors the async one method for method.

The sync classes are written by hand, so nothing but this test stops them drifting: every
public method and property of each async class must exist on its sync mirror with the
same parameters (names, kinds, defaults), as a plain function where the async one is a
coroutine function, returning the sync mirror of what the async one returns.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import httpx
import pytest

from sandboxkit.client import sync
from sandboxkit.client.commands import AsyncCommandHandle, AsyncCommands
from sandboxkit.client.files import AsyncFiles, Files
from sandboxkit.client.sandbox import AsyncSandbox
from sandboxkit.client.stdin import StdinSession
from sandboxkit.client.sync import Sandbox

PAIRS: list[tuple[type, type]] = [
    (AsyncSandbox, sync.Sandbox),
    (AsyncCommands, sync.Commands),
    (AsyncCommandHandle, sync.CommandHandle),
    (AsyncFiles, Files),
    (StdinSession, sync.SyncStdinSession),
]

# Async class name -> sync class name, for return annotations.
MIRROR = {a.__name__: s.__name__ for a, s in PAIRS}

# Intended differences, each with its reason. (class, name): what the sync side has instead.
ONLY_ASYNC: dict[tuple[type, str], str] = {
    # The context-manager protocol: async with ... ↔ with ...
    (AsyncSandbox, "__aenter__"): "__enter__",
    (AsyncSandbox, "__aexit__"): "__exit__",
    (StdinSession, "__aenter__"): "__enter__",
    (StdinSession, "__aexit__"): "__exit__",
}
ONLY_SYNC: set[tuple[type, str]] = {
    # The sync facade exposes the async client and loop thread it drives.
    (sync.Sandbox, "async_sandbox"),
    (sync.Sandbox, "loop_thread"),
    # The sync context-manager protocol (mirrors of __aenter__/__aexit__ above).
    (sync.Sandbox, "__enter__"),
    (sync.Sandbox, "__exit__"),
    (sync.SyncStdinSession, "__enter__"),
    (sync.SyncStdinSession, "__exit__"),
}
# Plain attributes the async class sets in __init__, which its sync mirror reads through
# as properties (the async instance's value stays the one source).
ASYNC_ATTRIBUTES: set[tuple[type, str]] = {
    (sync.CommandHandle, "stream"),
}
# Parameters only the sync side has: a blocking call needs a bound; an async caller has
# asyncio.timeout() for that.
EXTRA_SYNC_PARAMS: dict[tuple[type, str], set[str]] = {}
"""Parameters only the sync side has (none: ``wait(timeout=)`` is on both)."""
DUNDERS = {"__aenter__", "__aexit__", "__enter__", "__exit__"}


def _members(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__[:-1]):  # skip object
        for name, value in vars(klass).items():
            if name.startswith("_") and name not in DUNDERS:
                continue
            if callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                out[name] = value
    return out


def _function(member: Any) -> Any:
    if isinstance(member, (classmethod, staticmethod)):
        return member.__func__
    if isinstance(member, property):
        return member.fget
    return member


def _mirror(annotation: Any) -> str:
    text = str(annotation)
    for a, s in MIRROR.items():
        text = re.sub(rf"\b{a}\b", s, text)
    return text


_UNPACK = re.compile(r"Unpack\[(\w+)\]")


def _params(function: Any) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter; ``**options: Unpack[SomeOptions]`` counts
    as the keywords the TypedDict defines, each with its annotation (where options are
    defined once, the two sides must unpack the same keywords)."""
    out: list[tuple[str, Any, Any]] = []
    for p in inspect.signature(function).parameters.values():
        match = _UNPACK.fullmatch(str(p.annotation)) if p.kind is p.VAR_KEYWORD else None
        if match is None:
            out.append((p.name, p.kind, p.default))
            continue
        typed = function.__globals__[match[1]]
        for key, annotation in typed.__annotations__.items():
            out.append((key, inspect.Parameter.KEYWORD_ONLY, f"{match[1]}: {annotation}"))
    return out


def test_unpacked_options_are_compared_keyword_by_keyword() -> None:
    # run/connect/start take their options as **options: Unpack[...]: the comparison
    # sees each keyword, so a sync side that unpacked other options would differ.
    keywords = {name for name, _, _ in _params(AsyncCommands.run)}
    assert {"on_stdout", "envs", "lines", "keep_output", "on_end"} <= keywords
    assert "tag" not in keywords and "tag" in {n for n, _, _ in _params(AsyncCommands.start)}
    assert _params(sync.Commands.run) == _params(AsyncCommands.run)
    assert _params(sync.Commands.run) != _params(AsyncCommands.connect)


def _pair_id(pair: tuple[type, type]) -> str:
    return f"{pair[0].__name__}-{pair[1].__name__}"


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_same_public_names(pair: tuple[type, type]) -> None:
    async_cls, sync_cls = pair
    a_names = {n for n in _members(async_cls) if (async_cls, n) not in ONLY_ASYNC}
    s_names = {n for n in _members(sync_cls) if (sync_cls, n) not in ONLY_SYNC | ASYNC_ATTRIBUTES}
    assert not a_names - s_names, f"missing on {sync_cls.__name__}: {sorted(a_names - s_names)}"
    assert not s_names - a_names, f"only on {sync_cls.__name__}: {sorted(s_names - a_names)}"
    for (cls, name), instead in ONLY_ASYNC.items():
        if cls is async_cls and name in _members(async_cls):
            assert instead in _members(sync_cls), f"{sync_cls.__name__} lacks {instead}"


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_same_signatures(pair: tuple[type, type]) -> None:
    async_cls, sync_cls = pair
    a_members, s_members = _members(async_cls), _members(sync_cls)
    problems: list[str] = []
    for name in sorted(set(a_members) & set(s_members) - DUNDERS):
        a, s = a_members[name], s_members[name]
        where = f"{sync_cls.__name__}.{name}"
        if type(a) is not type(s) and not (inspect.isfunction(a) and inspect.isfunction(s)):
            problems.append(f"{where}: {type(s).__name__}, async has {type(a).__name__}")
            continue
        fa, fs = _function(a), _function(s)
        if inspect.iscoroutinefunction(fs):
            problems.append(f"{where}: a coroutine function on the sync side")
        a_sig, s_sig = inspect.signature(fa), inspect.signature(fs)
        extra = EXTRA_SYNC_PARAMS.get((sync_cls, name), set())
        a_params = _params(fa)
        s_params = [p for p in _params(fs) if p[0] not in extra]
        if a_params != s_params:
            problems.append(f"{where}: parameters {s_sig} != async {a_sig}")
        a_ret, s_ret = _mirror(a_sig.return_annotation), str(s_sig.return_annotation)
        if s_ret != a_ret:
            problems.append(f"{where}: returns {s_ret!r}, async mirror is {a_ret!r}")
        if s_ret == "Any":
            problems.append(f"{where}: returns Any")
    assert not problems, "\n".join(problems)


def test_intended_differences_are_real() -> None:
    # A stale entry in the tables would hide drift: each must name something that exists.
    for cls, name in ONLY_ASYNC:
        assert name in _members(cls), (cls, name)
    for cls, name in ONLY_SYNC:
        assert name in _members(cls), (cls, name)
    mirrors = {s: a for a, s in PAIRS}
    for cls, name in ASYNC_ATTRIBUTES:
        assert name in _members(cls), (cls, name)
        assert f"self.{name} = " in inspect.getsource(mirrors[cls].__init__), (cls, name)
    for (cls, name), params in EXTRA_SYNC_PARAMS.items():
        assert params <= set(inspect.signature(getattr(cls, name)).parameters), (cls, name)


def test_the_added_sync_methods_work(conn: dict[str, str]) -> None:
    # The mirrors the parity test forced in: start, stdin_session, done/result, connection,
    # raw_events, and Sandbox.connect/list with a transport.
    with Sandbox.create(**conn) as sbx:
        assert sbx.connection.url == conn["url"]
        info = sbx.commands.start(["cat"])
        handle = sbx.commands.connect(info.pid)
        with sbx.commands.stdin_session(info.pid) as session:
            session.write_all([b"one\n", "two\n"])
            assert session.finished
        sbx.commands.close_stdin(info.pid)
        result = handle.wait(timeout=10)
        assert handle.done
        assert result.stdout == handle.result().stdout == "one\ntwo\n"
        assert any(e["kind"] for e in sbx.raw_events())
        transport = httpx.AsyncHTTPTransport()
        again = Sandbox.connect(sbx.sandbox_id, **conn, transport=transport)
        assert again.sandbox_id == sbx.sandbox_id
        again.close()
        ids = [s.sandbox_id for s in Sandbox.list(**conn, transport=httpx.AsyncHTTPTransport())]
        assert sbx.sandbox_id in ids
