"""Crash recovery: a daemon killed with SIGKILL leaves its sandboxes running (a paused one
frozen, setsid'd and double-forked grandchildren among them); the next daemon to start
finds them, kills every one, removes the dead daemon's cgroups and temporary root, and
records that it did — under either freezer."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest
from freezer_support import alive, served
from support import daemon_cgroups, dead_daemons_cgroup, fast_config, wait_until

from sandboxkit.daemon.freezer import cgroup_v2_available, daemon_cgroup
from sandboxkit.daemon.freezer.cgroupfs import cgroup_base, cgroup_pids
from sandboxkit.daemon.limits import reap_v1_cgroup
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
        # No spare (daemon/spare.py): the sandboxes counted below are the two made here.
        with served(tmp_path, "--freezer", freezer, "--spare", "off") as dead:
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
            if killed < len(survivors):
                # Another daemon starting meanwhile (the suite's other worker) reaped them,
                # or some of them as marked orphans, between their death check above and
                # ours; that they all died is checked above.
                pytest.skip(FOREIGN_REAPER)
            # The root's lock decides who reaps the cgroup: a daemon that took the lock
            # first (the suite's other worker) reaps it, while this one may still kill
            # the marked processes, dying of that, as orphans.
            if not any(e.data.get("root") == str(root) for e in events):
                pytest.skip("another daemon on this machine reclaimed the dead daemon's root")
            if freezer == "cgroup":
                cgroups = [e for e in found if e["found"] == "cgroup"]
                assert len(cgroups) == 1, found
                cgroup = cgroups[0]
                assert cgroup["sandboxes"] == 2
                assert cgroup["cgroup_removed"] is True
                assert not Path(cgroup["cgroup"]).exists()
    finally:
        for pid in _marked(marker):  # if the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)


def _left_in(dirs: list[Path]) -> list[tuple[str, list[str]]]:
    """What is left of ``dirs`` (v1 cgroups): each, with the processes still in it (pid,
    state, argv), for a failure to say what kept it."""
    left = []
    for d in dirs:
        if d.exists():
            members = []
            for pid in cgroup_pids(d):
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(pid)
                    members.append(f"{pid} {proc.status()} {' '.join(proc.cmdline())[:120]}")
            left.append((str(d), members))
    return left


def _running(argv: list[str]) -> int | None:
    """The live process running exactly ``argv``, if one does."""
    for proc in psutil.process_iter(["cmdline"]):
        if proc.info.get("cmdline") == argv and alive(proc.pid):
            return proc.pid
    return None


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="v1 limit cgroups are a root daemon's")
def test_next_daemon_removes_a_sigkilled_daemons_v1_limit_cgroups(tmp_path: Path) -> None:
    """On a hybrid host a root daemon holds a sandbox's limits in v1 cgroups of its own;
    the successor that reaps its processes removes those too (they are named in the dead
    daemon's root lock, as its v2 cgroup is), killing what its owner marks miss there: a
    process that left the sandbox's parentage and sessions and dropped its mark."""
    marker = f"{secrets.randbelow(10**6) + 10**6}"
    try:
        with served(tmp_path, "--freezer", "signals") as dead:
            with httpx.Client(base_url=dead.url, headers=dead.headers, timeout=10) as http:
                sid = http.post("/sandboxes", json={"limits": {"pids": 64}}).json()["sandbox_id"]
                info = http.get(f"/sandboxes/{sid}").json()
                if info["limits_enforced"].get("pids") != "cgroup-v1":
                    pytest.skip(f"no v1 pids cgroup here: {info['limits_enforced']}")
                escape = f"(setsid env -i sleep {marker}9 >/dev/null 2>&1 &)"
                cmd = {"cmd": f"{escape}; exec sleep {marker}"}
                assert http.post(f"/sandboxes/{sid}/processes", json=cmd).is_success
                # The sleep itself (its wrapper, which joins the cgroups first, execs it),
                # and the one without a mark, below init, in a session of its own.
                sleeper, unmarked = (
                    wait_until(lambda a=arg: _running(["sleep", a]), what=f"sleep {arg}")
                    for arg in (marker, f"{marker}9")
                )
            dirs = daemon_cgroups(Path(f"/proc/{sleeper}/cgroup").read_text(), v2=False)
            assert dirs and all(d.is_dir() for d in dirs)
            dead.proc.send_signal(signal.SIGKILL)
            dead.proc.wait(10)
        with DaemonServer(fast_config()):
            wait_until(lambda: not alive(sleeper), what="the successor to end the sleep")
            wait_until(lambda: not alive(unmarked), what="the successor to end the unmarked")
            wait_until(
                lambda: not any(d.parent.exists() for d in dirs),
                what="the dead daemon's v1 cgroups to go",
                info=lambda: _left_in(dirs),
            )
    finally:
        for pid in _marked(marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/sys/fs/cgroup/pids/cgroup.procs").exists(),
    reason="a root daemon's v1 limit cgroups need the v1 pids hierarchy",
)
def test_what_is_left_in_a_dead_daemons_v1_cgroup_is_killed_and_it_removed() -> None:
    """A successor finds a dead daemon's processes by their owner marks, which a sandboxed
    process can drop (its environment is its own: ``env -i``), and a process the daemon
    spawned just before it died may join its cgroups after the successor looked. So
    whatever is still in the dead daemon's v1 limit cgroups is killed too, as in its v2
    cgroup, and they are removed."""
    pids = Path("/sys/fs/cgroup/pids")
    with dead_daemons_cgroup(pids, "sb-unmarked", "exec env -i sleep 60") as (path, left):
        report = reap_v1_cgroup(path)
        assert report is not None
        assert (report["cgroup_removed"], report["processes_killed"]) == (True, 1)
        assert not path.exists()
        assert left.wait(5) == -signal.SIGKILL


@pytest.mark.skipif(not cgroup_v2_available(), reason="no cgroup v2 freezer")
def test_a_process_that_joins_a_dead_daemons_cgroup_late_is_killed_and_it_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process the dead daemon spawned just before it died (a sandbox's standby, which
    it starts unasked) writes its pid into its sandbox's cgroup once it runs: maybe after
    the successor found the cgroup empty, before it removed it. It is killed all the same,
    and the cgroup removed."""
    base = cgroup_base()
    assert base is not None
    # Named as a daemon's cgroup, for a pid past the kernel's pid_max: no daemon's.
    path = base / f"sandboxkit-{2**22 + 1}-{secrets.token_hex(4)}"
    sandbox = path / "sb-late"
    sandbox.mkdir(parents=True)
    late: list[subprocess.Popen[bytes]] = []
    real = daemon_cgroup.rmdir_tree

    def join_then_remove(root: Path) -> bool:
        if not late:  # the first removal: the process joins just before it
            late.append(
                subprocess.Popen(
                    ["/bin/sh", "-c", f'echo $$ > "{sandbox}/cgroup.procs" && exec sleep 60']
                )
            )
            wait_until(lambda: late[0].pid in cgroup_pids(path), what="the late joiner in")
        return real(root)

    monkeypatch.setattr(daemon_cgroup, "rmdir_tree", join_then_remove)
    try:
        report = daemon_cgroup.reap_cgroup(path)
        assert report is not None
        assert (report["cgroup_removed"], report["processes_killed"]) == (True, 1)
        assert late[0].wait(5) == -signal.SIGKILL
    finally:
        for process in late:
            process.kill()
            process.wait()
        real(path)
