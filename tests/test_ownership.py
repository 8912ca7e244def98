"""Ownership, not visibility: daemons in separate pid namespaces (containers or CI runners
sharing ``/tmp``, ``unshare --pid``) on one temp directory and one cgroup tree never touch
each other's roots, cgroups or processes — and a daemon that was SIGKILLed is still
reclaimed by a successor in another namespace.

Every daemon here runs with a ``TMPDIR`` of the test's own and, where there is a cgroup
freezer, inside a cgroup the test makes: whatever a daemon's recovery does, it can reach
only what this test made."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from freezer_support import alive, cli_env
from support import dead_daemons_cgroup, root_unlocked, wait_until

from sandboxkit.daemon.freezer import cgroup_v2_available
from sandboxkit.daemon.freezer.cgroupfs import cgroup2_mount, cgroup_base
from sandboxkit.daemon.recovery import LOCK_FILE

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="unshare --pid needs root"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare"),
]

# The outer shell moves itself into the test's cgroup (if any), then becomes unshare; in
# the new namespace a shell is pid 1 and stays (so killing the daemon does not end the
# namespace, which would kill its processes for us); the daemon is pid 2.
_LAUNCH = (
    'if [ -n "$OWNER_TEST_CGROUP" ]; then '
    'echo $$ > "$OWNER_TEST_CGROUP/cgroup.procs" || exit 97; fi; '
    "exec unshare --pid --fork --kill-child --mount-proc "
    'sh -c \'"$@"; exec sleep 600\' inner "$@"'
)


@dataclass
class NsDaemon:
    """``sandboxkit serve`` as pid 2 of a pid namespace of its own."""

    unshare: subprocess.Popen[bytes]
    url: str
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def daemon_pid(self) -> int:
        """The daemon's pid as this (outer) namespace sees it."""
        for child in psutil.Process(self.unshare.pid).children(recursive=True):
            if "serve" in child.cmdline() and "sandboxkit" in child.cmdline():
                return child.pid
        raise AssertionError("no daemon below unshare")

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=15)


@contextlib.contextmanager
def _own_cgroup() -> Iterator[Path | None]:
    """A cgroup of this test's own below ours (None without a cgroup freezer); on exit
    everything left in it is killed and it is removed."""
    base = cgroup_base() if cgroup_v2_available() else None
    if base is None:
        yield None
        return
    path = base / f"owner-test-{secrets.token_hex(4)}"
    path.mkdir()
    try:
        yield path
    finally:
        deadline = time.monotonic() + 10
        while path.exists() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                (path / "cgroup.freeze").write_text("0")
                (path / "cgroup.kill").write_text("1")
            for dirpath, _dirs, _files in os.walk(path, topdown=False):
                with contextlib.suppress(OSError):  # EBUSY until its processes have left
                    os.rmdir(dirpath)
            time.sleep(0.02)  # sleep-ok: processes leave a cgroup asynchronously


@contextlib.contextmanager
def _world(tmp_path: Path) -> Iterator[tuple[Path, Path | None, list[NsDaemon]]]:
    """A shared TMPDIR, a shared cgroup parent, and the daemons started in them (all
    ended on exit)."""
    shared_tmp = tmp_path / "shared-tmp"
    shared_tmp.mkdir()
    daemons: list[NsDaemon] = []
    with _own_cgroup() as cgroup:
        try:
            yield shared_tmp, cgroup, daemons
        finally:
            for daemon in daemons:
                if daemon.unshare.poll() is None:
                    daemon.unshare.kill()  # --kill-child: the namespace's pid 1, and so all
                daemon.unshare.wait(10)


def _start(tmp_path: Path, world: tuple[Path, Path | None, list[NsDaemon]], name: str) -> NsDaemon:
    shared_tmp, cgroup, daemons = world
    state_file = tmp_path / f"{name}.json"
    env = cli_env(state_file)
    env["TMPDIR"] = str(shared_tmp)
    env["OWNER_TEST_CGROUP"] = str(cgroup or "")
    freezer = "cgroup" if cgroup is not None else "signals"
    serve = [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state_file)]
    proc = subprocess.Popen(
        ["sh", "-c", _LAUNCH, "outer", *serve, "--freezer", freezer],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"daemon {name} did not publish its state file")
        time.sleep(0.02)  # sleep-ok: poll interval
    published = json.loads(state_file.read_text())
    daemon = NsDaemon(proc, published["url"], published["token"])
    daemons.append(daemon)
    return daemon


