"""The command line and the local daemon, as separate processes: ``serve``, ``status``,
``stop``, ``demo`` and ``ensure_local_daemon``. Every state file lives under tmp_path."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

import sandboxkit
from sandboxkit import Sandbox
from sandboxkit.client.local import ensure_local_daemon, probe
from sandboxkit.statefile import STATE_FILE_ENV, DaemonState, read_state

REPO = Path(sandboxkit.__file__).resolve().parents[1]
# After a graceful shutdown uvicorn re-raises the SIGTERM it caught, so the daemon's exit
# status is 0 or "killed by SIGTERM" — never SIGKILL.
CLEAN_EXIT = (0, -signal.SIGTERM)


def _env(state_path: Path) -> dict[str, str]:
    """The environment for our subprocesses: this checkout importable, no daemon URL
    override, and the default state file pointing into tmp_path as a safety net."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXKIT_")}
    env[STATE_FILE_ENV] = str(state_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandboxkit", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (absent, or a zombie awaiting its reaper)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(predicate, timeout: float = 10.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)  # noqa: sleep-ok - poll interval


def stop_daemon(state_path: Path, env: dict[str, str]) -> None:
    """Best-effort cleanup: stop the daemon of ``state_path`` if one is still recorded."""
    state = read_state(state_path)
    if state is None:
        return
    cli("stop", "--state-file", str(state_path), env=env)
    if not gone(state.pid):
        os.kill(state.pid, signal.SIGKILL)


class Served:
    """A ``sandboxkit serve`` child process and its state file."""

    def __init__(self, state_path: Path, env: dict[str, str]) -> None:
        self.state_path = state_path
        self.env = env
        self.output = state_path.with_name("serve.out")
        with open(self.output, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state_path)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 30.0) -> DaemonState:
        deadline = time.monotonic() + timeout
        while True:
            state = read_state(self.state_path)
            if state is not None and state.pid == self.proc.pid:
                return state
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited: {self.output.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError("serve did not write its state file")
            time.sleep(0.02)  # noqa: sleep-ok - poll interval

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    state_path = tmp_path / "run" / "daemon.json"
    state_path.parent.mkdir()
    daemon = Served(state_path, _env(state_path))
    try:
        yield daemon
    finally:
        daemon.close()


# -- 7. serve / status / stop ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_serve_status_stop(served: Served) -> None:
    state = served.wait_ready()
    path, env = served.state_path, served.env
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert state.url.startswith("http://127.0.0.1:")
    assert state.pid == served.proc.pid
    assert len(state.token) >= 16

    health = httpx.get(state.url + "/health", headers={"Authorization": f"Bearer {state.token}"})
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(state.url + "/health", headers=headers)
        assert refused.status_code == 401
        assert refused.json()["code"] == "unauthorized"

    status = cli("status", "--state-file", str(path), env=env)
    assert status.returncode == 0, status.stderr
    assert state.url in status.stdout
    assert f"pid {state.pid}" in status.stdout

    second = cli("serve", "--state-file", str(path), env=env)
    assert second.returncode == 1
    assert "already running" in second.stderr
    assert str(state.pid) in second.stderr
    assert read_state(path) == state, "the second serve must leave the state file alone"
    assert probe(state)

    started = time.monotonic()
    stopped = cli("stop", "--state-file", str(path), env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert f"stopped daemon pid {state.pid}" in stopped.stdout
    assert served.proc.wait(10) in CLEAN_EXIT, "stop fell back to SIGKILL"
    assert time.monotonic() - started < 15, "stop fell back to SIGKILL"
    assert not path.exists()

    after = cli("status", "--state-file", str(path), env=env)
    assert after.returncode == 1
    assert "no daemon running" in after.stdout


@pytest.mark.timeout(60)
def test_sigterm_to_the_daemon_unpublishes_its_state_file(served: Served) -> None:
    # Not through `stop` (which removes the file itself): a plain SIGTERM, as from
    # `kill` or a service manager. A stale file would let `stop` signal a reused pid.
    state = served.wait_ready()
    sbx = Sandbox.create(url=state.url, token=state.token)
    try:
        pid = sbx.commands.run("sleep 300", background=True).pid
        os.kill(state.pid, signal.SIGTERM)
        assert served.proc.wait(15) in CLEAN_EXIT
    finally:
        sbx.close()
    assert not served.state_path.exists(), "the daemon left its state file behind"
    wait_for(lambda: gone(pid), what="sandbox process gone")
    assert cli("status", "--state-file", str(served.state_path), env=served.env).returncode == 1


# -- 8. ensure_local_daemon ---------------------------------------------------------------


@pytest.mark.timeout(90)
def test_ensure_local_daemon_starts_one_and_reuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sequential = tmp_path / "seq" / "daemon.json"
    concurrent = tmp_path / "conc" / "daemon.json"
    env = _env(sequential)
    for name in list(os.environ):
        if name.startswith("SANDBOXKIT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(STATE_FILE_ENV, str(sequential))
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    try:
        assert read_state(sequential) is None
        first = ensure_local_daemon(sequential)
        assert probe(first)
        assert not gone(first.pid)
        assert read_state(sequential) == first
        again = ensure_local_daemon(sequential)
        assert again.pid == first.pid
        assert again.token == first.token

        results: list[DaemonState] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def call() -> None:
            try:
                barrier.wait(5)
                results.append(ensure_local_daemon(concurrent))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert len(results) == 2
        assert results[0].pid == results[1].pid
        assert results[0].pid != first.pid
        log = concurrent.with_suffix(".log").read_text()
        assert log.count("serving on") == 1, log
        serving = [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(concurrent) in " ".join(p.info["cmdline"] or []) and not gone(p.pid)
        ]
        assert [p.pid for p in serving] == [results[0].pid]
    finally:
        stop_daemon(sequential, env)
        stop_daemon(concurrent, env)
    assert gone(first.pid)
    assert not sequential.exists()


# -- 9. stop kills every sandbox process ------------------------------------------------------


@pytest.mark.timeout(60)
def test_stop_leaves_no_sandbox_process_behind(served: Served) -> None:
    state = served.wait_ready()
    sbx = Sandbox.create(url=state.url, token=state.token)
    try:
        # A leader and a grandchild that outlive any client; the stream stays attached.
        handle = sbx.commands.run("sleep 300 & echo $!; wait", background=True)
        wait_for(lambda: handle.stdout.strip().isdigit(), what="the grandchild's pid")
        leader, grandchild = handle.pid, int(handle.stdout.strip())
        assert psutil.Process(grandchild).name() == "sleep"
        assert not gone(leader) and not gone(grandchild)

        stopped = cli("stop", "--state-file", str(served.state_path), env=served.env)
        assert stopped.returncode == 0, stopped.stderr
        assert served.proc.wait(10) in CLEAN_EXIT, "the daemon should shut down cleanly"
        wait_for(lambda: gone(leader) and gone(grandchild), what="sandbox processes gone")
    finally:
        sbx.close()


# -- 10. demo ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_demo_tour(tmp_path: Path) -> None:
    state_path = tmp_path / "demo" / "daemon.json"
    env = _env(state_path)
    try:
        result = cli("tour", "--lines", "40", env=env, timeout=90)
        state = read_state(state_path)
    finally:
        stop_daemon(state_path, env)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("consumer A", "consumer B"):
        row = rf"^\s*{name}\s+40\s+line 0000\s+line 0039\s+True\s*$"
        assert re.search(row, result.stdout, re.M), result.stdout
    assert "sandbox.paused" in result.stdout
    assert "sandbox.resumed" in result.stdout
    assert state is not None, "the demo should have started a daemon at $SANDBOXKIT_STATE_FILE"
    wait_for(lambda: gone(state.pid), what="demo daemon stopped")
    assert not state_path.exists()
