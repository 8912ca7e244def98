"""The README and the guide are executed: every code block they show is found by the
marker on the line before it (``<!-- test: NAME -->``), and every ``python`` block runs as
written, in a fresh working directory, against a local daemon of this test's own (found
and started the way a reader's is, through ``$SANDBOXKIT_STATE_FILE``), and prints what
the page says it prints — each block's check is keyed by its name, so moving a block, or
adding one before it, changes nothing here. The ``bash`` blocks that are safe to run run
too; the others are accounted for below. The README's block ``install`` is its first
``bash`` block, which is what CI runs (``.ci/run``).

Blocks that moved out of the README into ``docs/`` keep their markers and run from there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

import sandboxkit
from sandboxkit import Sandbox
from sandboxkit.client.local import ensure_local_daemon
from sandboxkit.statefile import STATE_FILE_ENV, read_state

REPO = Path(sandboxkit.__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# The pages whose marked blocks run. In the README and the guide every python and bash
# block carries a marker; docs/e2b.md also shows fragments with placeholders, unmarked.
PAGES = ["README.md", "docs/guide.md", "docs/e2b.md"]
FULLY_MARKED = {"README.md", "docs/guide.md"}

MARKER = re.compile(r"^<!-- test: ([\w-]+) -->\n```(\w+)\n(.*?)^```$", re.M | re.S)
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    name: str
    lang: str
    code: str
    page: str


def _blocks() -> dict[str, Block]:
    found: dict[str, Block] = {}
    for page in PAGES:
        for name, lang, code in MARKER.findall((REPO / page).read_text()):
            assert name not in found, f"two blocks named {name!r} ({found[name].page}, {page})"
            found[name] = Block(name, lang, code, page)
    return found


BLOCKS = _blocks()
PYTHON = sorted(name for name, b in BLOCKS.items() if b.lang == "python")
BASH = sorted(name for name, b in BLOCKS.items() if b.lang == "bash")

# The bash blocks not run here, and why; every other bash block runs line by line.
NOT_RUN = {
    "install": "creates .venv and runs the demo and the whole suite: CI runs it (.ci/run)",
    "cli-reference": "placeholders (sbx-1a2b3c4d, 4242) and long-running commands; "
    "tests/test_cli.py and tests/test_cli_run.py run each",
}
# The python blocks that may leave a sandbox running: the notebook one, whose sandbox
# ends by its timeout (the page says so); the test ends it.
LEAVES_A_SANDBOX = {"notebook"}


def _check_quickstart(out: str) -> None:
    # Every line of the worker, once, in order (through a pause and a reattach), then the
    # exit code; the events and consumers tables.
    lines = [line for line in out.splitlines() if line.startswith("line ")]
    assert lines == [f"line {i:02d}" for i in range(20)], out
    after = out.splitlines()[out.splitlines().index("line 19") + 1 :]
    assert after[0] == "0", out
    assert "sandbox.paused" in out and "sandbox.resumed" in out


def _check_errors_exit(out: str) -> None:
    assert re.search(r"failed with exit code 1; the end of its stderr:", out), out
    assert "ModuleNotFoundError: No module named 'no_such_module'" in out, out
    assert out.strip().splitlines()[-1] == "-15", out


def _check_errors_not_found(out: str) -> None:
    assert out.splitlines()[:2] == ["exit 0", "ResultUnavailable"], out


def _check_lifetime(out: str) -> None:
    assert out.strip().splitlines()[-1] == "['running']", out


def _check_e2b_sdk(out: str) -> None:
    assert "hello from e2b" in out and "['1', '2', '3']" in out, out
    assert "resumed" in out and "True" in out, out


def _check_e2b_provider(out: str) -> None:
    assert "['line 1', 'line 2', 'line 3']" in out and "as seen by this client" in out, out


def _check_compare(out: str) -> None:
    assert re.search(r"blocking\s+\d/3", out) and re.search(r"cursor\s+0/3", out), out


def _check_files(out: str) -> None:
    assert out.splitlines() == [
        "hello from a file",
        "",
        "print('hello from a file')",
        "",
        "['worker.py']",
    ], out


def _check_notebook(out: str) -> None:
    pass  # what it shows is widgets; the block runs to the end without an error


# What each python block prints, by name.
CHECKS: dict[str, Callable[[str], None]] = {
    "quickstart": _check_quickstart,
    "errors-exit": _check_errors_exit,
    "errors-not-found": _check_errors_not_found,
    "lifetime": _check_lifetime,
    "e2b-sdk": _check_e2b_sdk,
    "e2b-provider": _check_e2b_provider,
    "compare": _check_compare,
    "notebook": _check_notebook,
    "files": _check_files,
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


def test_the_pages_mark_every_block_this_file_runs() -> None:
    for page in FULLY_MARKED:
        text = (REPO / page).read_text()
        shown = [code for lang, code in FENCE.findall(text) if lang in {"python", "bash"}]
        marked = [b.code for b in BLOCKS.values() if b.page == page]
        assert sorted(shown) == sorted(marked), f"{page}: a python or bash block without a marker"
    # Every python block has its check, and every check its block: none was lost in a move.
    assert set(CHECKS) == set(PYTHON), (sorted(CHECKS), PYTHON)
    assert set(NOT_RUN) < set(BASH)
    assert "cli-tour" in BASH
    assert BLOCKS["quickstart"].page == "README.md", "the README's one example"
    install = BLOCKS["install"]
    assert install.page == "README.md"
    first_bash = next(code for lang, code in FENCE.findall(README) if lang == "bash")
    assert first_bash == install.code, "the README's first bash block is `install`"
    assert len(install.code.strip().splitlines()) == 2, (
        "the README's first block is its two commands"
    )


def test_ci_runs_the_readmes_two_commands_verbatim(tmp_path: Path) -> None:
    """`.ci/run` takes the two commands out of the README's first block, so what CI
    tests is the README's text; this runs its extraction and compares."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "install-system.sh" in ci
    install = BLOCKS["install"].code
    expected = [line.split("  #")[0].strip() for line in install.strip().splitlines()]
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
@pytest.mark.parametrize("name", PYTHON)
def test_python_block_runs_as_written(name: str, tmp_path: Path, state_file: Path) -> None:
    block = BLOCKS[name]
    result = _run([sys.executable, "-c", block.code], tmp_path, state_file)
    where = f"{block.page}, block {name}"
    assert result.returncode == 0, f"{where}:\n{block.code}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    assert "Task exception was never retrieved" not in result.stderr, result.stderr
    # What the block left running: only a block that says so may leave a live sandbox.
    state = read_state(state_file)
    assert state is not None
    live = [s for s in Sandbox.list(url=state.url, token=state.token) if s.state != "killed"]
    for info in live:
        Sandbox.connect(info.sandbox_id, url=state.url, token=state.token).kill()
    if name in LEAVES_A_SANDBOX:
        assert "ends by itself" in block.code, f"{where} leaves a sandbox and must say so"
    else:
        assert live == [], f"{where} left {live}"
    CHECKS[name](result.stdout)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", [name for name in BASH if name not in NOT_RUN])