def _marked(marker: str) -> list[int]:
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(marker in arg for arg in p.info.get("cmdline") or []) and alive(p.pid)
    ]


def _sandbox_with_sleeper(daemon: NsDaemon, marker: str) -> tuple[str, Path]:
    """A sandbox running ``sleep <marker>`` (and a setsid'd grandchild); its id and root."""
    with daemon.http() as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        root = Path(http.get(f"/sandboxes/{sid}").json()["workdir"]).parent
        cmd = f"(setsid sleep {marker}1 >/dev/null 2>&1 &); exec sleep {marker}2"
        assert http.post(f"/sandboxes/{sid}/processes", json={"cmd": cmd}).is_success
    wait_until(lambda: len(_marked(marker)) == 2, what=f"the sleepers of {marker}")
    return sid, root


def _can_run(daemon: NsDaemon) -> str:
    """Create a sandbox on ``daemon`` and run a command in it: its output."""
    with daemon.http() as http:
        made = http.post("/sandboxes", json={})
        assert made.status_code == 201, made.text
        sid = made.json()["sandbox_id"]
        started = http.post(f"/sandboxes/{sid}/processes", json={"cmd": "echo still-mine"})
        assert started.status_code == 201, started.text
        pid = started.json()["pid"]
        wait_until(
            lambda: http.get(f"/sandboxes/{sid}/processes/{pid}").json()["state"] != "running",
            what="echo to exit",
        )
        out = http.get(f"/sandboxes/{sid}/processes/{pid}/stream", params={"cursor": 0})
        return out.text


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_daemons_in_separate_pid_namespaces_leave_each_other_alone(tmp_path: Path) -> None:
    marker_a = f"{secrets.randbelow(10**6) + 10**6}"
    marker_b = f"{secrets.randbelow(10**6) + 10**6}"
    with _world(tmp_path) as world:
        a = _start(tmp_path, world, "a")
        _sid_a, root_a = _sandbox_with_sleeper(a, marker_a)
        b = _start(tmp_path, world, "b")  # its start-up recovery sees a's root and cgroup
        _sid_b, root_b = _sandbox_with_sleeper(b, marker_b)
        c = _start(tmp_path, world, "c")  # and a third, with both to look at
        assert root_a.is_dir() and root_b.is_dir() and root_a != root_b
        assert len(_marked(marker_a)) == 2, "a's processes were killed"
        assert len(_marked(marker_b)) == 2, "b's processes were killed"
        for daemon in (a, b, c):
            assert "still-mine" in _can_run(daemon)
            with daemon.http() as http:
                assert http.get("/health").json()["root_missing"] is False


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_sigkilled_daemon_is_reclaimed_by_a_successor_in_another_namespace(
    tmp_path: Path,
) -> None:
    marker_dead = f"{secrets.randbelow(10**6) + 10**6}"
    marker_live = f"{secrets.randbelow(10**6) + 10**6}"
    with _world(tmp_path) as world:
        _shared_tmp, cgroup, _daemons = world
        dead = _start(tmp_path, world, "dead")
        _sid, dead_root = _sandbox_with_sleeper(dead, marker_dead)
        live = _start(tmp_path, world, "live")
        _sid, live_root = _sandbox_with_sleeper(live, marker_live)
        dead_cgroup = _daemon_cgroup_of(_marked(marker_dead)[0], cgroup)
        live_cgroup = _daemon_cgroup_of(_marked(marker_live)[0], cgroup)
        os.kill(dead.daemon_pid(), signal.SIGKILL)
        lock = dead_root / LOCK_FILE
        wait_until(lambda: not lock.exists() or root_unlocked(dead_root))
        successor = _start(tmp_path, world, "successor")
        assert not dead_root.exists(), "the dead daemon's root was not reclaimed"
        assert live_root.is_dir()
        assert len(_marked(marker_live)) == 2
        if dead_cgroup is not None:  # under signals, another namespace's are out of reach
            wait_until(lambda: not _marked(marker_dead), what="the dead daemon's processes to go")
            assert not dead_cgroup.exists(), "the dead daemon's cgroup was not removed"
            assert live_cgroup is not None and live_cgroup.is_dir()
        with successor.http() as http:
            events = http.get("/events").json()
        found = {e["data"].get("found") for e in events if e["kind"] == "host.recovered"}
        assert "root" in found
        if cgroup is not None:
            assert "cgroup" in found
        assert "still-mine" in _can_run(live)


