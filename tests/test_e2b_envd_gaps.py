"""What the envd endpoint gained after the first slice: PTY resize, the ``user`` of a
call, and directory watchers — each driven by the official ``e2b`` SDK (debug mode,
loopback only)."""

from __future__ import annotations

import os
import pwd
import time

import pytest
from e2b import AsyncSandbox as E2BAsyncSandbox
from e2b import InvalidArgumentException, NotFoundException
from e2b import Sandbox as E2BSandbox
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.watch_handle import FilesystemEvent, FilesystemEventType
from support import poll

from sandboxkit.daemon.run_as import resolve_user
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.errors import InvalidArgument


@pytest.fixture(scope="module")
def envd(envd_daemon: DaemonServer) -> DaemonServer:
    return envd_daemon


@pytest.fixture
def url(envd: DaemonServer) -> str:
    assert envd.envd is not None
    return envd.envd.url


async def test_pty_size_at_create_and_after_resize(url: str) -> None:
    sbx = await E2BAsyncSandbox.create(debug=True, sandbox_url=url)
    seen = bytearray()
    handle = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=seen.extend)
    await sbx.pty.send_stdin(handle.pid, b"stty size\n")
    await poll(lambda: b"24 80" in seen, what="the size given at create")
    await sbx.pty.resize(handle.pid, PtySize(rows=40, cols=100))
    await sbx.pty.send_stdin(handle.pid, b"stty size; exit 0\n")
    await poll(lambda: b"40 100" in seen, what="the size after the resize")
    await handle.wait()
    with pytest.raises(InvalidArgumentException, match="no pty"):
        plain = await sbx.commands.run("sleep 30", background=True)  # sleep-ok: alive
        try:
            await sbx.pty.resize(plain.pid, PtySize(rows=10, cols=10))
        finally:
            await plain.kill()


def test_user_runs_the_process_as_that_account(url: str) -> None:
    sbx = E2BSandbox.create(debug=True, sandbox_url=url)
    me = pwd.getpwuid(os.geteuid())
    # The SDK's default user, "user", with no such account here: the daemon's user.
    if not _exists("user"):
        assert sbx.commands.run("id -un").stdout.strip() == me.pw_name
    with pytest.raises(InvalidArgumentException, match="no user 'no-such-user-h5'"):
        sbx.commands.run("id -un", user="no-such-user-h5")
    if os.geteuid() != 0 or not _exists("nobody"):
        pytest.skip("running as another account needs a root daemon and a 'nobody'")
    nobody = pwd.getpwnam("nobody")
    out = sbx.commands.run('id -un; echo "$HOME"; id -u', user="nobody", cwd="/").stdout
    assert out.split() == ["nobody", nobody.pw_dir, str(nobody.pw_uid)]


def test_a_daemon_that_is_not_root_refuses_another_user(monkeypatch: pytest.MonkeyPatch) -> None:
    other = next(
        (e for e in pwd.getpwall() if e.pw_uid not in (0, 4242)), None
    )  # any account that is not the pretend daemon's
    if other is None:
        pytest.skip("no second account on this host")
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    with pytest.raises(InvalidArgument, match="not as root"):
        resolve_user(other.pw_name)
    assert resolve_user(None) is None


def test_sync_watch_dir_polls_events_of_a_recursive_watcher(url: str) -> None:
    """The sync SDK's ``watch_dir``: CreateWatcher, GetWatcherEvents, RemoveWatcher."""
    sbx = E2BSandbox.create(debug=True, sandbox_url=url)
    sbx.files.make_dir("watched")
    handle = sbx.files.watch_dir("watched", recursive=True)
    sbx.files.write("watched/a.txt", "one")
    sbx.files.make_dir("watched/sub")
    sbx.commands.run("echo two > watched/sub/b.txt; chmod 600 watched/a.txt")
    sbx.files.rename("watched/a.txt", "watched/c.txt")
    sbx.files.remove("watched/c.txt")
    seen: list[tuple[str, FilesystemEventType]] = []
    deadline = time.monotonic() + 10
    while ("c.txt", FilesystemEventType.REMOVE) not in seen and time.monotonic() < deadline:
        seen += [(e.name, e.type) for e in handle.get_new_events()]
    for expected in [
        ("a.txt", FilesystemEventType.CREATE),
        ("a.txt", FilesystemEventType.WRITE),
        ("sub", FilesystemEventType.CREATE),
        ("sub/b.txt", FilesystemEventType.CREATE),  # inside a directory made after the start
        ("a.txt", FilesystemEventType.CHMOD),
        ("a.txt", FilesystemEventType.RENAME),
        ("c.txt", FilesystemEventType.CREATE),
        ("c.txt", FilesystemEventType.REMOVE),
    ]:
        assert expected in seen, (expected, seen)
    handle.stop()
    with pytest.raises(NotFoundException):
        sbx.files.watch_dir("no-such-dir")


async def test_async_watch_dir_streams_events_until_stopped(url: str) -> None:
    """The async SDK's ``watch_dir``: the WatchDir server stream."""
    sbx = await E2BAsyncSandbox.create(debug=True, sandbox_url=url)
    await sbx.files.make_dir("streamed")
    events: list[FilesystemEvent] = []
    ended: list[object] = []
    handle = await sbx.files.watch_dir(
        "streamed", on_event=events.append, on_exit=ended.append, timeout=0
    )
    await sbx.files.write("streamed/x.txt", "x")
    await poll(lambda: any(e.name == "x.txt" for e in events), what="the stream's event")
    assert events[0].type == FilesystemEventType.CREATE
    await handle.stop()
    await poll(lambda: ended, what="the watch's end")
    assert ended == [None]  # stopped cleanly


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
