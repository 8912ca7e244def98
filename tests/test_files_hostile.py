"""The files APIs under hostile input: what a client sends or a sandboxed process makes
(FIFOs, huge sparse files, deep trees, long names, symlink loops and swaps, non-UTF-8
names) never blocks the daemon, never answers 5xx, never reaches outside the sandbox.

Both APIs are driven: sandboxkit's own (``/sandboxes/{sid}/files``) and the envd
endpoint (``/files`` and ``filesystem.Filesystem``), on one daemon per module."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from e2b import Sandbox as E2BSandbox
from support import wait_until

from sandboxkit.client.sync import Sandbox
from sandboxkit.daemon import sandbox_paths
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import FileNotFound, InvalidArgument, PayloadTooLarge

UNARY = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def envd(envd_daemon: DaemonServer) -> DaemonServer:
    return envd_daemon


@pytest.fixture
def sbx(envd: DaemonServer) -> Iterator[Sandbox]:
    with Sandbox.create(url=envd.url, token=envd.token) as sandbox:
        yield sandbox


def _api(envd: DaemonServer) -> httpx.Client:
    return httpx.Client(
        base_url=envd.url, headers={"Authorization": f"Bearer {envd.token}"}, timeout=10
    )


def _envd(envd: DaemonServer, sbx: Sandbox) -> httpx.Client:
    assert envd.envd is not None
    return httpx.Client(base_url=f"{envd.envd.url}/sandboxes/{sbx.sandbox_id}", timeout=10)


def _rpc(client: httpx.Client, method: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(f"/filesystem.Filesystem/{method}", json=body, headers=UNARY)


def _workdir(envd: DaemonServer, sbx: Sandbox) -> Path:
    return Path(envd.host.sandboxes[sbx.sandbox_id].workdir)


def _strict_json(raw: bytes) -> Any:
    """JSON that is valid UTF-8 and carries no lone surrogate (``\\udcxx`` escapes)."""
    value = json.loads(raw.decode("utf-8"))
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
    return value


# -- A. nothing blocks the event loop ---------------------------------------------------


def _health_answers_while(envd: DaemonServer, request: Any) -> httpx.Response:
    """Run ``request`` on a thread; meanwhile another client's /health answers within 1 s."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(request())
        except Exception as exc:  # the assertion below reports it
            result.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    try:
        with _api(envd) as other:
            for _ in range(3):
                started = time.monotonic()
                assert other.get("/health", timeout=1.0).status_code == 200
                assert time.monotonic() - started < 1.0
        worker.join(timeout=5)
        assert result, "the FIFO request did not answer"
    finally:
        worker.join(timeout=10)
    answer = result[0]
    assert isinstance(answer, httpx.Response), answer
    return answer


def test_a_fifo_is_refused_and_never_blocks_the_daemon(envd: DaemonServer, sbx: Sandbox) -> None:
    sbx.commands.run("mkfifo pipe")
    fifo = _workdir(envd, sbx) / "pipe"
    try:
        with _api(envd) as api, _envd(envd, sbx) as raw:
            sid = sbx.sandbox_id
            attempts = [
                lambda: api.get(f"/sandboxes/{sid}/files", params={"file": "pipe"}),
                lambda: api.put(f"/sandboxes/{sid}/files", json={"path": "pipe", "data": "eA=="}),
                lambda: raw.get("/files", params={"path": "pipe"}),
                lambda: raw.post("/files", params={"path": "pipe"}, content=b"x"),
            ]
            for attempt in attempts:
                response = _health_answers_while(envd, attempt)
                assert 400 <= response.status_code < 500, response.text
                assert "pipe" in response.json()["message"]
                assert "FIFO" in response.json()["message"]
    finally:
        # Before the fix a blocked open waits for a peer: be that peer, so nothing hangs.
        for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, flags))


def test_a_a_socket_is_refused_by_both_apis(envd: DaemonServer, sbx: Sandbox) -> None:
    sbx.commands.run("python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\"")
    with _api(envd) as api, _envd(envd, sbx) as raw:
        sid = sbx.sandbox_id
        for response in (
            api.get(f"/sandboxes/{sid}/files", params={"file": "sock"}),
            api.put(f"/sandboxes/{sid}/files", json={"path": "sock", "data": "eA=="}),
            raw.get("/files", params={"path": "sock"}),
            raw.post("/files", params={"path": "sock"}, content=b"x"),
        ):
            assert 400 <= response.status_code < 500, response.text
            assert "/home/user/sock" in response.json()["message"]
            assert "socket" in response.json()["message"]


