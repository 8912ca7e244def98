"""A sandboxkit daemon in its own process, for the benchmarks (imported as ``_daemon``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from sandboxkit.statefile import STATE_FILE_ENV, DaemonState, read_state


@contextlib.contextmanager
def local_daemon(
    *serve_args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    found: bool = False,
) -> Iterator[tuple[subprocess.Popen[bytes], DaemonState]]:
    """Run ``sandboxkit serve`` with ``serve_args``; yield its process and state; stop it.

    ``cwd``: run the ``sandboxkit`` package found there (another checkout, to compare);
    ``env``: the daemon's environment (default: this process's); ``found``: while it
    runs, this process's ``create()`` without a ``url`` finds it (its state file named in
    ``SANDBOXKIT_STATE_FILE``), as a notebook finds its daemon.

    Its sandboxes default to ``isolation="none"`` (``SANDBOXKIT_ISOLATION``, which an
    older checkout ignores): the workloads run this interpreter by its host path, which
    a root daemon's namespaced sandbox cannot reach. Isolation's cost is measured by
    name, in ``benchmarks/isolation.py``."""
    state_dir = tempfile.TemporaryDirectory(prefix="sbx-bench-")
    state_path = Path(state_dir.name) / "daemon.json"
    env = {**(os.environ if env is None else env)}
    env.setdefault("SANDBOXKIT_ISOLATION", "none")
    process = subprocess.Popen(
        [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state_path), *serve_args],
        stdout=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
    )
    before = os.environ.get(STATE_FILE_ENV)
    try:
        state = started(process, state_path)
        if found:
            os.environ[STATE_FILE_ENV] = str(state_path)
        yield process, state
    finally:
        if found:
            os.environ.pop(STATE_FILE_ENV, None)
            if before is not None:
                os.environ[STATE_FILE_ENV] = before
        stop(process)
        state_dir.cleanup()


def started(process: subprocess.Popen[bytes], state_path: Path) -> DaemonState:
    """The state ``process`` (a starting daemon) writes to ``state_path``, once it is
    written; RuntimeError if the daemon exits first or takes more than 20 s."""
    deadline = time.monotonic() + 20
    while (state := read_state(state_path)) is None:
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("the daemon did not start")
        time.sleep(0.05)  # sleep-ok: polling for the daemon's state file
    return state


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited after 15 s."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