def test_bash_block_runs_as_written(name: str, tmp_path: Path, state_file: Path) -> None:
    for line in BLOCKS[name].code.strip().splitlines():
        command = line.split("  #")[0].strip()
        result = _run(["bash", "-c", command], tmp_path, state_file)
        assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
        if command == "sandboxkit tour":
            assert len(re.findall(r"\sTrue\s*$", result.stdout, re.M)) == 2, result.stdout
            assert "nothing is left running" in result.stdout
        if command == "sandboxkit status":
            assert "daemon http://127.0.0.1:" in result.stdout, result.stdout


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    as hyphens."""
    headings = re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


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
    # Links between the pages: the file exists, and so does the heading an anchor names.
    for page in ["README.md", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]:
        base = (REPO / page).parent
        prose = FENCE.sub("", (REPO / page).read_text())
        for target, anchor in re.findall(r"\]\(((?!https?://)[^)#]*)(?:#([^)]+))?\)", prose):
            path = base / target if target else REPO / page
            assert path.exists(), f"{page}: {target}"
            if anchor:
                assert anchor in _anchors(path), f"{page}: {target}#{anchor}: no such heading"
    catalogue = (REPO / "docs" / "failures.md").read_text()
    for n in range(1, 11):
        assert f"## F{n} " in catalogue, f"F{n}"
