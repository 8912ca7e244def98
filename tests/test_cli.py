"""The command line and the local daemon, as separate processes: ``serve``, ``status``,
``stop``, ``demo`` and ``ensure_local_daemon``. Every state file lives under tmp_path."""

from __future__ import annotations

import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from support import child_env, wait_until

import sandboxkit
from sandboxkit import Sandbox
from sandboxkit.client.local import ensure_local_daemon, probe
from sandboxkit.daemon.isolation import ISOLATION_ENV
from sandboxkit.daemon.launcher import PROGRAM
from sandboxkit.statefile import STATE_FILE_ENV, DaemonState, read_state

REPO = Path(sandboxkit.__file__).resolve().parents[1]
# After a graceful shutdown uvicorn re-raises the SIGTERM it caught, so the daemon's exit
# status is 0 or "killed by SIGTERM" — never SIGKILL.
CLEAN_EXIT = (0, -signal.SIGTERM)


def _env(state_path: Path) -> dict[str, str]:
    """The environment for our subprocesses: this checkout importable, no daemon URL
    override, and the default state file pointing into tmp_path as a safety net."""
    env = child_env()
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
            time.sleep(0.02)  # sleep-ok: poll interval

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


_FROZEN = """
import gc, os, signal, sys, threading, time
from pathlib import Path
from sandboxkit.cli import main
from sandboxkit.statefile import read_state

def report():
    while read_state(Path(sys.argv[1])) is None:
        time.sleep(0.02)  # sleep-ok: poll interval
    print("frozen", gc.get_freeze_count(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=report, daemon=True).start()
main(["serve", "--state-file", sys.argv[1]])
"""


@pytest.mark.timeout(60)
def test_serve_leaves_what_it_built_to_start_out_of_every_collection(tmp_path: Path) -> None:
    # A full collection walks every object the daemon's process holds, and the daemon
    # serves nothing meanwhile: what it imported and built to start (tens of thousands
    # of objects, never garbage) is frozen once, so that each walks only what serving made.
    state_path = tmp_path / "daemon.json"
    done = subprocess.run(
        [sys.executable, "-c", _FROZEN, str(state_path)],
        env=_env(state_path),
        capture_output=True,
        text=True,
        timeout=40,
        stdin=subprocess.DEVNULL,
    )
    frozen = [
        int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("frozen")
    ]
    assert frozen and frozen[0] > 10_000, done.stdout + done.stderr
    assert read_state(state_path) is None  # stopped as by a SIGTERM: its state removed


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
    built = PROGRAM.is_file()  # hatch_build.py built it where a C compiler was
    said = "forked by a launcher" if built else "a shell started ahead (no launcher"
    assert f"commands: {said}" in status.stdout
    # The spare sandbox (daemon/spare.py), made once the daemon is quiet where launchers are.
    if built:
        wait_until(
            lambda: (
                "spare sandbox: ready" in cli("status", "--state-file", str(path), env=env).stdout
            ),
            what="the spare made",
        )

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
    wait_until(lambda: gone(pid), what="sandbox process gone")
    assert cli("status", "--state-file", str(served.state_path), env=served.env).returncode == 1


# -- 8. ensure_local_daemon ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ensure_local_daemon_starts_one_and_reuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sequential = tmp_path / "seq" / "daemon.json"
    concurrent = tmp_path / "conc" / "daemon.json"
    env = _env(sequential)
    for name in list(os.environ):
        if name.startswith("SANDBOXKIT_") and name != ISOLATION_ENV:
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
        wait_until(lambda: handle.stdout.strip().isdigit(), what="the grandchild's pid")
        leader, grandchild = handle.pid, int(handle.stdout.strip())
        # ($! is the forked shell until it has exec'd sleep.)
        wait_until(lambda: psutil.Process(grandchild).name() == "sleep", what="the sleep")
        assert not gone(leader) and not gone(grandchild)

        stopped = cli("stop", "--state-file", str(served.state_path), env=served.env)
        assert stopped.returncode == 0, stopped.stderr
        assert served.proc.wait(10) in CLEAN_EXIT, "the daemon should shut down cleanly"
        wait_until(lambda: gone(leader) and gone(grandchild), what="sandbox processes gone")
    finally:
        sbx.close()


