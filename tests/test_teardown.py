"""Teardown (F9): a sandbox used as a context manager is always deleted, even when the body
or the client's own close raises; a closed client leaves no task and no attached consumer
behind; a stopped daemon leaves no process behind and stops in bounded time even with a
consumer that never reads."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from freezer_support import served
from support import daemon_cgroups, fast_config, wait_until
from support import poll as _poll

from sandboxkit import AsyncSandbox, Sandbox, SandboxClosed
from sandboxkit.client.results import SandboxInfo
from sandboxkit.client.tasks import TaskOwner
from sandboxkit.daemon.freezer import cgroup_v2_available
from sandboxkit.daemon.server import DaemonServer


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _find(infos: list[SandboxInfo], sandbox_id: str) -> SandboxInfo:
    return next(i for i in infos if i.sandbox_id == sandbox_id)


class CloseFailed(Exception):
    pass


def _break_close(sbx: AsyncSandbox, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the client's close raise (after doing its work, so nothing real leaks):
    ``owner``: the task owner's aclose; ``close``: the sandbox's close itself."""
    if where == "owner":
        target: Any = sbx._owner
        original = target.aclose
    else:
        target = sbx
        original = target.close

    async def broken() -> None:
        await original()
        raise CloseFailed(f"{where} close failed")

    monkeypatch.setattr(target, "aclose" if where == "owner" else "close", broken)


# -- (h) context managers always delete --------------------------------------------------


@pytest.mark.timeout(30)
async def test_async_with_kills_the_sandbox_when_the_body_raises(conn: dict[str, str]) -> None:
    seen: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="boom"):
        async with await AsyncSandbox.create(**conn) as sbx:
            handle = await sbx.commands.run(["sleep", "60"], background=True)
            seen.update(sbx=sbx, pid=handle.pid)
            assert _alive(handle.pid)
            raise RuntimeError("boom")
    sbx = seen["sbx"]
    assert _find(await AsyncSandbox.list(**conn), sbx.sandbox_id).state == "killed"
    await _poll(lambda: not _alive(seen["pid"]), 10, "the sandbox's process to die")
    assert sbx.backend.api.closed
    assert len(sbx._owner) == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["owner", "close"])
@pytest.mark.parametrize("body_raises", [False, True])
async def test_async_with_kills_the_sandbox_when_closing_the_client_raises(
    conn: dict[str, str], monkeypatch: pytest.MonkeyPatch, where: str, body_raises: bool
) -> None:
    seen: dict[str, Any] = {}
    with pytest.raises(CloseFailed):
        async with await AsyncSandbox.create(**conn) as sbx:
            _break_close(sbx, where, monkeypatch)
            handle = await sbx.commands.run(["sleep", "60"], background=True)
            seen.update(sbx=sbx, pid=handle.pid)
            if body_raises:
                raise RuntimeError("boom")
    sbx = seen["sbx"]
    assert _find(await AsyncSandbox.list(**conn), sbx.sandbox_id).state == "killed"
    await _poll(lambda: not _alive(seen["pid"]), 10, "the sandbox's process to die")
    assert sbx.backend.api.closed


@pytest.mark.timeout(30)
def test_sync_with_kills_the_sandbox_when_the_body_raises(conn: dict[str, str]) -> None:
    seen: dict[str, Any] = {}
    with pytest.raises(RuntimeError, match="boom"), Sandbox.create(**conn) as sbx:
        handle = sbx.commands.run(["sleep", "60"], background=True)
        seen.update(sbx=sbx, pid=handle.pid)
        raise RuntimeError("boom")
    sbx = seen["sbx"]
    assert _find(Sandbox.list(**conn), sbx.sandbox_id).state == "killed"
    wait_until(lambda: not _alive(seen["pid"]), 10, what="the sandbox's process to die")
    assert sbx.async_sandbox.backend.api.closed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["owner", "close"])
