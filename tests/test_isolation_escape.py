"""The escape suite: each attempt runs inside a sandbox of a real ``sandboxkit serve``
daemon (with its state file and token), and asserts that it fails *and* that the daemon
and a neighbouring sandbox keep serving. Every attempt runs against a daemon running as
the suite's user and against one running as an unprivileged account (``nobody``), since
that is how most people run it. docs/isolation.md has the table of attempts."""

from __future__ import annotations

import errno
import os
import platform
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from freezer_support import Served, served
from support import wait_until
from unprivileged import can_run_unprivileged, served_unprivileged

from sandboxkit import CommandExitError, Sandbox
from sandboxkit.client.sync import CommandHandle
from sandboxkit.daemon.isolation import probe
from sandboxkit.daemon.seccomp import KEYRING_CALLS

pytestmark = [
    pytest.mark.skipif(
        not probe().available and not os.environ.get("CI"),
        reason=f"no namespaces here: {probe().reason}",
    ),
    pytest.mark.timeout(90),
]

WHY_NOT_UNPRIVILEGED = can_run_unprivileged()
HERE = Path(__file__).parent


@pytest.fixture(
    scope="module",
    params=[
        "daemon-user",
        pytest.param(
            "unprivileged",
            marks=pytest.mark.skipif(bool(WHY_NOT_UNPRIVILEGED), reason=WHY_NOT_UNPRIVILEGED),
        ),
    ],
)
def daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """One daemon per variant for the module (starting one takes about a second)."""
    if request.param == "daemon-user":
        with served(tmp_path_factory.mktemp("escape"), "--isolation", "auto") as it:
            yield it
    else:
        with served_unprivileged() as it:
            yield it


@dataclass
class Scene:
    daemon: Served
    attacker: Sandbox
    neighbour: Sandbox
    ticks: list[str]
    ticker: CommandHandle

    def run(self, script: str, **options: object) -> str:
        """Run ``script`` in the attacker's sandbox; its stdout and stderr, whatever the
        exit code."""
        try:
            result = self.attacker.commands.run(script, timeout=30, **options)  # type: ignore[call-overload]
            return str(result.stdout + result.stderr)
        except CommandExitError as exc:
            return exc.result.stdout + exc.result.stderr


@pytest.fixture
def scene(daemon: Served) -> Iterator[Scene]:
    conn = {"url": daemon.url, "token": daemon.token}
    with (
        Sandbox.create(timeout=120, **conn) as attacker,
        Sandbox.create(timeout=120, **conn) as neighbour,
    ):
        assert attacker.get_info().isolation == "namespaces"
        neighbour.files.write("secret.txt", "neighbour's secret\n")
        ticks: list[str] = []
        ticker = neighbour.commands.run(
            "i=0; while :; do echo $i; i=$((i+1)); sleep 0.02; done",
            background=True,
            on_stdout=ticks.append,
        )
        it = Scene(daemon, attacker, neighbour, ticks, ticker)
        yield it
        still_serving(it)


def still_serving(scene: Scene) -> None:
    """The daemon answers within a second, the neighbour's stream goes on, its files are
    intact, and a new command runs in it."""
    started = time.monotonic()
    health = httpx.get(scene.daemon.url + "/health", headers=scene.daemon.headers, timeout=5)
    assert health.status_code == 200 and time.monotonic() - started < 1.0
    seen = len(scene.ticks)
    deadline = time.monotonic() + 5
    while len(scene.ticks) < seen + 3:
        assert time.monotonic() < deadline, "the neighbour's stream stalled"
        time.sleep(0.01)  # sleep-ok: poll interval
    assert scene.neighbour.files.read("secret.txt") == "neighbour's secret\n"
    assert scene.neighbour.commands.run("echo alive").stdout == "alive\n"
    assert scene.daemon.proc.poll() is None


def test_the_state_file_and_token_are_out_of_reach(scene: Scene) -> None:
    state = scene.daemon.state_file
    out = scene.run(
        f"cat {shlex.quote(str(state))}; ls -A {shlex.quote(str(state.parent))}; "
        "cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -i token; env"
    )
    assert scene.daemon.token not in out
    assert "No such file or directory" in out


def test_another_sandboxs_files_cannot_be_read_or_written(scene: Scene) -> None:
    theirs = Path(scene.neighbour.get_info().workdir or "/nonexistent")
    out = scene.run(
        f"cat {shlex.quote(str(theirs / 'secret.txt'))}; "
        f"echo pwned > {shlex.quote(str(theirs / 'pwned.txt'))}; "
        f"ls -A {shlex.quote(str(theirs.parent))}"
    )
    assert "neighbour's secret" not in out and "No such file or directory" in out
    assert not (theirs / "pwned.txt").exists()
    listed = scene.run("ls -A /home /home/user/.. /tmp /proc/*/root/ 2>/dev/null")
    assert scene.neighbour.sandbox_id not in listed


