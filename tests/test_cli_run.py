"""The command line can start work too: ``sandboxkit run [--sandbox ID] [--follow] -- CMD``
(a new sandbox unless one is named), and ``logs --follow`` stopped by SIGTERM says where
to resume, as on Ctrl-C. Every state file lives under tmp_path."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
from support import wait_until
from test_cli import Served, cli, served, stop_daemon

from sandboxkit import Sandbox

__all__ = ["served"]  # the fixture, from test_cli


@pytest.mark.timeout(90)
def test_run_follow_in_a_new_sandbox_exits_with_the_commands_code(served: Served) -> None:
    state = served.wait_ready()
    flag = ("--state-file", str(served.state_path))
    try:
        before = {s.sandbox_id for s in Sandbox.list(url=state.url, token=state.token)}
        out = cli(
            "run",
            *flag,
            "--follow",
            "--",
            "sh",
            "-c",
            "echo hi; echo err >&2; exit 3",
            env=served.env,
        )
        assert out.returncode == 3, out.stderr
        assert out.stdout == "hi\n"
        said = re.search(r"sandbox (sbx-\w+) pid (\d+)", out.stderr)
        assert said, out.stderr
        assert "err\n" in out.stderr
        after = {s.sandbox_id for s in Sandbox.list(url=state.url, token=state.token)}
        assert after - before == {said[1]}

        # One word is a shell command line.
        shell = cli("run", *flag, "-f", "--", "echo $((40 + 2))", env=served.env)
        assert shell.returncode == 0 and shell.stdout == "42\n", shell.stderr
    finally:
        stop_daemon(served.state_path, served.env)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_run_in_a_named_sandbox_prints_its_id_and_pid(served: Served) -> None:
    state = served.wait_ready()
    flag = ("--state-file", str(served.state_path))
    sbx = Sandbox.create(url=state.url, token=state.token)
    try:
        out = cli("run", *flag, "--sandbox", sbx.sandbox_id, "--", "echo in-named", env=served.env)
        assert out.returncode == 0, out.stderr
        said = re.fullmatch(rf"sandbox {sbx.sandbox_id} pid (\d+)\n", out.stdout)
        assert said, out.stdout
        handle = sbx.commands.connect(int(said[1]), cursor=0)
        assert handle.wait().stdout == "in-named\n"

        missing = cli("run", *flag, "--sandbox", "sbx-nothere", "--", "true", env=served.env)
        assert missing.returncode == 1 and "no sandbox sbx-nothere" in missing.stderr
        empty = cli("run", *flag, "--", env=served.env)
        assert empty.returncode == 2 and "no command" in empty.stderr
    finally:
        sbx.close()
        stop_daemon(served.state_path, served.env)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_logs_follow_prints_its_resume_cursor_on_sigterm(served: Served) -> None:
    state = served.wait_ready()
    sbx = Sandbox.create(url=state.url, token=state.token)
    try:
        handle = sbx.commands.run(
            "for i in $(seq 1 3); do echo line $i; done; read x; echo after $x", background=True
        )
        wait_until(lambda: "line 3" in handle.stdout, what="output")
        logs = [sys.executable, "-m", "sandboxkit", "logs", sbx.sandbox_id, str(handle.pid)]
        follower = subprocess.Popen(
            [*logs, "--follow", "--state-file", str(served.state_path)],
            env=served.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert follower.stdout is not None
            for n in range(1, 4):
                assert follower.stdout.readline() == f"line {n}\n"
            follower.send_signal(signal.SIGTERM)
            _out, err = follower.communicate(timeout=30)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait(10)
        assert follower.returncode == 128 + signal.SIGTERM, err
        assert "Traceback" not in err
        resume = re.search(r"resume with: sandboxkit logs \S+ \d+ --cursor (\d+)", err)
        assert resume, err
        # Resuming there gives exactly what came after.
        handle.send_stdin("now\n")
        handle.wait()
        rest = cli(
            "logs",
            sbx.sandbox_id,
            str(handle.pid),
            "--cursor",
            resume[1],
            "--state-file",
            str(served.state_path),
            env=served.env,
        )
        assert rest.stdout == "after now\n", rest.stderr
    finally:
        sbx.close()
        stop_daemon(served.state_path, served.env)
