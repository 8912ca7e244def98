"""``sandboxkit serve`` as an unprivileged account, from a test suite that runs as root.

Most people run the daemon as themselves, not as root; the escape suite must hold for
that daemon too. The interpreter, this checkout and the venv's packages may sit where
another account cannot reach them (root's home is 0700), so the daemon starts in a
private mount namespace where each is bind-mounted under one world-readable directory,
then drops to ``nobody`` (``setpriv``) before Python starts. Nothing is copied, and
nothing outside the test's own directories changes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
from freezer_support import Served
from support import end_process

import sandboxkit

NOBODY = 65534


def can_run_unprivileged() -> str:
    """Why not (empty: it can)."""
    if os.geteuid() != 0:
        return "the suite is not root: the daemon already runs unprivileged"
    for tool in ("unshare", "setpriv", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is missing"
    return ""


@contextlib.contextmanager
def served_unprivileged(*args: str) -> Iterator[Served]:
    """``sandboxkit serve ARGS`` as ``nobody``, with its state file in its own directory."""
    base = Path(tempfile.mkdtemp(prefix="sbx-unpriv-"))
    try:
        os.chmod(base, 0o755)
        interpreter = Path(os.path.realpath(sys.executable))
        py_root = interpreter.parents[1]
        mounts = {
            "py": py_root,
            "repo": Path(sandboxkit.__file__).resolve().parents[1],
            "site": Path(msgspec.__file__).resolve().parents[1],
        }
        home = base / "home"
        home.mkdir()
        os.chown(home, NOBODY, NOBODY)
        for name in mounts:
            (base / name).mkdir()
        state_file = home / "daemon.json"
        binds = " && ".join(f'mount --bind "${i + 1}" "$0/{n}"' for i, n in enumerate(mounts))
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXKIT_")}
        env.update(
            HOME=str(home),
            TMPDIR=str(home),
            PYTHONPATH=f"{base}/repo:{base}/site",
            # Its own libpython, not the system's: the interpreter's rpath is unreachable.
            LD_LIBRARY_PATH=f"{base}/py/lib",
            SANDBOXKIT_STATE_FILE=str(state_file),
        )
        env.pop("XDG_RUNTIME_DIR", None)
        argv = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "/bin/sh",
            "-c",
            f'{binds} && shift 3 && exec "$@"',
            str(base),
            *(str(p) for p in mounts.values()),
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            "--",
            str(base / "py" / interpreter.relative_to(py_root)),
            "-m",
            "sandboxkit",
            "serve",
            "--state-file",
            str(state_file),
            *args,
        ]
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=home,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 30
            while not state_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.poll() is not None else ""
                    raise AssertionError(f"unprivileged serve did not start: {err}")
                time.sleep(0.02)  # sleep-ok: poll interval
            published = json.loads(state_file.read_text())
            yield Served(proc, state_file, published["url"], published["token"])
        finally:
            end_process(proc)
            assert proc.stderr is not None
            proc.stderr.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