@pytest.mark.slow
def test_a_huge_sparse_file_is_capped_or_streamed_without_growing_the_daemon(
    envd: DaemonServer, sbx: Sandbox
) -> None:
    size = 400 * 1024 * 1024
    sbx.commands.run(f"truncate -s {size} big.bin")
    me = psutil.Process()
    before = me.memory_info().rss
    with pytest.raises(PayloadTooLarge, match=r"big\.bin"):
        sbx.files.read("big.bin", format="bytes")
    assert me.memory_info().rss - before < 100 * 1024 * 1024
    # envd's /files streams it whole, in bounded chunks.
    peak = before
    got = 0
    with _envd(envd, sbx) as raw, raw.stream("GET", "/files", params={"path": "big.bin"}) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            got += len(chunk)
            peak = max(peak, me.memory_info().rss)
    assert got == size
    assert peak - before < 100 * 1024 * 1024


def test_a_list_dir_depth_is_bounded(envd: DaemonServer, sbx: Sandbox) -> None:
    chain = "/".join(f"d{i}" for i in range(sandbox_paths.MAX_LIST_DEPTH + 5))
    sbx.commands.run(f"mkdir -p {chain}")
    with _envd(envd, sbx) as raw:
        listed = _rpc(raw, "ListDir", {"path": ".", "depth": 10**8})
        assert listed.status_code == 200, listed.text
        assert len(listed.json()["entries"]) == sandbox_paths.MAX_LIST_DEPTH
        empty = _rpc(raw, "ListDir", {"path": "d0/d1/d2", "depth": 10**8})
        assert empty.status_code == 200


# -- B. every file-system error is a typed 4xx, naming the path --------------------------


def _all_routes(envd: DaemonServer, sbx: Sandbox, path: str) -> list[httpx.Response]:
    sid = sbx.sandbox_id
    with _api(envd) as api, _envd(envd, sbx) as raw:
        return [
            api.get(f"/sandboxes/{sid}/files", params={"file": path}),
            api.put(f"/sandboxes/{sid}/files", json={"path": path, "data": "eA=="}),
            api.get(f"/sandboxes/{sid}/files/list", params={"file": path}),
            raw.get("/files", params={"path": path}),
            raw.post("/files", params={"path": path}, content=b"x"),
            raw.post("/files", files={"file": (path, b"x")}),
            _rpc(raw, "Stat", {"path": path}),
            _rpc(raw, "ListDir", {"path": path}),
            _rpc(raw, "MakeDir", {"path": path}),
            _rpc(raw, "Move", {"source": path, "destination": "moved"}),
            _rpc(raw, "Move", {"source": "moved", "destination": path}),
            _rpc(raw, "Remove", {"path": path}),
            _rpc(raw, "CreateWatcher", {"path": path}),
        ]


def test_b_a_name_over_255_bytes_is_a_typed_4xx_on_every_route(
    envd: DaemonServer, sbx: Sandbox
) -> None:
    sbx.files.write("moved", "m")
    long = "n" * 256
    for i, response in enumerate(_all_routes(envd, sbx, f"sub/{long}")):
        assert 400 <= response.status_code < 500, (i, response.status_code, response.text)
        body = _strict_json(response.content)
        assert long in body["message"], (i, body)
    assert sbx.files.read("moved") == "m"
    assert [e.name for e in sbx.files.list()] == ["moved"]  # no "sub" made on the way


def test_b_a_symlink_loop_is_a_typed_4xx(envd: DaemonServer, sbx: Sandbox) -> None:
    sbx.commands.run("ln -s loop loop")
    sid = sbx.sandbox_id
    with _api(envd) as api, _envd(envd, sbx) as raw:
        for response in (
            api.get(f"/sandboxes/{sid}/files", params={"file": "loop"}),
            api.get(f"/sandboxes/{sid}/files/list", params={"file": "loop"}),
            api.get(f"/sandboxes/{sid}/files", params={"file": "loop/x"}),
            raw.get("/files", params={"path": "loop"}),
            _rpc(raw, "ListDir", {"path": "loop"}),
            _rpc(raw, "Stat", {"path": "loop/x"}),
        ):
            assert 400 <= response.status_code < 500, response.text
            assert "loop" in response.json()["message"]
        # Stat of the link itself describes the link; listing its directory works.
        stat = _rpc(raw, "Stat", {"path": "loop"})
        assert stat.status_code == 200 and stat.json()["entry"]["symlinkTarget"] == "loop"
        assert _rpc(raw, "ListDir", {"path": "."}).status_code == 200
    assert [e.name for e in sbx.files.list()] == ["loop"]


