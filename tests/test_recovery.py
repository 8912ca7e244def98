"""Crash recovery: a daemon killed with SIGKILL leaves its sandboxes running (a paused one
frozen, setsid'd and double-forked grandchildren among them); the next daemon to start
finds them, kills every one, removes the dead daemon's cgroups and temporary root, and
records that it did — under either freezer."""

from __future__ import annotations

import os
import secrets
import signal
from pathlib import Path

import httpx
import psutil
import pytest
from freezer_support import alive, served
from support import fast_config, wait_until

from sandboxkit.daemon.freezer import cgroup_v2_available
from sandboxkit.daemon.recovery import LOCK_FILE
from sandboxkit.daemon.server import DaemonServer

FREEZERS = [
    pytest.param(
        "cgroup",
        marks=pytest.mark.skipif(not cgroup_v2_available(), reason="no cgroup v2 freezer"),
    ),
    "signals",
]


FOREIGN_REAPER = "another daemon on this machine reaped the dead daemon's processes first"


def _marked(marker: str) -> list[int]:
    """Live processes whose argv mentions ``marker`` (found even after reparenting)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in arg for arg in proc.info.get("cmdline") or []) and alive(proc.pid):
            found.append(proc.pid)
    return found


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("freezer", FREEZERS)
def test_next_daemon_kills_what_a_sigkilled_daemon_left(tmp_path: Path, freezer: str) -> None:
    marker = f"{secrets.randbelow(10**6) + 10**6}"
    commands = (
        f"exec sleep {marker}1",
        # A child in a session of its own, still below the leader.
        f"setsid sleep {marker}2 & exec sleep {marker}3",
        # A double-forked grandchild in a session of its own: reparented to init.
        f"(setsid sleep {marker}4 >/dev/null 2>&1 &); exec sleep {marker}5",
    )
    survivors: list[int] = []
    try:
        with served(tmp_path, "--freezer", freezer) as dead:
            with httpx.Client(base_url=dead.url, headers=dead.headers, timeout=10) as http:
                paused = http.post("/sandboxes", json={}).json()["sandbox_id"]
                info = http.get(f"/sandboxes/{paused}").json()
                assert info["freezer"] == freezer
                root = Path(info["workdir"]).parent
                for cmd in commands:
                    made = http.post(f"/sandboxes/{paused}/processes", json={"cmd": cmd})
                    assert made.is_success
                running = http.post("/sandboxes", json={}).json()["sandbox_id"]
                made = http.post(
                    f"/sandboxes/{running}/processes", json={"cmd": f"exec sleep {marker}6"}
                )
                assert made.is_success
                wait_until(lambda: len(_marked(marker)) == 6, what="six sleeping processes")
                assert http.post(f"/sandboxes/{paused}/pause").json()["state"] == "paused"
            survivors = _marked(marker)
            assert (root / LOCK_FILE).is_file()
            dead.proc.send_signal(signal.SIGKILL)
            dead.proc.wait(10)
        # They outlive their daemon until a successor starts. Any daemon that starts on this
        # machine reaps them — on a shared machine, maybe another's before ours.
        if not all(alive(pid) for pid in survivors):
            pytest.skip(FOREIGN_REAPER)

        with DaemonServer(fast_config()) as successor:
            wait_until(
                lambda: not any(alive(pid) for pid in survivors),
                timeout=10,
                what="the successor to kill the dead daemon's processes",
            )
            # Gone: removed by the successor, or by another daemon that held its lock first.
            wait_until(lambda: not root.exists(), timeout=10, what="the dead daemon's root to go")
            events = [e for e in successor.host.journal.since(0) if e.kind == "host.recovered"]
            found = [e.data for e in events if e.data.get("daemon_pid") == dead.proc.pid]
            if not found:
                pytest.skip(FOREIGN_REAPER)
            killed = sum(int(e.get("processes_killed", 0)) for e in found)
            if not killed:
                # Another daemon starting meanwhile (the suite's other worker) reaped them
                # in one pass between their death check above and ours; the roots were ours.
                pytest.skip(FOREIGN_REAPER)
            assert killed >= len(survivors), found
            if freezer == "cgroup":
                cgroup = next(e for e in found if e["found"] == "cgroup")
                assert cgroup["sandboxes"] == 2
                assert cgroup["cgroup_removed"] is True
                assert not Path(cgroup["cgroup"]).exists()
            if not any(e.data.get("root") == str(root) for e in events):
                pytest.skip("another daemon on this machine reclaimed the dead daemon's root")
    finally:
        for pid in _marked(marker):  # if the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)
