"""Every notebook in ``notebooks/`` runs top to bottom, unattended, in a real kernel.

Each notebook connects the normal way (no url/token: the embedded default daemon found
through the state file). The kernel gets ``SANDBOXKIT_STATE_FILE`` pointing into a temp
dir, so the notebook starts a fresh daemon of its own; the test stops it afterwards with
``python -m sandboxkit stop`` and checks that neither the daemon nor any sandbox process
is left. Notebooks run from a temp copy: outputs are never written into the repository.

ipykernel and nbclient are part of the ``test`` extra: if they are missing these tests
fail, they do not skip. They are imported by the tests that use them, not at collection:
nbformat's schema validation takes seconds to import, which every worker would pay.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest

from sandboxkit.statefile import read_state

if TYPE_CHECKING:
    import nbformat

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
NAMES = [
    "01_quickstart.ipynb",
    "02_reproduce_the_stall.ipynb",
    "03_stall_statistics.ipynb",
    "04_remediation_by_hand.ipynb",
]
# The quick run executes the quickstart; the others take 10-15 s each.
QUICK = {"01_quickstart.ipynb"}
CELL_TIMEOUT = 60
KEEPS_RUNNING = {
    "01_quickstart.ipynb": 1,
    "02_reproduce_the_stall.ipynb": 2,
    "04_remediation_by_hand.ipynb": 1,
}
"""Notebooks that leave their sandboxes running on purpose (Run All leaves every widget
live), and how many; each was created with a ``timeout`` so that it ends by itself."""

PANEL_CONTRACT = """
first = panel.state.snapshot().line_count
await wait_for(lambda: panel.state.snapshot().line_count > first, timeout=10,
               what="the status line to grow")
sent = panel.flushes
await wait_for(lambda: panel.flushes > sent, timeout=10, what="the panel to keep sending")
old_pid = panel.pid
panel.buttons["Kill-restart"].click()  # what a click in the browser does
await wait_for(
    lambda: panel.pid != old_pid
    and panel.state.snapshot().status_line.startswith(f"pid {panel.pid} "),
    timeout=15,
    what="a new pid in the status line",
)
await wait_for(lambda: chart.pid == panel.pid, timeout=10, what="the chart to follow")
print("panel contract ok:", old_pid, "->", panel.pid)
"""
"""Appended to notebook 04's temp copy: what the browser test relies on after "run all"
— the ``panel`` variable's status widget (``lines <n>``) keeps growing while the kernel
is idle, and its Kill-restart button switches the status to a new pid."""


def _text(nb: nbformat.NotebookNode) -> str:
    """Every stream and plain-text output of an executed notebook, joined."""
    parts: list[str] = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append(output.get("text", ""))
            elif "data" in output:
                parts.append(output["data"].get("text/plain", ""))
    return "\n".join(parts)


def _daemon_tree(pid: int) -> list[psutil.Process]:
    try:
        daemon = psutil.Process(pid)
        return [daemon, *daemon.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _sandboxes(url: str, token: str | None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(url + "/sandboxes", headers=headers, timeout=10)
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()
    return result


def _stop_daemon(state_file: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "sandboxkit", "stop", "--state-file", str(state_file)],
        check=True,
        capture_output=True,
        timeout=60,
    )


def _run_notebook(
    name: str, workdir: Path, extra: Sequence[str] = ()
) -> tuple[nbformat.NotebookNode, dict[str, Any]]:
    """Execute a temp copy of ``name`` (plus ``extra`` code cells) against a fresh
    daemon; return the executed notebook and the sandboxes still running at its end."""
    import nbformat
    from nbclient import NotebookClient

    source = NOTEBOOKS / name
    copy = workdir / name
    shutil.copyfile(source, copy)
    nb = nbformat.read(copy, as_version=4)
    nb.cells.extend(nbformat.v4.new_code_cell(code) for code in extra)
    state_file = workdir / "state" / "daemon.json"
    env = {k: v for k, v in os.environ.items() if k not in ("SANDBOXKIT_URL", "SANDBOXKIT_TOKEN")}
    env["SANDBOXKIT_STATE_FILE"] = str(state_file)
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT,
        startup_timeout=60,
        resources={"metadata": {"path": str(workdir)}},
    )
    tree: list[psutil.Process] = []
    try:
        client.execute(env=env)
        state = read_state(state_file)
        assert state is not None, "the notebook did not start the embedded default daemon"
        tree = _daemon_tree(state.pid)
        running = {
            s["sandbox_id"]: s.get("timeout")
            for s in _sandboxes(state.url, state.token)
            if s["state"] != "killed"
        }
    finally:
        state = read_state(state_file)
        if state is not None:
            tree = tree or _daemon_tree(state.pid)
            _stop_daemon(state_file)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.05)  # sleep-ok: poll interval
        left = [p for p in tree if _alive(p)]
        for p in left:
            p.kill()
    assert not left, f"processes left after stopping the daemon: {[p.pid for p in left]}"
    assert read_state(state_file) is None, "the state file outlived the daemon"
    return nb, running


def test_notebooks_are_committed_clean() -> None:
    """No stored outputs or execution counts: a clean diff and nothing stale."""
    import nbformat

    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernelspec"]["name"] == "python3"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [], f"{name}: a code cell has stored outputs"
                assert cell.execution_count is None, f"{name}: a code cell has a count"


def test_the_python3_kernel_is_installed() -> None:
    from jupyter_client.kernelspec import KernelSpecManager

    assert "python3" in KernelSpecManager().find_kernel_specs()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in NAMES]
)
def test_notebook_runs_unattended(name: str, tmp_path: Path) -> None:
    started = time.monotonic()
    extra = [PANEL_CONTRACT] if name == "04_remediation_by_hand.ipynb" else []
    nb, running = _run_notebook(name, tmp_path, extra)
    elapsed = time.monotonic() - started
    text = _text(nb)
    if name in KEEPS_RUNNING:
        assert len(running) == KEEPS_RUNNING[name], running
        assert all(timeout == 600 for timeout in running.values()), running
    else:
        assert not running, f"{name} left sandboxes running: {running}"
    checks = {
        "01_quickstart.ipynb": ["hello from a sandbox", "exit code: 0", "after the resume"],
        "02_reproduce_the_stall.ipynb": [
            "refresh before the pause: 3 of 3 answered",
            "refresh complete after the resume: False",  # blocking: the wedge
            "refresh complete after the resume: True",  # cursor: no wedge
            "STALLED",
        ],
        "03_stall_statistics.ipynb": [
            "stall rate [95% CI]",
            "6/6",  # blocking: every cycle stalls, as in the reports
            "kick",
            "cursor",
        ],
        "04_remediation_by_hand.ipynb": [
            "STALLED",
            "lines received in the 3 s after the reattach: 0",
            "lines so far",
            "panel contract ok:",
        ],
    }[name]
    for expected in checks:
        assert expected in text, f"{name}: {expected!r} not in the outputs:\n{text}"
    # A warning box under a cell is what a reader sees of a lost-output or lab warning
    # that the notebook's own readers should have handled (issue 20).
    warned = [line for line in text.splitlines() if "Warning:" in line]
    assert not warned, f"{name}: warnings in the outputs: {warned}"
    print(json.dumps({"notebook": name, "seconds": round(elapsed, 1)}))
