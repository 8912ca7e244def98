"""Isolated sandboxes (docs/isolation.md): what their processes see, what is refused, and
that everything sandboxkit does still works inside — pause/resume, kill-restart, pty,
stdin, the files API, reattach — plus limits and the honest fallback.

The escape attempts, each from inside a sandbox against a real daemon, are
tests/test_isolation_escape.py."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from freezer_support import alive, served
from support import fast_config, poll, wait_until

from sandboxkit import (
    CommandExitError,
    InvalidArgument,
    IsolationUnavailable,
    IsolationWarning,
    Sandbox,
)
from sandboxkit.daemon import isolation, userns
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.freezer import base as freezer_base
from sandboxkit.daemon.freezer import cgroup
from sandboxkit.daemon.freezer.cgroup import CgroupFreezer
from sandboxkit.daemon.freezer.cgroupfs import cgroup2_mount
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.launcher_slot import LauncherSlot
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.server import DaemonServer

AVAILABLE = isolation.probe()

needs_namespaces = pytest.mark.skipif(
    not AVAILABLE.available and not os.environ.get("CI"),
    reason=f"no namespaces here: {AVAILABLE.reason}",
)
"""CI installs bubblewrap (scripts/install-system.sh): there a missing one fails."""

pytestmark = needs_namespaces


@pytest.fixture
def daemon_config() -> DaemonConfig:
    # The shipped default, not the suite's "none" (tests/conftest.py).
    return fast_config(isolation="auto")


@pytest.fixture
def sbx(conn: dict[str, str]) -> Iterator[Sandbox]:
    with Sandbox.create(**conn) as sandbox:
        yield sandbox


def test_the_default_is_namespaces_with_e2bs_view(sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert info.isolation == "namespaces", info.isolation_reason
    out = sbx.commands.run(
        "id -un; pwd; echo $HOME; ls -A /home; hostname; echo $$; touch /usr/x 2>&1 || true"
    ).stdout.splitlines()
    assert out[:4] == ["user", "/home/user", "/home/user", "user"]
    assert out[4] == sbx.sandbox_id
    assert int(out[5]) < 10, "a PID namespace of its own: its shell is one of the first pids"
    assert "Read-only file system" in out[6]


def test_home_is_the_sandboxs_directory_and_tmp_is_its_own(conn: dict[str, str]) -> None:
    with Sandbox.create(**conn) as a, Sandbox.create(**conn) as b:
        a.commands.run("echo from-a > /home/user/mine.txt; echo tmp-a > /tmp/t")
        assert a.files.read("mine.txt") == "from-a\n"
        assert a.files.read("/home/user/mine.txt") == "from-a\n"
        assert a.commands.run("cat /tmp/t").stdout == "tmp-a\n", "/tmp is shared within one"
        b.files.write("/home/user/theirs.txt", "b")
        seen = b.commands.run("ls -A /home/user /tmp").stdout
        assert "mine.txt" not in seen and "tmp-a" not in seen and "theirs.txt" in seen


async def test_root_inside_is_root_of_the_namespace_only(host: Host) -> None:
    sandbox = await host.create_sandbox(isolation="namespaces")
    process = await sandbox.start_process(
        ProcessSpec(cmd="id -u; touch /etc/x 2>&1 || true; ls -d /root", user="root")
    )
    assert await process.wait(10) == 0
    _, chunks = process.log.read(0, 1 << 20)
    uid, refused, home = b"".join(bytes(c.data) for c in chunks).decode().splitlines()
    assert uid == "0"
    assert "Read-only file system" in refused or "Permission denied" in refused
    assert home == "/root"
    with pytest.raises(InvalidArgument) as err:
        await sandbox.start_process(ProcessSpec(cmd="true", user="nobody-such"))
    assert err.value.field == "user"


def test_cwd_is_a_path_inside_and_a_missing_one_is_refused(sbx: Sandbox) -> None:
    sbx.commands.run("mkdir -p /home/user/sub /tmp/scratch")
    assert sbx.commands.run("pwd", cwd="sub").stdout == "/home/user/sub\n"
    assert sbx.commands.run("pwd", cwd="/tmp/scratch").stdout == "/tmp/scratch\n"
    assert sbx.commands.run("pwd", cwd="/usr").stdout == "/usr\n"
    with pytest.raises(InvalidArgument, match="relative to /home/user") as err:
        sbx.commands.run("pwd", cwd="nope")
    assert err.value.field == "cwd"
    with pytest.raises(InvalidArgument, match="not visible"):
        sbx.commands.run("pwd", cwd="/root")


def test_pause_resume_kill_restart_pty_and_stdin_work_inside(sbx: Sandbox) -> None:
    ticks: list[str] = []
    h = sbx.commands.run(
        "i=0; while :; do echo $i; i=$((i+1)); sleep 0.01; done",
        background=True,
        on_stdout=ticks.append,
    )
    wait_until(lambda: len(ticks) >= 3, what="ticks")
    sbx.pause()
    frozen = len(ticks)
    # Nothing new while paused: poll a little past a tick's interval several times.
    for _ in range(5):
        wait_until(lambda: True)
        assert sbx.commands.list()[0].state == "paused"
    assert len(ticks) <= frozen + 1
    sbx.resume()
    wait_until(lambda: len(ticks) >= frozen + 5, what="ticks after resume")
    new = sbx.commands.restart(h.pid)
    assert new.pid != h.pid
    assert sbx.commands.kill(new.pid)

    cat = sbx.commands.run("cat", background=True)
    sbx.commands.send_stdin(cat.pid, "hello\n")
    wait_until(lambda: cat.stdout == "hello\n", what="stdin echoed")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().exit_code == 0

    tty = sbx.commands.run("test -t 0 && test -t 1 && echo a-terminal", pty=True, background=True)
    tty.wait()
    assert "a-terminal" in tty.stdout


def test_reattach_by_pid_replays_and_pids_are_unique(sbx: Sandbox) -> None:
    pids = set()
    for _ in range(3):
        h = sbx.commands.run("echo one; echo two", background=True)
        h.wait()
        pids.add(h.pid)
        again = sbx.commands.connect(h.pid, cursor=0)
        assert again.wait().stdout == "one\ntwo\n"
    assert len(pids) == 3


def test_a_signal_from_inside_is_reported_as_minus_the_signal(sbx: Sandbox) -> None:
    with pytest.raises(CommandExitError) as err:
        sbx.commands.run("kill -9 $$")
    assert err.value.exit_code == -9


def test_no_internet_leaves_loopback_only(conn: dict[str, str], daemon: DaemonServer) -> None:
    port = int(daemon.url.rsplit(":", 1)[1])
    probe = (
        "import socket,sys\n"
        "s = socket.socket(); s.settimeout(2)\n"
        f"print(s.connect_ex(('127.0.0.1', {port})))\n"
    )
    with Sandbox.create(allow_internet_access=False, **conn) as off:
        assert off.get_info().allow_internet_access is False
        assert off.commands.run(f'python3 -c "{probe}"').stdout.strip() != "0"
        assert _interfaces(off.commands.run("cat /proc/net/dev").stdout) == ["lo"]
    with Sandbox.create(**conn) as on:
        assert on.commands.run(f'python3 -c "{probe}"').stdout.strip() == "0"


def test_memory_limit_ends_in_a_visible_oom_while_a_neighbour_streams(
    conn: dict[str, str],
) -> None:
    with (
        Sandbox.create(limits={"memory": "64M"}, **conn) as small,
        Sandbox.create(**conn) as neighbour,
    ):
        enforced = small.get_info().limits_enforced
        assert enforced["memory"] in ("cgroup", "cgroup-v1", "rlimit")
        lines: list[str] = []
        live = neighbour.commands.run(
            "for i in $(seq 1 400); do echo $i; sleep 0.005; done",
            background=True,
            on_stdout=lines.append,
        )
        with pytest.raises(CommandExitError) as err:
            small.commands.run("python3 -c 'b = bytearray(512 * 1024 * 1024)'")
        if enforced["memory"] == "rlimit":
            # No cgroup to delegate: the allocation fails instead of an OOM kill.
            assert "MemoryError" in err.value.result.stderr
        else:
            assert err.value.exit_code == -9
            assert "oom" in str(err.value)
            events = small.events()
            exits = events[events.kind == "process.exited"]
            assert list(exits.reason) == ["oom"]
        assert live.wait().exit_code == 0
        assert lines == [str(i) for i in range(1, 401)]


@pytest.mark.slow
def test_pids_and_open_files_limits_hold(conn: dict[str, str]) -> None:
    with Sandbox.create(limits={"pids": 32, "open_files": 64}, **conn) as sbx:
        assert set(sbx.get_info().limits_enforced) == {"pids", "open_files"}
        assert sbx.commands.run("ulimit -n").stdout.strip() == "64"
        out = sbx.commands.run(
            "for i in $(seq 1 100); do sleep 5 & done 2>&1 | grep -c 'fork' || true; "
            "kill $(jobs -p) 2>/dev/null; true",
            timeout=20,
        ).stdout
        assert int(out.strip().splitlines()[-1]) > 0, out


def test_bad_limits_are_refused_before_anything_is_made(conn: dict[str, str]) -> None:
    before = len(Sandbox.list(**conn))
    for bad in ({"memory": "lots"}, {"pids": 0}, {"nice": 1}, {"memory": 10}):
        with pytest.raises(InvalidArgument) as err:
            Sandbox.create(limits=bad, **conn)  # type: ignore[arg-type]
        assert err.value.field == "limits"
    assert len(Sandbox.list(**conn)) == before


def test_auto_falls_back_to_none_and_says_so(
    conn: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = isolation.Probe(False, "user namespaces are disabled (test)")
    monkeypatch.setattr(isolation, "probe", lambda: missing)
    monkeypatch.setattr("sandboxkit.daemon.host.probe", lambda: missing)
    monkeypatch.setattr("sandboxkit.client.sandbox._warned_unisolated", False)
    with pytest.raises(IsolationUnavailable) as err:
        Sandbox.create(isolation="namespaces", **conn)
    assert "disabled (test)" in str(err.value.missing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Sandbox.create(**conn) as first, Sandbox.create(**conn) as second:
            assert first.get_info().isolation == second.get_info().isolation == "none"
            assert "disabled (test)" in first.get_info().isolation_reason
    said = [w for w in caught if issubclass(w.category, IsolationWarning)]
    assert len(said) == 1, "said once per process"
    assert "disabled (test)" in str(said[0].message)


def test_status_says_whether_namespaces_are_available(
    conn: dict[str, str], daemon: DaemonServer
) -> None:
    import httpx

    health = httpx.get(
        daemon.url + "/health", headers={"Authorization": f"Bearer {daemon.token}"}
    ).json()
    assert health["isolation"] == {"available": True, "reason": "", "default": "auto"}


@pytest.fixture
def e2b_opts() -> Iterator[dict[str, str]]:
    """A daemon with the envd endpoint and the shipped default: the plain e2b SDK's way in."""
    server = DaemonServer(fast_config(isolation="auto"), envd_port=0).start()
    try:
        assert server.envd is not None
        yield {
            "api_key": server.token or "",
            "api_url": server.envd.api_url,
            "sandbox_url": server.envd.sandbox_url,
        }
    finally:
        server.stop()