def test_sync_with_kills_the_sandbox_when_closing_the_client_raises(
    conn: dict[str, str], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    seen: dict[str, Any] = {}
    with pytest.raises(CloseFailed), Sandbox.create(**conn) as sbx:
        _break_close(sbx.async_sandbox, where, monkeypatch)
        handle = sbx.commands.run(["sleep", "60"], background=True)
        seen.update(sbx=sbx, pid=handle.pid)
    sbx = seen["sbx"]
    assert _find(Sandbox.list(**conn), sbx.sandbox_id).state == "killed"
    wait_until(lambda: not _alive(seen["pid"]), 10, what="the sandbox's process to die")


# -- (i) no task survives a closed client ------------------------------------------------


def _stream_tasks() -> set[asyncio.Task[Any]]:
    return {t for t in asyncio.all_tasks() if t.get_name().startswith("sandboxkit-stream")}


TICKER = "while true; do echo tick; sleep 0.05; done"


@pytest.mark.timeout(30)
async def test_closed_client_leaves_no_task_and_no_attached_consumer(
    conn: dict[str, str],
) -> None:
    assert not _stream_tasks()
    before = asyncio.all_tasks()
    sbx = await AsyncSandbox.create(**conn)
    other: AsyncSandbox | None = None
    try:
        handles = [await sbx.commands.run(TICKER, background=True) for _ in range(3)]
        await _poll(lambda: all("tick" in h.stdout for h in handles), 10, "every stream to flow")
        tasks = _stream_tasks()
        assert {t.get_name() for t in tasks} == {f"sandboxkit-stream-{h.pid}" for h in handles}
        assert len(sbx._owner) == 3

        other = await AsyncSandbox.connect(sbx.sandbox_id, **conn)

        async def attached() -> int:
            rows = await other.consumers()  # type: ignore[union-attr]
            return int(rows["closed_at"].isna().sum())

        assert await _poll(attached, 10, "three consumers on the daemon") == 3

        await asyncio.wait_for(sbx.close(), 10)

        assert all(t.done() for t in tasks)
        assert all(t.cancelled() for t in tasks)
        assert not _stream_tasks()
        assert all(h.done for h in handles)
        assert len(sbx._owner) == 0
        assert sbx.backend.api.closed
        # Nothing this client started is still scheduled.
        assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()
        # A stale client cannot start new streams (no reconnect task outlives close).
        with pytest.raises(SandboxClosed, match="closed"):
            await sbx.commands.connect(handles[0].pid)
        assert not _stream_tasks()

        async def all_detached() -> bool:
            rows = await other.consumers()  # type: ignore[union-attr]
            return (
                len(rows) == 3
                and rows["closed_at"].notna().all()
                and (rows["close_reason"] == "detached").all()
            )

        await _poll(all_detached, 10, "every consumer to be detached on the daemon")
        # Closing a client is not killing the sandbox: the processes run on.
        assert all(p.state == "running" for p in await other.commands.list())
        assert all(_alive(h.pid) for h in handles)
    finally:
        if other is None:
            other = await AsyncSandbox.connect(sbx.sandbox_id, **conn)
        await other.kill()
        await sbx.close()


@pytest.mark.timeout(30)
async def test_owned_tasks_are_strongly_referenced_and_awaited_on_close() -> None:
    """A fire-and-forget task whose only reference is its owner is not garbage-collected
    before it runs; ``aclose`` cancels it and waits for it to finish its cleanup."""
    owner = TaskOwner()
    cleaned = asyncio.Event()

    async def orphan() -> None:
        try:
            await asyncio.get_running_loop().create_future()  # referenced by nothing else
        finally:
            await asyncio.sleep(0)  # cleanup that needs a loop turn  # sleep-ok: deliberate pace
            cleaned.set()

    ref = weakref.ref(owner.spawn(orphan(), name="sandboxkit-test-orphan"))
    await asyncio.sleep(0)  # let it start and park on its future  # sleep-ok: deliberate pace
    gc.collect()
    task = ref()
    assert task is not None, "the owned task was garbage-collected"
    assert not task.done()
    assert len(owner) == 1
    await asyncio.wait_for(owner.aclose(), 5)
    assert task.cancelled()
    assert cleaned.is_set()
    assert len(owner) == 0
    with pytest.raises(SandboxClosed, match="closed"):
        owner.spawn(orphan())


# -- (j) no process survives a stopped daemon ----------------------------------------------

STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(300)  # sleep-ok: the process idles until killed
"""

CHATTY = """
import sys, time
chunk = b"x" * 65536
for _ in range(160):
    sys.stdout.buffer.write(chunk)
sys.stdout.flush()
time.sleep(300)  # sleep-ok: the process idles until killed
"""


def _marked(marker: str) -> list[psutil.Process]:
    """Every process whose argv mentions ``marker`` (found even after reparenting)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if any(marker in arg for arg in cmdline) and _alive(proc.pid):
            found.append(proc)
    return found


def _ghost_stream(server: DaemonServer, sandbox_id: str, pid: int) -> socket.socket:
    """Attach a stream that never reads, through a socket with a tiny receive buffer."""
    ghost = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ghost.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    ghost.connect((server.bind, server.port))
    path = f"/sandboxes/{sandbox_id}/processes/{pid}/stream?cursor=0&name=ghost"
    ghost.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {server.token}\r\n\r\n".encode()
    )
    return ghost


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_stopped_daemon_leaves_no_process_and_stops_in_bounded_time() -> None:
    config = fast_config()
    server = await asyncio.to_thread(DaemonServer(config).start)
    marker = f"{secrets.randbelow(10**6) + 10**6}"
    stopped = False
    ghost: socket.socket | None = None
    clients: list[AsyncSandbox] = []
    pids: set[int] = set()
    try:
        conn = {"url": server.url, "token": server.token}
        a = await AsyncSandbox.create(**conn)
        clients.append(a)
        b = await AsyncSandbox.create(**conn)
        clients.append(b)

        plain = await a.commands.start(["sleep", f"{marker}1"])
        stubborn = await a.commands.start([sys.executable, "-c", STUBBORN, marker])
        # Two children and a double-forked grandchild reparented away from the leader.
        family = await b.commands.start(
            ["sh", "-c", f"sleep {marker}2 & (sleep {marker}3 &); echo started; wait", marker]
        )
        chatty = await b.commands.start([sys.executable, "-c", CHATTY, marker])
        followed = await a.commands.run(["sleep", f"{marker}4"], background=True)

        async def printed(sbx: AsyncSandbox, pid: int, size: int) -> bool:
            return (await sbx.commands.get(pid)).total_bytes >= size

        await _poll(lambda: printed(a, stubborn.pid, 6), 10, "SIGTERM to be ignored")
        await _poll(lambda: printed(b, family.pid, 8), 10, "the family to start")
        await _poll(lambda: printed(b, chatty.pid, 160 * 65536), 10, "the chatty output")
        sleeps = {f"{marker}{i}" for i in range(1, 5)}

        def every_sleep_runs() -> bool:
            return {p.cmdline()[-1] for p in _marked(marker) if p.name() == "sleep"} == sleeps

        await _poll(every_sleep_runs, 10, "every marked sleep")
        pids = {p.pid for p in _marked(marker)}
        leaders = {plain.pid, stubborn.pid, family.pid, chatty.pid, followed.pid}
        # The leaders, the family's two sleeps (a child and the escaped grandchild).
        assert leaders <= pids
        assert len(pids) == 7, [p.cmdline() for p in _marked(marker)]
        grandchild = next(p for p in _marked(f"{marker}3"))
        assert grandchild.ppid() != family.pid  # it escaped its parent

        ghost = _ghost_stream(server, b.sandbox_id, chatty.pid)

        async def ghost_blocked() -> bool:
            rows = await b.consumers()
            ghosts = rows[rows["name"] == "ghost"]
            return len(ghosts) == 1 and ghosts["state"].iloc[0] == "blocked"

        await _poll(ghost_blocked, 10, "the ghost stream to block")

        started = time.monotonic()
        await asyncio.to_thread(server.stop)
        stopped = True
        took = time.monotonic() - started
        print(f"daemon stop took {took:.2f}s")
        bound = config.shutdown_drain + config.kill_grace + 2.0
        assert took < bound, f"stop took {took:.2f}s (bound {bound:.2f}s)"

        deadline = time.monotonic() + 5
        while left := [pid for pid in pids if _alive(pid)]:
            assert time.monotonic() < deadline, f"processes survived the daemon: {left}"
            await asyncio.sleep(0.02)  # sleep-ok: poll interval
        assert not _marked(marker)
    finally:
        if ghost is not None:
            ghost.close()
        for client in clients:
            await client.close()
        if not stopped:
            await asyncio.to_thread(server.stop)
        for proc in _marked(marker):  # only on failure: leave nothing behind
            with contextlib.suppress(psutil.Error):
                os.kill(proc.pid, signal.SIGKILL)


