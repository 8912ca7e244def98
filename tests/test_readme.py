"""The README is executed: every ``python`` block runs as written, in a fresh working
directory, against a local daemon of this test's own (found and started the way a reader's
is, through ``$SANDBOXKIT_STATE_FILE``), and prints what the README says it prints. The
``bash`` blocks that are safe to run run too; the others are accounted for below. The
README's first block is what CI runs (``.ci/run``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import sandboxkit
from sandboxkit import Sandbox
from sandboxkit.client.local import ensure_local_daemon
from sandboxkit.statefile import STATE_FILE_ENV, read_state

REPO = Path(sandboxkit.__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```$", README, re.M | re.S)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code for lang, code in BLOCKS if lang == "bash"]

# The bash blocks not run here, and why; every other bash block runs line by line.
INSTALL = 0  # creates .venv and runs the demo and the whole suite: CI runs it (.ci/run)
NOT_RUN = {
    INSTALL: "CI runs it verbatim (.ci/run)",
    2: "placeholders (sbx-1a2b3c4d, 4242) and long-running commands; tests/test_cli.py and "
    "tests/test_cli_run.py run each",
}


def _env(state_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXKIT_")}
    env[STATE_FILE_ENV] = str(state_file)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = "Agg"
    # `sandboxkit ...` as a reader types it: this interpreter's scripts come first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.fixture(scope="module")
def state_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where the README's blocks find (and start) their default daemon; stopped after."""
    path = tmp_path_factory.mktemp("readme-daemon") / "daemon.json"
    try:
        # Started up front, so each block may run alone: the first block a reader runs
        # would start it the same way (tests/test_cli.py covers that path).
        ensure_local_daemon(path)
        yield path
    finally:
        state = read_state(path)
        if state is not None:
            os.kill(state.pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while psutil.pid_exists(state.pid) and time.monotonic() < deadline:
                if psutil.Process(state.pid).status() == psutil.STATUS_ZOMBIE:
                    break
                time.sleep(0.05)  # sleep-ok: poll interval while the daemon shuts down
            assert not psutil.pid_exists(state.pid) or (
                psutil.Process(state.pid).status() == psutil.STATUS_ZOMBIE
            ), "the README's daemon did not stop"


def _run(args: list[str], cwd: Path, state_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=cwd,
        env=_env(state_file),
        capture_output=True,
        text=True,
        timeout=150,
        stdin=subprocess.DEVNULL,
    )


def test_the_readme_has_what_this_file_runs() -> None:
    assert len(PYTHON) >= 5
    assert set(NOT_RUN) < set(range(len(BASH)))
    install = BASH[INSTALL].strip().splitlines()
    assert len(install) == 2, "the README's first block is its two commands"


def test_ci_runs_the_readmes_two_commands_verbatim(tmp_path: Path) -> None:
    """`.ci/run` takes the two commands out of the README's first block, so what CI
    tests is the README's text; this runs its extraction and compares."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "install-system.sh" in ci
    expected = [line.split("  #")[0].strip() for line in BASH[INSTALL].strip().splitlines()]
    extract = re.search(r"^readme_commands\(\) \{\n(.*?)^\}", ci, re.M | re.S)
    assert extract, "no readme_commands() in .ci/run"
    got = subprocess.run(
        ["bash", "-c", f"readme_commands() {{\n{extract[1]}}}\nreadme_commands"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert got == expected
    assert all(".venv" in command for command in got), "each command makes its own venv"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("index", range(len(PYTHON)), ids=lambda i: f"python-{i + 1}")
def test_python_block_runs_as_written(index: int, tmp_path: Path, state_file: Path) -> None:
    code = PYTHON[index]
    result = _run([sys.executable, "-c", code], tmp_path, state_file)
    assert result.returncode == 0, f"block {index + 1}:\n{code}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    assert "Task exception was never retrieved" not in result.stderr, result.stderr
    out = result.stdout
    # What the block left running: only a block that says so (the notebook one, whose
    # sandbox ends by its timeout) may leave a live sandbox; the test ends it.
    state = read_state(state_file)
    assert state is not None
    live = [s for s in Sandbox.list(url=state.url, token=state.token) if s.state != "killed"]
    for info in live:
        Sandbox.connect(info.sandbox_id, url=state.url, token=state.token).kill()
    if "ends by itself" not in code:
        assert live == [], f"block {index + 1} left {live}"
    if "worker.py" in code:
        # Every line of the worker, once, in order (through a pause and a reattach), then
        # the exit code; the events and consumers tables.
        lines = [line for line in out.splitlines() if line.startswith("line ")]
        assert lines == [f"line {i:02d}" for i in range(20)], out
        after = out.splitlines()[out.splitlines().index("line 19") + 1 :]
        assert after[0] == "0", out
        assert "sandbox.paused" in out and "sandbox.resumed" in out
    if "no_such_module" in code:
        assert re.search(r"failed with exit code 1; the end of its stderr:", out), out
        assert "ModuleNotFoundError: No module named 'no_such_module'" in out, out
        assert out.strip().splitlines()[-1] == "-15", out
    if "set_timeout" in code:
        assert out.strip().splitlines()[-1] == "['running']", out
    if "debug=True" in code:
        assert "hello from e2b" in out and "['1', '2', '3']" in out, out
    if "api_url" in code:
        assert "resumed" in out and "True" in out, out
    if 'provider="e2b"' in code:
        assert "['line 1', 'line 2', 'line 3']" in out and "as seen by this client" in out, out
    if "compare(" in code:
        assert re.search(r"blocking\s+\d/3", out) and re.search(r"cursor\s+0/3", out), out


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "index", [i for i in range(len(BASH)) if i not in NOT_RUN], ids=lambda i: f"bash-{i + 1}"
)
def test_bash_block_runs_as_written(index: int, tmp_path: Path, state_file: Path) -> None:
    for line in BASH[index].strip().splitlines():
        command = line.split("  #")[0].strip()
        result = _run(["bash", "-c", command], tmp_path, state_file)
        assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
        if command == "sandboxkit tour":
            assert len(re.findall(r"\sTrue\s*$", result.stdout, re.M)) == 2, result.stdout
            assert "nothing is left running" in result.stdout
        if command == "sandboxkit status":
            assert "daemon http://127.0.0.1:" in result.stdout, result.stdout


def test_every_reference_points_inside_the_repository() -> None:
    texts = {"README.md": README}
    for folder in ("sandboxkit", "notebooks", "docs", "binder"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in {".py", ".md", ".ipynb", ".txt", ".toml", ".yml"}:
                texts[str(path.relative_to(REPO))] = path.read_text(errors="replace")
    for name, text in texts.items():
        assert "DESIGN.md" not in text, name
        assert "shared design" not in text, name
        assert not re.search(r"\bOWNER/", text), f"{name}: a placeholder owner in a URL"
    for link in re.findall(r"\]\(((?!https?://)[^)#]+)", README):
        assert (REPO / link).exists(), link
    catalogue = (REPO / "docs" / "failures.md").read_text()
    for n in range(1, 11):
        assert f"## F{n} " in catalogue, f"F{n}"