def test_the_e2b_sdk_writes_and_reads_home_user_unchanged(
    e2b_opts: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    e2b = pytest.importorskip("e2b")
    for name in ("E2B_API_KEY", "E2B_DEBUG", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN"):
        monkeypatch.delenv(name, raising=False)
    sbx = e2b.Sandbox.create(timeout=60, **e2b_opts)
    try:
        sbx.files.write("/home/user/x.txt", "hello from e2b\n")
        assert sbx.commands.run("pwd; whoami; cat /home/user/x.txt").stdout == (
            "/home/user\nuser\nhello from e2b\n"
        )
        sbx.commands.run("echo made-inside > /home/user/y.txt")
        assert sbx.files.read("/home/user/y.txt") == "made-inside\n"
        assert sbx.files.read("y.txt") == "made-inside\n"  # relative to /home/user
        assert sbx.commands.run("id -u", user="root").stdout == "0\n"
        # A watcher on /home/user sees what a process inside makes there.
        handle = sbx.files.watch_dir("/home/user", recursive=True)
        sbx.commands.run("mkdir -p /home/user/w && echo z > /home/user/w/z.txt")
        seen: list[str] = []
        deadline = time.monotonic() + 10
        while "w/z.txt" not in seen and time.monotonic() < deadline:
            seen += [e.name for e in handle.get_new_events()]
        handle.stop()
        assert "w/z.txt" in seen, seen
    finally:
        sbx.kill()
    offline = e2b.Sandbox.create(timeout=60, allow_internet_access=False, **e2b_opts)
    try:
        assert _interfaces(offline.commands.run("cat /proc/net/dev").stdout) == ["lo"]
    finally:
        offline.kill()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_successor_reclaims_what_a_sigkilled_daemons_isolated_sandboxes_left(
    tmp_path: Path,
) -> None:
    marker = f"{secrets.randbelow(10**6) + 10**6}"
    with (
        served(tmp_path, "--isolation", "namespaces") as dead,
        Sandbox.create(url=dead.url, token=dead.token) as sbx,
    ):
        sbx.commands.run(f"exec sleep {marker}1", background=True)
        sbx.commands.run(
            f"(setsid sleep {marker}2 >/dev/null 2>&1 &); exec sleep {marker}3", background=True
        )
        wait_until(lambda: len(_sleeping(marker)) == 3, what="three sleeps inside")
        survivors = _sleeping(marker)
        dead.proc.send_signal(signal.SIGKILL)
        dead.proc.wait(10)
        sbx.close()
    assert all(alive(pid) for pid in survivors), "they outlive their daemon until a successor"
    with DaemonServer(fast_config()):
        wait_until(
            lambda: not any(alive(pid) for pid in survivors),
            timeout=10,
            what="the successor to end the dead daemon's isolated processes",
        )


@pytest.mark.timeout(60)
def test_a_daemon_that_stops_leaves_no_cgroup_behind(tmp_path: Path) -> None:
    """A daemon stopped while isolated processes run removes its cgroups, the one for
    bubblewrap's processes too (those exit just after the commands the stop killed)."""
    with served(tmp_path, "--isolation", "namespaces") as daemon:
        sbx = Sandbox.create(url=daemon.url, token=daemon.token)
        try:
            handles = [sbx.commands.run("exec sleep 60", background=True) for _ in range(3)]
            sleeper = wait_until(lambda: _user_namespace(handles[-1].pid), what="the command")[0]
            own = _cgroup_dir(sleeper).parent
            if not own.name.startswith("sandboxkit-"):
                pytest.skip("no cgroup freezer here")
            wait_until(lambda: list(own.glob("*.bwrap")), what="bwrap's monitor moved out")
            daemon.proc.send_signal(signal.SIGTERM)  # what `sandboxkit stop` sends
            # It shuts down, then ends by the signal (uvicorn raises it again): no atexit.
            assert daemon.proc.wait(20) == -signal.SIGTERM
        finally:
            sbx.close()  # the client only: the daemon is gone
    assert not own.exists(), sorted(p.name for p in own.iterdir())


def _cgroup_dir(pid: int) -> Path:
    """Where ``pid``'s cgroup v2 is in this machine's hierarchy."""
    line = next(x for x in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if x[:3] == "0::")
    mount = cgroup2_mount()
    assert mount is not None
    return mount / line[3:].lstrip("/")


def _sleeping(marker: str) -> list[int]:
    """The sleeps themselves (not the bwrap processes whose argv names them too)."""
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if (p.info.get("cmdline") or [""])[0] == "sleep"
        and any(marker in arg for arg in p.info["cmdline"])
        and alive(p.pid)
    ]


def _interfaces(proc_net_dev: str) -> list[str]:
    """The network interfaces ``/proc/net/dev`` lists (its namespace's, unlike /sys)."""
    return [line.split(":")[0].strip() for line in proc_net_dev.splitlines()[2:]]


def test_what_the_files_api_writes_belongs_to_the_sandbox(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/deep/dir/note.txt", "from the API\n")
    sbx.files.write("/tmp/scratch.txt", "tmp\n")
    out = sbx.commands.run(
        "echo more >> /home/user/deep/dir/note.txt && touch /home/user/deep/dir/new "
        "&& echo more >> /tmp/scratch.txt && echo CHANGED"
    ).stdout
    assert out == "CHANGED\n"
    assert sbx.files.read("/home/user/deep/dir/note.txt") == "from the API\nmore\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon's launches (CI runs as root)")
async def test_a_root_daemons_launches_join_its_user_namespace_as_nobody(host: Host) -> None:
    """A root daemon's sandboxed process runs as the host's ``nobody``, never as root:
    its bwrap joins the user namespace the daemon made, in which ``user`` *is*
    ``nobody`` (no ``setpriv`` exec before each launch, no user namespace made per
    launch), and it has no capability there, cannot join it through the descriptor it
    inherits, and has no way to root's files. ``root`` inside keeps a user namespace of
    its own per launch. (What the shared namespace keeps per user, the keyrings, every
    isolated process is refused: test_isolation_escape.py.)"""
    sandbox = await host.create_sandbox(isolation="namespaces")
    script = (
        "grep -E '^(Uid|CapEff):' /proc/self/status; "
        # bwrap passes the namespace's descriptor on; joining it takes a capability there
        "for f in /proc/self/fd/*; do case $(readlink $f) in user:*) "
        "nsenter --user=$f true 2>/dev/null && echo JOINED || echo join-refused;; esac; done; "
        "cat /etc/shadow >/dev/null 2>&1 || echo shadow-refused; exec sleep 30"
    )
    first = await sandbox.start_process(ProcessSpec(cmd=script))
    await poll(lambda: "shadow-refused" in _said(first), timeout=10, what="its report")
    words = _said(first).split()
    assert words[:6] == ["Uid:", "1000", "1000", "1000", "1000", "CapEff:"]
    assert int(words[6], 16) == 0
    assert "join-refused" in words and "JOINED" not in words
    neighbour = await host.create_sandbox(isolation="namespaces")
    launches = [
        first,
        await sandbox.start_process(ProcessSpec(cmd="exec sleep 30")),
        await neighbour.start_process(ProcessSpec(cmd="exec sleep 30")),
        await sandbox.start_process(ProcessSpec(cmd="exec sleep 30", user="root")),
    ]
    seen = [await poll(lambda p=p: _user_namespace(p.pid)) for p in launches]
    assert {psutil.Process(pid).uids().real for pid, _ in seen} == {isolation.SANDBOX_HOST_UID}
    spaces = [space for _, space in seen]
    assert spaces[0] == spaces[1] == spaces[2], "one user namespace for the daemon's launches"
    assert spaces[3] != spaces[0], "root inside has one of its own"
    for process in launches:
        await process.kill()


async def test_a_pause_freezes_the_sandboxs_processes_and_not_bubblewraps_monitor(
    host: Host,
) -> None:
    """bwrap's monitor is not the sandbox's: under the cgroup freezer it leaves the
    sandbox's cgroup once the command is born there (each task frozen is one more woken
    per pause and per resume: benchmarks/isolation.py), so a pause does not freeze it,
    and ending the command still ends it. Everything in the sandbox's PID namespace stays
    in the cgroup, bwrap's PID 1 included: the sandbox's user can ptrace that one (bwrap
    leaves it dumpable), so what it runs must pause and die with the sandbox."""
    sandbox = await host.create_sandbox(isolation="namespaces")
    if not isinstance(sandbox.tree, CgroupFreezer):
        pytest.skip("no cgroup freezer here")
    process = await sandbox.start_process(ProcessSpec(cmd="exec sleep 30"))
    sleeper, _ = await poll(lambda: _user_namespace(process.pid))
    (init,) = (c.pid for c in psutil.Process(process.pid).children())
    assert [psutil.Process(pid).name() for pid in (process.pid, init)] == ["bwrap", "bwrap"]
    inside = sorted([init, sleeper])
    # The sandbox's next launch (its launcher, or a standby) starts once the daemon is
    # quiet, after the command: waited for, so that its monitor is not still in the
    # cgroup, on its way out, when the pause comes.
    standby = sandbox.standby
    await poll(
        lambda: (
            standby is None
            or (standby.running is not None if isinstance(standby, LauncherSlot) else standby.ready)
        ),
        what="the sandbox's next launch started",
    )

    def out() -> bool:
        # Besides the command's, the sandbox's next launch is in the cgroup: its monitor
        # goes out too. Every process left is inside a namespace.
        pids = sandbox.tree.pids()
        here = os.readlink("/proc/self/ns/pid")
        return set(inside) <= set(pids) and all(
            os.readlink(f"/proc/{pid}/ns/pid") != here for pid in pids
        )

    await poll(out, what="the monitors gone out")
    assert process.tree_pids() == inside
    await sandbox.pause()
    assert out()
    await sandbox.resume()
    await process.kill()
    await poll(lambda: not alive(process.pid) and not alive(init), what="bwrap's ended")
    assert process.log.exit_code == -signal.SIGTERM


async def test_an_init_whose_command_just_ended_is_left_to_report_it(host: Host) -> None:
    """A kill SIGKILLs a PID namespace's init with nothing under it (one whose monitor
    died before the namespace was set up waits forever), but not while its monitor lives:
    that init has just lost its command and is about to pass on how it ended. Killed in
    that moment, the monitor reported the init's SIGKILL (-9) for a command SIGTERMed: one
    CI run in a few. The moment is held open here by stopping the init."""
    sandbox = await host.create_sandbox(isolation="namespaces")
    process = await sandbox.start_process(ProcessSpec(cmd="exec sleep 30"))
    sleeper, _ = await poll(lambda: _user_namespace(process.pid))
    (init,) = (c.pid for c in psutil.Process(process.pid).children())
    os.kill(init, signal.SIGSTOP)
    await poll(lambda: psutil.Process(init).status() == psutil.STATUS_STOPPED, what="stopped")
    os.kill(sleeper, signal.SIGTERM)
    await poll(lambda: psutil.Process(sleeper).status() == psutil.STATUS_ZOMBIE, what="ended")
    assert sandbox.tree is not None
    sandbox.tree.end_empty_inits(process.launch)
    assert alive(init), "the init was killed while its monitor waited for it"
    os.kill(init, signal.SIGCONT)
    assert await process.wait(10) == -signal.SIGTERM


async def test_a_freezer_closed_while_it_settles_a_launch_leaves_no_cgroup_behind(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``settle`` runs in a thread. A close that comes after its look (the command ended
    and the sandbox went meanwhile) must not be followed by it making the ``.bwrap``
    cgroup again, which nothing would then remove."""
    monkeypatch.setattr(freezer_base, "SETTLE_AFTER", (3600.0,))  # settled by hand below
    sandbox = await host.create_sandbox(isolation="namespaces")
    tree = sandbox.tree
    if not isinstance(tree, CgroupFreezer):
        pytest.skip("no cgroup freezer here")
    launch = await sandbox.start_process(ProcessSpec(cmd="exec sleep 30"))
    sleeper, _ = await poll(lambda: _user_namespace(launch.pid))
    looks = 0
    real = cgroup.children_of

    def look_then_end(pid: int) -> list[int]:
        nonlocal looks
        found = real(pid)
        looks += 1
        if looks == 2:  # it saw the command: now the command ends and the freezer closes
            os.kill(sleeper, signal.SIGKILL)
            wait_until(lambda: sleeper not in tree.pids(), what="the command gone")
            tree.close()
        return found

    monkeypatch.setattr(cgroup, "children_of", look_then_end)
    await asyncio.to_thread(tree.settle, launch.launch)
    assert looks == 2
    assert not list(tree.path.parent.glob(tree.path.name + ".*")), "made after the close"


async def test_a_launch_started_while_paused_leaves_bwraps_monitor_out_after_the_resume(
    host: Host,
) -> None:
    """A launch into a paused sandbox is held before bwrap makes its namespaces (its
    wrapper joined the frozen cgroup): the freezer keeps looking, and once the sandbox
    resumes and the command is born, bwrap's monitor leaves as for any launch."""
    sandbox = await host.create_sandbox(isolation="namespaces")
    if not isinstance(sandbox.tree, CgroupFreezer):
        pytest.skip("no cgroup freezer here")
    await sandbox.pause()
    process = await sandbox.start_process(ProcessSpec(cmd="exec sleep 30"))
    await asyncio.sleep(0.1)  # sleep-ok: a pause that outlasts the freezer's first looks
    assert _user_namespace(process.pid) is None, "nothing of it ran while paused"
    await sandbox.resume()
    await poll(lambda: _user_namespace(process.pid), what="the command, after the resume")
    await poll(lambda: process.pid not in sandbox.tree.pids(), what="the monitor gone out")
    await process.kill()


def _said(process: Any) -> str:
    _, chunks = process.log.read(0, 1 << 20)
    return b"".join(bytes(c.data) for c in chunks).decode()


def _user_namespace(leader: int) -> tuple[int, str] | None:
    """The pid and user namespace of the command a launch runs (the sleep at the bottom
    of its tree, or the leader itself where the sandbox's launcher forked it), once it
    runs."""
    top = psutil.Process(leader)
    for child in (top, *top.children(recursive=True)):
        if child.name() == "sleep":
            return child.pid, os.readlink(f"/proc/{child.pid}/ns/user")
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="a root daemon's launches (CI runs as root)")
async def test_without_a_keyring_filter_each_launch_keeps_its_own_user_namespace(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine whose keyring calls the seccomp filter does not know, sandboxes must
    not share a user namespace (they would share its keyrings): each launch makes its own,
    as before."""
    monkeypatch.setattr(userns, "keyring_filter", lambda: None)
    first = await host.create_sandbox(isolation="namespaces")
    second = await host.create_sandbox(isolation="namespaces")
    launches = [await s.start_process(ProcessSpec(cmd="exec sleep 30")) for s in (first, second)]
    seen = [await poll(lambda p=p: _user_namespace(p.pid)) for p in launches]
    assert seen[0][1] != seen[1][1]
    assert {psutil.Process(pid).uids().real for pid, _ in seen} == {isolation.SANDBOX_HOST_UID}
    for process in launches:
        await process.kill()