def test_b_non_utf8_names_are_escaped_valid_json_and_round_trip(
    envd: DaemonServer, sbx: Sandbox
) -> None:
    sbx.commands.run("printf data > \"$(printf 'caf\\351')\"; printf bs > 'a\\b'")
    names = sorted(e.name for e in sbx.files.list())
    assert names == ["a\\\\b", "caf\\xe9"]
    assert sbx.files.read("caf\\xe9") == "data"
    assert sbx.files.read("a\\\\b") == "bs"
    sbx.files.write("new\\xff", b"w")
    assert (_workdir(envd, sbx) / os.fsdecode(b"new\xff")).read_bytes() == b"w"
    with _envd(envd, sbx) as raw:
        listed = _rpc(raw, "ListDir", {"path": "."})
        assert listed.status_code == 200
        entries = _strict_json(listed.content)["entries"]
        assert {e["name"] for e in entries} == {"a\\\\b", "caf\\xe9", "new\\xff"}
        paths = {e["path"] for e in entries}
        assert "/home/user/caf\\xe9" in paths
        assert raw.get("/files", params={"path": "/home/user/caf\\xe9"}).content == b"data"
        stat = _rpc(raw, "Stat", {"path": "caf\\xe9"})
        assert _strict_json(stat.content)["entry"]["name"] == "caf\\xe9"


def test_b_stat_below_a_file_is_not_found(envd: DaemonServer, sbx: Sandbox) -> None:
    sbx.files.write("file.txt", "x")
    with _envd(envd, sbx) as raw:
        response = _rpc(raw, "Stat", {"path": "file.txt/x"})
        assert (response.status_code, response.json()["code"]) == (404, "not_found")
        assert "file.txt/x" in response.json()["message"]
    with pytest.raises(FileNotFound, match=r"file\.txt/x"):
        sbx.files.read("file.txt/x")


def test_b_a_payload_that_is_not_text_or_bytes_is_invalid(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgument) as info:
        sbx.files.write("a.txt", 123)  # type: ignore[arg-type]
    assert info.value.field == "data"
    with pytest.raises(FileNotFound):
        sbx.files.read("a.txt")  # nothing was written


# -- C. the sandbox's paths: /home/user, /tmp; nothing outside ---------------------------


def test_c_e2b_sdk_writes_and_reads_home_user_and_tmp(envd: DaemonServer, sbx: Sandbox) -> None:
    assert envd.envd is not None
    e2b = E2BSandbox.create(debug=True, sandbox_url=f"{envd.envd.url}/sandboxes/{sbx.sandbox_id}")
    info = e2b.files.write("/home/user/x.txt", "hello")
    assert info.path == "/home/user/x.txt"
    assert e2b.files.read("/home/user/x.txt") == "hello"
    assert e2b.files.read("x.txt") == "hello"
    assert sbx.files.read("/home/user/x.txt") == "hello"
    assert (_workdir(envd, sbx) / "x.txt").read_text() == "hello"
    e2b.files.write("/tmp/t.txt", "tmp")
    tmpdir = Path(envd.host.sandboxes[sbx.sandbox_id].tmpdir)
    assert (tmpdir / "t.txt").read_text() == "tmp"
    assert sbx.files.read("/tmp/t.txt") == "tmp"
    assert [e.path for e in e2b.files.list("/tmp")] == ["/tmp/t.txt"]
    # An absolute host path inside the working directory still works.
    assert sbx.files.read(str(_workdir(envd, sbx) / "x.txt")) == "hello"
    for outside in ("/etc/passwd", "/home/user/../../etc/passwd", "/home/other/x"):
        with pytest.raises(InvalidArgument, match="outside the sandbox's writable space"):
            sbx.files.read(outside)
        with pytest.raises(Exception, match="outside the sandbox's writable space"):
            e2b.files.read(outside)


def test_c_tmpdir_is_private_and_removed_with_the_sandbox(envd: DaemonServer) -> None:
    sandbox = Sandbox.create(url=envd.url, token=envd.token)
    tmpdir = Path(envd.host.sandboxes[sandbox.sandbox_id].tmpdir)
    assert tmpdir.is_dir() and (tmpdir.stat().st_mode & 0o777) == 0o700
    sandbox.kill()
    wait_until(lambda: not tmpdir.exists(), what="the sandbox's tmpdir to go")


_SWAPPER = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("d", exist_ok=True)
open("d/passwd", "w").write("inside\n")
open("inside.txt", "w").write("inside\n")
os.symlink("/etc", "e")
os.symlink("/etc/passwd", "outlink")
os.symlink("inside.txt", "f")
print("ready", flush=True)
while True:
    # Swap atomically: d (a directory) <-> e (a link to /etc); f <-> outlink.
    libc.renameat2(-100, b"d", -100, b"e", 2)
    libc.renameat2(-100, b"f", -100, b"outlink", 2)