# -- setsid'd descendants, whichever the freezer -----------------------------------------

FREEZERS = [
    pytest.param(
        "cgroup",
        marks=pytest.mark.skipif(not cgroup_v2_available(), reason="no cgroup v2 freezer"),
    ),
    "signals",
]


def _escaping(marker: str) -> str:
    """A leader whose child double-forks into a session of its own: reparented away from
    the leader (to init) and outside the leader's session and process group."""
    return f"(setsid sleep {marker}1 >/dev/null 2>&1 &); exec sleep {marker}2"


def _escaped(marker: str) -> list[int]:
    """The escaped grandchild, once it leads a session of its own."""
    found = []
    for proc in _marked(f"{marker}1"):
        with contextlib.suppress(psutil.Error, OSError):
            # Its argv read again, whole: the leader's own (``sh -c "(setsid sleep …1 …"``)
            # names the marker too until it execs its own sleep, and a name read after
            # that exec once passed it off as the grandchild.
            if proc.cmdline() == ["sleep", f"{marker}1"] and os.getsid(proc.pid) == proc.pid:
                found.append(proc.pid)
    return found


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("freezer", FREEZERS)
def test_stop_kills_setsid_descendants(tmp_path: Path, freezer: str) -> None:
    marker = f"{secrets.randbelow(10**6) + 10**6}"
    try:
        with served(tmp_path, "--freezer", freezer) as daemon:
            with httpx.Client(base_url=daemon.url, headers=daemon.headers) as http:
                sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
                assert http.get(f"/sandboxes/{sid}").json()["freezer"] == freezer
                made = http.post(f"/sandboxes/{sid}/processes", json={"cmd": _escaping(marker)})
                leader = made.json()["pid"]
            escaped = wait_until(lambda: _escaped(marker), what="the escaped grandchild")
            assert psutil.Process(escaped[0]).ppid() != leader
            assert os.getsid(escaped[0]) != os.getsid(leader)

            stopped = daemon.cli("stop")
            assert stopped.returncode == 0, stopped.stderr
            assert daemon.proc.wait(10) in (0, -signal.SIGTERM)
            wait_until(
                lambda: not _alive(leader) and not any(_alive(p) for p in escaped),
                what="the leader and its setsid'd grandchild to be killed by stop",
            )
    finally:
        for proc in _marked(marker):  # only on failure: leave nothing behind
            with contextlib.suppress(psutil.Error):
                os.kill(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("freezer", FREEZERS)
async def test_restart_and_kill_reach_setsid_descendants(freezer: str) -> None:
    """A process's kill (and so its restart) ends what it started, even what escaped its
    session and parentage; other processes of the sandbox live on until the sandbox is
    killed."""
    marker = f"{secrets.randbelow(10**6) + 10**6}"
    other = f"{secrets.randbelow(10**6) + 10**6}"
    server = await asyncio.to_thread(DaemonServer(fast_config(freezer=freezer)).start)
    try:
        async with await AsyncSandbox.create(url=server.url, token=server.token) as sbx:
            bystander = await sbx.commands.start(["sh", "-c", _escaping(other)])
            first = await sbx.commands.start(["sh", "-c", _escaping(marker)])
            await _poll(lambda: _escaped(marker) and _escaped(other), 10, "escaped children")
            escaped = _escaped(marker)

            second = await sbx.commands.restart(first.pid)
            assert second.pid != first.pid
            await _poll(lambda: not any(_alive(p) for p in escaped), 10, "the old escapee")
            await _poll(lambda: len(_escaped(marker)) == 1, 10, "the new one's escapee")
            assert _alive(bystander.pid) and len(_escaped(other)) == 1

            escaped = _escaped(marker)
            assert await sbx.commands.kill(second.pid)
            await _poll(lambda: not any(_alive(p) for p in escaped), 10, "the killed escapee")
            assert _alive(bystander.pid) and len(_escaped(other)) == 1
            escaped = _escaped(other)
        # Leaving the block kills the sandbox: the bystander's escapee goes with it.
        await _poll(lambda: not any(_alive(p) for p in escaped), 10, "the sandbox's escapee")
    finally:
        await asyncio.to_thread(server.stop)
        for proc in _marked(marker) + _marked(other):  # only on failure
            with contextlib.suppress(psutil.Error):
                os.kill(proc.pid, signal.SIGKILL)


# -- a stop is prompt ----------------------------------------------------------------------


def test_a_stop_wakes_the_server_instead_of_waiting_on_uvicorns_sleeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn's serving loop looks at ``should_exit`` between 0.1 s sleeps, and its
    shutdown sleeps 0.1 s then polls the connections at that pace: ~0.2 s per stop, paid
    by every in-process daemon (and again by its envd server). Here every sleep uvicorn's
    server takes lasts an hour, so a stop that waits on any of them never ends; with a
    sandbox process running and an idle keep-alive connection open, the stop must still
    finish, ending both."""
    real_sleep = asyncio.sleep

    def sleep(delay: float, result: Any = None) -> Any:
        if sys._getframe(1).f_globals.get("__name__") == "uvicorn.server":
            delay = 3600
        return real_sleep(delay, result)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    server = DaemonServer(fast_config(), envd_port=0).start()
    sandbox = Sandbox.create(url=server.url, token=server.token)  # its client stays connected
    try:
        proc = sandbox.commands.run("sleep 600", background=True)
        assert _alive(proc.pid)
        server.stop(timeout=10)  # raises if the daemon thread is still serving
        assert not _alive(proc.pid)
        for url in (server.url, server.envd.api_url):
            with pytest.raises(httpx.TransportError):
                httpx.get(url)
    finally:
        sandbox.close()


async def test_a_stop_ends_a_long_poll_of_events_instead_of_waiting_for_it() -> None:
    """A view's long poll of ``GET /events`` waits for the next event (up to 25 s): a stop
    with no sandbox left to kill recorded none, so uvicorn's graceful shutdown waited the
    poll out (2 s of every stop after a dashboard in the suite). Here the grace is a
    minute: the stop must still finish, the poll answered."""
    server = await asyncio.to_thread(DaemonServer(fast_config(shutdown_drain=60)).start)
    journal = server.host.journal
    try:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}
        ) as http:
            query = {"since": journal.next_seq, "wait": 20}
            poll = asyncio.create_task(http.get("/events", params=query, timeout=30))
            await _poll(lambda: journal.waiting == 1, what="the long poll waiting")
            await asyncio.to_thread(server.stop, timeout=10)  # raises if it still serves
            answer = await poll
            assert answer.status_code == 200 and answer.json() == [], answer.text
    finally:
        await asyncio.to_thread(server.stop)


# -- at interpreter exit -------------------------------------------------------------------

_LEFT_AT_EXIT = """\
import os, time
from sandboxkit import Sandbox
from sandboxkit.daemon.server import DaemonServer
daemon = DaemonServer(envd_port=0).start()  # never stopped: its atexit hook stops it
sandbox = Sandbox.create(url=daemon.url, token=daemon.token, limits={"pids": 64})
pid = sandbox.commands.run("exec sleep 600", background=True).pid
cgroups = ""
for _ in range(200):  # where its wrapper put it, once it has (none for a user's daemon)
    cgroups = open(f"/proc/{pid}/cgroup").read()
    if "/sandboxkit-" in cgroups or os.geteuid() != 0:
        break
    time.sleep(0.01)  # sleep-ok: a poll
print(pid, cgroups, flush=True)
"""


@pytest.mark.timeout(60)
def test_an_in_process_daemon_left_running_at_exit_ends_cleanly(tmp_path: Path) -> None:
    """A notebook's or a script's daemon is stopped by the atexit hook ``start()`` sets,
    after ``concurrent.futures`` stopped taking work: its close ran into ``RuntimeError``
    halfway (a traceback printed, the root and its cgroups left for the next daemon). It
    must end its processes, remove its directories and say nothing."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _LEFT_AT_EXIT], env=env, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    pid, cgroups = done.stdout.strip().split(maxsplit=1)
    assert not _alive(int(pid)), "its process outlived the daemon"
    assert "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "its root was left behind"
    made = daemon_cgroups(cgroups)
    assert made or os.geteuid() != 0, cgroups  # a root daemon makes them
    assert [d.parent for d in made if d.parent.exists()] == [], "its cgroups were left behind"