def test_the_host_home_and_runtime_directories_are_hidden(scene: Scene) -> None:
    out = scene.run("ls -A /root /run /var/tmp | grep -v ':$' | grep -v '^$' || echo EMPTY")
    assert out.strip() == "EMPTY"
    assert scene.run("ls -A /home").split() == ["user"]


def test_nothing_outside_home_and_tmp_can_be_written(scene: Scene) -> None:
    for place in ("/usr/pwned", "/etc/pwned", "/var/pwned", "/opt/pwned", "/pwned"):
        out = scene.run(f"echo x > {place} && echo WROTE")
        assert "WROTE" not in out, place
        assert not Path(place).exists()
    assert "WROTE" in scene.run("echo x > /home/user/ok && echo x > /tmp/ok && echo WROTE")


def test_the_daemon_and_the_neighbour_cannot_be_signalled_or_traced(scene: Scene) -> None:
    targets = [scene.daemon.proc.pid, scene.ticker.pid]
    ptrace = (
        "import ctypes, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for pid in map(int, sys.argv[1:]):\n"
        "    print(pid, libc.ptrace(16, pid, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH
    )
    out = scene.run(
        "; ".join(f"kill -9 {pid} 2>&1; kill -STOP {pid} 2>&1" for pid in targets)
        + f"; python3 -c {shlex.quote(ptrace)} {' '.join(map(str, targets))}"
    )
    for line in out.splitlines():
        if line.split()[:1] and line.split()[0].isdigit():
            assert line.split()[1] == "-1", line  # ESRCH: not in its PID namespace
    # The attacker's namespace has only its own processes.
    assert int(scene.run("ls /proc | grep -c '^[0-9]'").strip()) < 10


@pytest.mark.skipif(platform.machine() not in KEYRING_CALLS, reason="numbers not known here")
def test_the_kernels_keyrings_are_refused(scene: Scene) -> None:
    """A root daemon's sandboxes share one user namespace, which keeps a keyring per user:
    a key one added, another could read. Every isolated process is refused the keyring
    calls (EPERM), as under Docker and Flatpak."""
    add_key, request_key, keyctl = next(iter(KEYRING_CALLS[platform.machine()].values()))
    perl = (
        'my ($t, $d, $p) = ("user", "k", "secret");'
        f'print syscall({add_key}, $t, $d, $p, 6, -4) < 0 ? $!+0 : "added", "\\n";'
        f'print syscall({keyctl}, 0, -4, 0) < 0 ? $!+0 : "id", "\\n";'
        f'print syscall({request_key}, $t, $d, 0, 0) < 0 ? $!+0 : "found", "\\n";'
    )
    for sandbox in (scene.attacker, scene.neighbour):
        said = sandbox.commands.run(f"perl -e {shlex.quote(perl)}").stdout.split()
        assert said == [str(errno.EPERM)] * 3


def test_with_internet_off_the_daemons_port_is_unreachable(daemon: Served) -> None:
    port = int(daemon.url.rsplit(":", 1)[1])
    with Sandbox.create(allow_internet_access=False, url=daemon.url, token=daemon.token) as off:
        reach = (
            "import socket; s = socket.socket(); s.settimeout(2); "
            f"print(s.connect_ex(('127.0.0.1', {port})))"
        )
        code = off.commands.run(f"python3 -c {shlex.quote(reach)}").stdout.strip()
        assert code != "0"


def test_a_fork_bomb_stops_at_the_process_limit(daemon: Served, scene: Scene) -> None:
    conn = {"url": daemon.url, "token": daemon.token}
    with Sandbox.create(limits={"pids": 64}, **conn) as bombed:
        bomb = bombed.commands.run(
            "bomb() { bomb | bomb & }; bomb; sleep 2; echo still-here", background=True
        )
        still_serving(scene)  # while the bomb goes off
        bombed.commands.kill(bomb.pid)
        with pytest.raises(CommandExitError):
            bomb.wait()


def test_a_memory_bomb_is_stopped_at_the_memory_limit(daemon: Served, scene: Scene) -> None:
    conn = {"url": daemon.url, "token": daemon.token}
    with Sandbox.create(limits={"memory": "64M"}, **conn) as hog:
        with pytest.raises(CommandExitError) as err:
            hog.commands.run(
                "python3 -c 'b = bytearray(512 * 1024 * 1024); b[::4096] = b\"x\" * len(b[::4096])'"
            )
        how = hog.get_info().limits_enforced["memory"]
        if how == "rlimit":
            assert "MemoryError" in err.value.result.stderr
        else:
            assert err.value.result.reason == "oom" and err.value.exit_code == -9
        still_serving(scene)