# -- 10. demo ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_tour(tmp_path: Path) -> None:
    state_path = tmp_path / "demo" / "daemon.json"
    env = _env(state_path)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = cli("tour", "--lines", "40", env=env, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("consumer A", "consumer B"):
        row = rf"^\s*{name}\s+40\s+line 0000\s+line 0039\s+True\s*$"
        assert re.search(row, result.stdout, re.M), result.stdout
    assert "sandbox.paused" in result.stdout
    assert "sandbox.resumed" in result.stdout
    assert "sandboxkit demo:" not in result.stdout
    # One vocabulary: where B detached and reattached is a cursor, the same number.
    detached = re.search(r"B detached at cursor (\d+)", result.stdout)
    reattached = re.search(r"B reattached at cursor (\d+)", result.stdout)
    assert detached and reattached and detached[1] == reattached[1], result.stdout
    # Its daemon was private and is gone: the default state file was never written.
    assert not state_path.exists()
    assert "nothing is left running" in result.stdout
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert [p for p in left if not gone(p.pid)] == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tour_is_exact_ten_times_in_a_row(
    conn: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The tour detaches and reattaches by cursor while the process writes: a cursor read
    at the wrong moment shows up as a duplicated or missing line, about once in ten."""
    from sandboxkit.demo import run_tour

    for attempt in range(10):
        code = run_tour(lines=40, url=conn["url"], token=conn["token"])
        out = capsys.readouterr().out
        assert code == 0, f"run {attempt}:\n{out}"
        assert len(re.findall(r"\s40\s+line 0000\s+line 0039\s+True\s*$", out, re.M)) == 2, out


# -- 11. ps, kill, logs, status from a terminal ------------------------------------------------


def _options(parser: Any) -> Iterator[tuple[str, Any]]:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for option, inner in _options(sub):
                    yield f"{name} {option}", inner
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield "/".join(action.option_strings) or action.dest, action


def test_every_option_says_what_it_is_and_its_default() -> None:
    from sandboxkit.cli import _parser

    parser = _parser()
    top = parser.format_help()
    assert "``" not in top, "plain text, not reStructuredText"
    for command in ("serve", "status", "ps", "kill", "logs", "stop", "demo", "tour"):
        assert command in top, command
    for name, action in _options(parser):
        assert action.help, f"{name} has no help"
    for command in ("serve", "stop", "demo", "tour", "logs", "ps"):
        text = cli(command, "--help", env=_env(Path("unused.json"))).stdout
        for option, action in _options(parser):
            if option.startswith(command + " ") and action.default not in (None, False):
                flag = action.option_strings[0] if action.option_strings else None
                if flag is None:
                    continue
                options = text.split("options:", 1)[1]
                block = options.split("  " + flag, 1)[1].split("\n  -", 1)[0]
                assert "default" in block, f"{option}: no default in {block!r}"


def test_serve_defaults_are_the_daemon_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    # One source: each serve option that sets a DaemonConfig field defaults to that field,
    # so changing the config's default changes the CLI's.
    import dataclasses

    import sandboxkit.cli as cli_module
    from sandboxkit.daemon.config import DaemonConfig

    serve = cli_module._parser().parse_args(["serve"])
    for name in cli_module._CONFIG_OPTIONS:
        assert getattr(serve, name) == getattr(DaemonConfig(), name), name

    @dataclasses.dataclass
    class Changed(DaemonConfig):
        result_ttl: float = 12.5
        stall_timeout: float = 0.75

    monkeypatch.setattr(cli_module, "DaemonConfig", Changed)
    serve = cli_module._parser().parse_args(["serve"])
    assert (serve.result_ttl, serve.stall_timeout) == (12.5, 0.75)


@pytest.mark.slow  # many CLI runs, each a fresh interpreter: seconds
@pytest.mark.timeout(90)
def test_ps_logs_kill_and_status_from_a_terminal(served: Served) -> None:
    state = served.wait_ready()
    path, env = served.state_path, served.env
    flag = ("--state-file", str(path))
    ended = Sandbox.create(url=state.url, token=state.token)
    ended.kill()
    sbx = Sandbox.create(url=state.url, token=state.token)
    try:
        script = "for i in $(seq 1 5); do echo out $i; echo err $i >&2; done; read x; echo after $x"
        handle = sbx.commands.run(script, background=True)
        wait_until(lambda: "out 5" in handle.stdout and "err 5" in handle.stderr, what="output")

        status = cli("status", *flag, env=env)
        assert status.returncode == 0, status.stderr
        assert sbx.sandbox_id in status.stdout
        assert ended.sandbox_id not in status.stdout
        assert "1 ended sandbox not shown" in status.stdout

        ps = cli("ps", *flag, env=env)
        assert ps.returncode == 0, ps.stderr
        assert sbx.sandbox_id in ps.stdout and ended.sandbox_id not in ps.stdout
        assert re.search(rf"pid {handle.pid}\s+running", ps.stdout), ps.stdout
        assert ended.sandbox_id in cli("ps", "--all", *flag, env=env).stdout

        logs = cli("logs", sbx.sandbox_id, str(handle.pid), *flag, env=env)
        assert logs.returncode == 0, logs.stderr
        assert logs.stdout == "".join(f"out {i}\n" for i in range(1, 6))
        assert "".join(f"err {i}\n" for i in range(1, 6)) in logs.stderr
        resume = re.search(r"--cursor (\d+)", logs.stderr)
        assert resume, logs.stderr

        # Exact resume: from the printed cursor, only what came after, then the exit.
        handle.send_stdin("now\n")
        handle.wait()
        rest = cli(
            "logs",
            sbx.sandbox_id,
            str(handle.pid),
            "--cursor",
            resume[1],
            "--follow",
            *flag,
            env=env,
        )
        assert rest.returncode == 0, rest.stderr
        assert rest.stdout == "after now\n"
        assert "exited with code 0" in rest.stderr

        killed = cli("kill", sbx.sandbox_id, *flag, env=env)
        assert killed.returncode == 0, killed.stderr
        assert f"killed sandbox {sbx.sandbox_id}" in killed.stdout
        assert Sandbox.list(url=state.url, token=state.token)[-1].state == "killed"
        assert "2 ended sandboxes not shown" in cli("status", *flag, env=env).stdout
        missing = cli("kill", "sbx-nothere", *flag, env=env)
        assert missing.returncode == 1 and "no sandbox sbx-nothere" in missing.stderr
    finally:
        sbx.close()
        stop_daemon(path, env)


# -- 12. one install, one daemon ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_daemon_of_another_install_is_left_alone(
    tmp_path: Path, daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default state file names a live daemon of another sandboxkit (another venv,
    version or checkout): the client starts its own beside it instead of using it."""
    from sandboxkit.statefile import install_state_path, this_install, write_state

    path = tmp_path / "run" / "daemon.json"
    foreign = DaemonState(
        daemon.url,
        os.getpid(),
        daemon.token,
        time.time(),
        "0.0.1",
        executable="/opt/other-venv/bin/python",
        install="/opt/other-venv/lib/python3/site-packages/sandboxkit",
        prefix="/opt/other-venv",
    )
    write_state(path, foreign)
    assert probe(foreign)
    env = _env(path)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    mine = ensure_local_daemon(path)
    try:
        assert mine.url != foreign.url
        assert (mine.version, mine.executable, mine.install) == this_install()
        assert mine.prefix == sys.prefix
        assert read_state(path) == foreign, "the other install's state file is untouched"
        assert read_state(install_state_path(path)) == mine
        assert ensure_local_daemon(path).pid == mine.pid  # and found again
        status = cli("status", env=env)
        assert mine.url in status.stdout, status.stdout
    finally:
        stop_daemon(install_state_path(path), env)
    assert read_state(path) == foreign


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_logs_follow_shows_each_pause_and_resume_within_1s(served: Served) -> None:
    """Issue 20: the status a terminal reader sees follows the sandbox's lifecycle, whoever
    changes it, within a second (the daemon's keepalive is 2 s here)."""
    state = served.wait_ready()
    sbx = Sandbox.create(url=state.url, token=state.token)
    follower: subprocess.Popen[str] | None = None
    try:
        counter = (
            "import time\nfor i in range(10**6):\n    print(i, flush=True)\n"
            "    time.sleep(0.01)\n"  # sleep-ok: the child's pace
        )
        handle = sbx.commands.run([sys.executable, "-c", counter], background=True)
        follower = subprocess.Popen(
            [
                *(sys.executable, "-m", "sandboxkit", "logs", sbx.sandbox_id, str(handle.pid)),
                *("--follow", "--state-file", str(served.state_path)),
            ],
            env=served.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(line) for line in follower.stderr or ()], daemon=True
        ).start()

        def next_status(timeout: float) -> str:
            deadline = time.monotonic() + timeout
            while True:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                if line.startswith("# pid "):
                    return line

        assert "running" in next_status(10), "the status when the stream starts"
        flag = ("--state-file", str(served.state_path))

        def from_the_cli(action: str) -> Callable[[], None]:
            def act() -> None:
                done = cli(action, sbx.sandbox_id, *flag, env=served.env)
                assert done.returncode == 0, done.stderr
                assert done.stdout.strip().endswith("paused" if action == "pause" else "running")

            return act

        actions = [(sbx.pause, "paused"), (sbx.resume, "running")]  # from code
        actions += [(from_the_cli("pause"), "paused"), (from_the_cli("resume"), "running")]
        for action, shown in actions:
            action()
            line = next_status(1.0)
            assert f" · {shown} · " in line, line
    finally:
        if follower is not None:
            follower.terminate()
            follower.wait(10)
        sbx.kill()