def _daemon_cgroup_of(pid: int, parent: Path | None) -> Path | None:
    """The daemon cgroup (right below ``parent``) that process ``pid`` sits in."""
    if parent is None:
        return None
    line = next(
        x for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if x.startswith("0::")
    )
    mount = cgroup2_mount()
    assert mount is not None
    path = mount / line[3:].lstrip("/")
    while path.parent != parent:
        path = path.parent
    return path


# -- the root lock, without daemons --------------------------------------------------------

_HOLDER = """
import sys, time
from pathlib import Path
from typing import Any
from sandboxkit.daemon.recovery import claim_root
lock = claim_root(Path(sys.argv[1]), None)
print("locked", flush=True)
if sys.argv[2] == "hold":
    time.sleep(600)  # sleep-ok: holds the lock until the test kills it
"""


def _claimed_by_child(root: Path, hold: bool) -> subprocess.Popen[str]:
    root.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root), "hold" if hold else "exit"],
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(root.parent / "unused.json"),
    )
    assert child.stdout is not None and child.stdout.readline() == "locked\n"
    return child


def test_recovery_takes_only_roots_whose_lock_is_free(tmp_path: Path) -> None:
    from sandboxkit.daemon.recovery import recover

    live = _claimed_by_child(tmp_path / "sandboxkit-live", hold=True)
    zombie = _claimed_by_child(tmp_path / "sandboxkit-zombie", hold=False)
    try:
        # Not waited for: it stays a zombie, which holds no files (and so no lock).
        wait_until(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE)
        unlocked = tmp_path / "sandboxkit-nolock"  # made before locks, or being made
        unlocked.mkdir()
        reports = recover(tmp_path)
        assert (tmp_path / "sandboxkit-live").is_dir()
        assert unlocked.is_dir()
        assert not (tmp_path / "sandboxkit-zombie").exists()
        assert [r["root"] for r in reports if r["found"] == "root"] == [
            str(tmp_path / "sandboxkit-zombie")
        ]
    finally:
        live.kill()
        live.wait(10)
        zombie.wait(10)


def test_recovery_never_takes_another_users_root(tmp_path: Path) -> None:
    from sandboxkit.daemon.recovery import recover

    theirs = _claimed_by_child(tmp_path / "sandboxkit-theirs", hold=False)
    theirs.wait(10)
    os.chown(tmp_path / "sandboxkit-theirs", 65534, 65534)  # nobody's, its lock free
    assert all(r["found"] != "root" for r in recover(tmp_path))
    assert (tmp_path / "sandboxkit-theirs").is_dir()


# -- a root or working directory removed from outside ---------------------------------------