def test_filling_the_disk_stops_at_the_disk_limit(daemon: Served, scene: Scene) -> None:
    conn = {"url": daemon.url, "token": daemon.token}
    with Sandbox.create(limits={"disk": "16M"}, **conn) as filler:
        with pytest.raises(CommandExitError) as err:
            filler.commands.run("head -c 200000000 /dev/zero > /home/user/big")
        assert err.value.exit_code == -25  # SIGXFSZ: "File size limit exceeded"
        written = filler.commands.run("stat -c %s /home/user/big").stdout
        assert int(written) == 16 * 1024 * 1024
        still_serving(scene)


@pytest.mark.slow  # `find /` walks the system directories bound in: seconds
def test_log_segments_are_not_visible_from_inside(scene: Scene) -> None:
    scene.run("seq 1 100000")  # a log with segment files behind it
    root = Path(scene.attacker.get_info().workdir or "/nonexistent").parent
    out = scene.run(
        f"ls -A {shlex.quote(str(root))} ../ /home/user/.. 2>&1; "
        "find / -xdev -path '*.run/log-*' 2>/dev/null | head -5; "
        f"truncate -s 0 {shlex.quote(str(root))}/*.run/log-*/* 2>&1"
    )
    assert "No such file or directory" in out
    listed = out.split("truncate")[0]
    assert ".run" not in listed and "log-" not in listed
    assert (
        scene.attacker.commands.connect(scene.attacker.commands.list()[0].pid, cursor=0)
        .wait()
        .stdout.splitlines()[-1]
        == "100000"
    )


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the injection is x86-64's")
def test_bwraps_pid_1_taken_over_still_pauses_and_dies_with_the_sandbox(
    daemon: Served,
) -> None:
    """bubblewrap leaves its PID 1 dumpable under the sandbox's own uid, so a sandboxed
    process can ptrace it and make it exec anything (tests/take_over_pid1.py). What it
    then runs is still the sandbox's: a pause stops it, and the sandbox's kill ends it."""
    conn = {"url": daemon.url, "token": daemon.token}
    marker = f"pid1-{os.getpid()}-{time.monotonic_ns()}"
    loop = f"while :; do date +%s%N >> /tmp/{marker}; sleep 0.01; done"
    with Sandbox.create(**conn) as sbx:
        sbx.files.write("/home/user/take_over_pid1.py", (HERE / "take_over_pid1.py").read_text())
        sbx.files.write(f"/tmp/{marker}", "")
        attack = sbx.commands.run(
            f"python3 take_over_pid1.py /bin/sh -c {shlex.quote(loop)}; exec sleep 60",
            background=True,
        )
        wait_until(
            lambda: "taken over" in attack.stdout or "refused" in attack.stdout,
            what="the takeover",
            info=lambda: attack.stdout + attack.stderr,
        )
        if "refused" in attack.stdout:
            pytest.skip(f"ptrace of PID 1 is refused here: {attack.stdout}")
        _ticks_stop_while_paused(sbx, f"/tmp/{marker}", "PID 1's code")
        sbx.kill()
    wait_until(lambda: not _running_with(marker), what="what PID 1 ran to end with the sandbox")


def _ticks(sbx: Sandbox, path: str) -> int:
    return len(sbx.files.read(path).splitlines())


def _ticks_stop_while_paused(sbx: Sandbox, path: str, what: str) -> int:
    """Once ``what`` (a loop inside that appends a line to ``path`` every 10 ms) ticks,
    pause the sandbox, check that nothing was appended for 0.3 s, resume; the count it
    held at."""
    wait_until(lambda: _ticks(sbx, path) >= 5, what=f"{what} to tick")
    sbx.pause()
    frozen = _ticks(sbx, path)
    time.sleep(0.3)  # sleep-ok: long enough for ~30 ticks, had it not been frozen
    assert _ticks(sbx, path) <= frozen + 1, f"{what} ran on while paused: {sbx.get_info().freezer}"
    sbx.resume()
    return frozen


def _running_with(marker: str) -> list[int]:
    """Live processes whose argv names ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
            marker in arg for arg in proc.info["cmdline"] or []
        ):
            found.append(proc.pid)
    return found


def test_pause_reaches_every_process_inside(daemon: Served) -> None:
    """Whatever the freezer (the unprivileged daemon has no cgroup: signals), pause stops
    a double-forked, setsid'd grandchild inside the namespaces too."""
    conn = {"url": daemon.url, "token": daemon.token}
    with Sandbox.create(**conn) as sbx:
        sbx.commands.run(
            "(setsid sh -c 'while :; do date +%s%N >> /tmp/ticks; sleep 0.01; done' &)",
        )

        frozen = _ticks_stop_while_paused(sbx, "/tmp/ticks", "the grandchild")
        wait_until(lambda: _ticks(sbx, "/tmp/ticks") >= frozen + 5, what="it to resume")
