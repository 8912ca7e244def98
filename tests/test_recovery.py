"""Crash recovery: a daemon killed with SIGKILL leaves its sandboxes running (a paused one
frozen, a setsid'd grandchild among them); the next daemon to start finds them, kills every
one, removes the dead daemon's cgroups and temporary root, and records that it did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import fast_config, wait_until

from sandboxkit.daemon.recovery import OWNER_FILE
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.daemon.tree import cgroup_v2_available


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sleeps(daemon_pid: int) -> list[int]:
    found = []
    for child in psutil.Process(daemon_pid).children(recursive=True):
        try:
            if child.cmdline()[:1] == ["sleep"] and _alive(child.pid):
                found.append(child.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(not cgroup_v2_available(), reason="needs a writable cgroup2 freezer")
def test_next_daemon_kills_what_a_sigkilled_daemon_left(tmp_path: Path) -> None:
    state = tmp_path / "daemon.json"
    dead = subprocess.Popen(
        [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    survivors: list[int] = []
    try:
        wait_until(state.exists, timeout=30, what="the first daemon to publish its state")
        published = json.loads(state.read_text())
        headers = {"Authorization": f"Bearer {published['token']}"}
        with httpx.Client(base_url=published["url"], headers=headers, timeout=10) as http:
            sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
            root = Path(http.get(f"/sandboxes/{sid}").json()["workdir"]).parent
            for cmd in ("exec sleep 600", "setsid sleep 600 & exec sleep 600"):
                assert http.post(f"/sandboxes/{sid}/processes", json={"cmd": cmd}).is_success
            running = http.post("/sandboxes", json={}).json()["sandbox_id"]
            assert http.post(f"/sandboxes/{running}/processes", json={"cmd": "sleep 600"})
            wait_until(lambda: len(_sleeps(dead.pid)) >= 4, what="four sleeping processes")
            assert http.post(f"/sandboxes/{sid}/pause").json()["state"] == "paused"
        survivors = _sleeps(dead.pid)
        assert (root / OWNER_FILE).is_file()
        dead.send_signal(signal.SIGKILL)
        dead.wait(10)
        # They outlive their daemon (until a successor starts: any daemon on this machine
        # reaps them, so look at once).
        assert all(_alive(pid) for pid in survivors), "the processes outlive their daemon"

        with DaemonServer(fast_config()) as successor:
            wait_until(
                lambda: not any(_alive(pid) for pid in survivors),
                timeout=10,
                what="the successor to kill the dead daemon's processes",
            )
            assert not root.exists()
            events = [e for e in successor.host.journal.since(0) if e.kind == "host.recovered"]
            cgroup = [e for e in events if e.data.get("daemon_pid") == dead.pid]
            assert cgroup and cgroup[0].data["processes_killed"] >= len(survivors)
            assert cgroup[0].data["sandboxes"] == 2
            assert cgroup[0].data["cgroup_removed"] is True
            assert not Path(cgroup[0].data["cgroup"]).exists()
            assert any(e.data.get("root") == str(root) for e in events)
    finally:
        if dead.poll() is None:
            dead.kill()
            dead.wait(10)
        for pid in survivors:  # if the test failed: leave nothing behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