def test_a_removed_root_is_named_in_the_error_the_journal_and_health(
    daemon: Any, tmp_path: Path
) -> None:
    from sandboxkit import Sandbox, WorkdirMissing

    root = daemon.host.root
    # The daemon makes its spare sandbox as it starts: removed meanwhile, the root's
    # listing raced the spare's new directories (rmtree's FileNotFoundError).
    wait_until(lambda: daemon.host.spare_state() != "pending", what="the spare made")
    shutil.rmtree(root)  # what a neighbour's recovery, or a temp cleaner, did before the fix
    with httpx.Client(
        base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.token}"}
    ) as http:
        made = http.post("/sandboxes", json={})
        assert made.status_code == 410, made.text
        assert made.json()["code"] == "workdir_missing"
        assert made.json()["details"]["path"] == str(root)
        assert str(root) in made.json()["message"]
        health = http.get("/health").json()
        assert health["root_missing"] is True and health["root"] == str(root)
        kinds = [e["kind"] for e in http.get("/events").json()]
        assert kinds.count("host.root_missing") == 1
    with pytest.raises(WorkdirMissing) as caught:
        Sandbox.create(url=daemon.url, token=daemon.token)
    assert caught.value.path == str(root)
    from sandboxkit.statefile import DaemonState, write_state

    state_file = tmp_path / "daemon.json"
    write_state(state_file, DaemonState(daemon.url, os.getpid(), daemon.token, time.time(), "t"))
    status = subprocess.run(
        [sys.executable, "-m", "sandboxkit", "status", "--state-file", str(state_file)],
        env=cli_env(state_file),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert status.returncode == 0, status.stderr
    assert f"root {root} was removed" in status.stdout, status.stdout


def test_a_removed_workdir_is_named_when_a_command_starts(daemon: Any) -> None:
    from sandboxkit import Sandbox, WorkdirMissing

    with Sandbox.create(url=daemon.url, token=daemon.token) as sbx:
        workdir = Path(sbx.info.workdir)
        shutil.rmtree(workdir)
        with pytest.raises(WorkdirMissing) as caught:
            sbx.commands.run("true")
        assert caught.value.path == str(workdir)
        assert caught.value.sandbox_id == sbx.sandbox_id
        assert "cwd does not exist" not in str(caught.value)


@pytest.mark.timeout(30)
def test_a_dead_daemons_marked_processes_are_reaped_only_for_its_own_user() -> None:
    from sandboxkit.daemon.freezer.marks import MARK_VAR, Mark, daemon_mark, reap_marked_orphans
    from sandboxkit.daemon.freezer.proc import Ident

    dead = subprocess.Popen(["true"])
    dead.wait()
    ours = daemon_mark("sbx-ownertest", "1")
    gone = Ident(dead.pid, 1)  # its pid may be reused; its start time cannot be 1 tick
    marks = {
        "ours": Mark(gone, ours.pidns, "sbx-x", "1", os.geteuid()),
        "theirs": Mark(gone, ours.pidns, "sbx-x", "1", os.geteuid() + 1),
    }
    assert Mark.parse(str(marks["theirs"])) == marks["theirs"]
    procs = {
        name: subprocess.Popen(["sleep", "60"], env={**os.environ, MARK_VAR: str(mark)})
        for name, mark in marks.items()
    }
    try:
        reap_marked_orphans(timeout=1.0)
        wait_until(lambda: procs["ours"].poll() is not None, what="our dead daemon's process")
        assert procs["theirs"].poll() is None, "another user's daemon's process was killed"
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(10)


@pytest.mark.timeout(30)
@pytest.mark.skipif(cgroup2_mount() is None, reason="no cgroup2 hierarchy")
def test_a_cgroup_member_outside_this_pid_namespace_is_never_a_pid_to_signal() -> None:
    """cgroup v2 lists a member that has no pid in the reader's PID namespace as pid 0,
    and 0 given to kill() is the caller's own process group: a daemon in a container
    reaping its dead predecessor's cgroup (on a kernel without ``cgroup.kill``) would
    have killed itself. The cgroup's pids, read from a new PID namespace, leave it out."""
    mount = cgroup2_mount()
    assert mount is not None
    pids = _in_a_new_pid_namespace("sandboxkit.daemon.freezer.cgroupfs", "cgroup_pids", mount)
    # Seen from there, the hierarchy's processes are that namespace's few, all above 0.
    assert pids and all(pid > 0 for pid in pids), pids


@pytest.mark.timeout(30)
@pytest.mark.skipif(not cgroup_v2_available(), reason="no cgroup v2 freezer")
def test_a_dead_daemons_cgroup_is_emptied_of_members_this_pid_namespace_cannot_see() -> None:
    """A successor in a container (a PID namespace of its own) reaps a dead daemon's cgroup
    whose members it has no pids for: they are killed all the same (``cgroup.kill``), and
    the cgroup removed."""
    base = cgroup_base()
    assert base is not None
    with dead_daemons_cgroup(base, "sb-outside") as (path, member):
        daemon_cgroup = "sandboxkit.daemon.freezer.daemon_cgroup"
        report = _in_a_new_pid_namespace(daemon_cgroup, "reap_cgroup", path)
        assert report["cgroup_removed"] is True, report
        assert member.wait(5) == -signal.SIGKILL


def _in_a_new_pid_namespace(module: str, function: str, path: Path) -> Any:
    """``function(path)`` of ``module``, called by a Python in a PID namespace of its own
    (``unshare --pid``, as a daemon in a container sees the host): its result, as JSON."""
    script = (
        f"import json; from pathlib import Path; from {module} import {function}; "
        f"r = {function}(Path({str(path)!r})); "
        "print(json.dumps(sorted(r) if isinstance(r, set) else r))"
    )
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    return json.loads(done.stdout)