"""


@pytest.mark.parametrize("walk", ["openat2", pytest.param("fallback", marks=pytest.mark.slow)])
def test_c_a_process_swapping_links_never_gets_a_read_outside(
    envd: DaemonServer, sbx: Sandbox, walk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if walk == "fallback":
        monkeypatch.setattr(sandbox_paths, "_HAVE_OPENAT2", False)
    sbx.files.write("swap.py", _SWAPPER)
    ready = threading.Event()
    handle = sbx.commands.run(
        "exec python3 swap.py", background=True, on_stdout=lambda _: ready.set()
    )
    try:
        assert ready.wait(10)
        outcomes: dict[str, int] = {}
        with _envd(envd, sbx) as raw:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                for path in ("d/passwd", "f", "e/passwd", "outlink"):
                    try:
                        text = sbx.files.read(path)
                    except (InvalidArgument, FileNotFound) as exc:
                        text = type(exc).__name__
                    assert "root:" not in text, path
                    outcomes[text] = outcomes.get(text, 0) + 1
                    response = raw.get("/files", params={"path": path})
                    assert b"root:" not in response.content, path
                    assert response.status_code < 500
        assert outcomes.get("inside\n", 0) > 0, outcomes
    finally:
        handle.kill()


# -- D. a recursive watch sees files made right after their directory ---------------------


async def test_d_recursive_watch_reports_files_in_new_subdirectories(envd: DaemonServer) -> None:
    from e2b import AsyncSandbox as E2BAsyncSandbox
    from e2b.sandbox.filesystem.watch_handle import FilesystemEvent, FilesystemEventType

    assert envd.envd is not None
    sbx = await E2BAsyncSandbox.create(debug=True, sandbox_url=envd.envd.url)
    await sbx.files.make_dir("burst")
    events: list[FilesystemEvent] = []
    handle = await sbx.files.watch_dir("burst", on_event=events.append, recursive=True, timeout=0)
    try:
        script = "for i in $(seq 20); do mkdir burst/d$i && echo x > burst/d$i/f; done"
        await sbx.commands.run(script)
        wanted = {f"d{i}/f" for i in range(1, 21)}

        def created() -> list[str]:
            return [e.name for e in events if e.type == FilesystemEventType.CREATE]

        deadline = time.monotonic() + 10
        while not wanted <= set(created()):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)  # sleep-ok: polling with a deadline
        assert wanted <= set(created()), sorted(wanted - set(created()))
        names = created()
        assert len(names) == len(set(names)), "a file was reported created twice"
    finally:
        await handle.stop()


@pytest.mark.slow  # 1,200 levels resolved beneath the root, each from the root: ~4 s
def test_c_remove_takes_a_deep_tree_and_never_follows_a_link_out(
    envd: DaemonServer, sbx: Sandbox, tmp_path: Path
) -> None:
    outside = tmp_path / "keep"
    outside.mkdir()
    (outside / "precious").write_text("p")
    deep = "/".join(["d"] * 1200)  # deeper than Python's recursion limit
    sbx.commands.run(f"mkdir -p tree/{deep} && ln -s {outside} tree/out && touch tree/{deep}/f")
    with _envd(envd, sbx) as raw:
        response = _rpc(raw, "Remove", {"path": "tree"})
        assert response.status_code == 200, response.text
        assert _rpc(raw, "Stat", {"path": "tree"}).status_code == 404
    assert (outside / "precious").read_text() == "p"


def test_b_watch_events_name_non_utf8_files_in_valid_json(envd: DaemonServer, sbx: Sandbox) -> None:
    sbx.files.write("w/.keep", "")
    with _envd(envd, sbx) as raw:
        made = _rpc(raw, "CreateWatcher", {"path": "/home/user/w", "includeEntry": True})
        wid = made.json()["watcherId"]
        try:
            sbx.commands.run("printf x > \"w/$(printf 'caf\\351')\"")
            seen: list[dict[str, Any]] = []

            def got_it() -> bool:
                answer = _rpc(raw, "GetWatcherEvents", {"watcherId": wid})
                seen.extend(_strict_json(answer.content)["events"])
                return any(e["name"] == "caf\\xe9" for e in seen)

            wait_until(got_it, what="the watch event of the non-UTF-8 name")
            entry = next(e["entry"] for e in seen if e["name"] == "caf\\xe9" and "entry" in e)
            assert entry["path"] == "/home/user/w/caf\\xe9"
        finally:
            _rpc(raw, "RemoveWatcher", {"watcherId": wid})


@pytest.mark.slow  # the fallback removal resolves 1,200 levels each from the root: ~4 s
def test_c_killing_a_sandbox_removes_a_tree_too_deep_for_rmtree(envd: DaemonServer) -> None:
    sandbox = Sandbox.create(url=envd.url, token=envd.token)
    workdir = Path(envd.host.sandboxes[sandbox.sandbox_id].workdir)
    sandbox.commands.run("mkdir -p " + "/".join(["d"] * 1200))
    sandbox.kill()  # raised a RecursionError (500) before
    assert not workdir.exists()
