"""Helpers for the freezer's tests (imported as ``freezer_support``): an independent oracle
for "is this process frozen", and a ``sandboxkit serve`` child process with its own state
file, for the tests that stop or SIGKILL a real daemon."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from support import child_env, end_process

import sandboxkit

REPO = Path(sandboxkit.__file__).resolve().parents[1]


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie awaiting its reaper does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stop_pending(pid: int) -> bool:
    bit = 1 << (signal.SIGSTOP - 1)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & bit:
                    return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def _cgroup_events(pid: int) -> dict[str, str]:
    """The ``cgroup.events`` of the cgroup v2 ``pid`` sits in (empty if none)."""
    try:
        cgpath = next(
            line[3:].rstrip("\n")
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines(True)
            if line.startswith("0::")
        )
        mount = next(
            line.split()[1]
            for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[2:3] == ["cgroup2"]
        )
    except (OSError, StopIteration):
        return {}
    mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), mount)
    events = Path(mount, cgpath.removesuffix(" (deleted)").lstrip("/"), "cgroup.events")
    try:
        return dict(line.split(" ", 1) for line in events.read_text().splitlines())
    except (OSError, ValueError):
        return {}


def process_is_frozen(pid: int) -> bool:
    """True if ``pid`` is stopped by a signal or sits in a frozen cgroup v2.

    Written apart from the freezer's own code, so the tests do not grade the freezer with
    its own helpers. A process in uninterruptible sleep with a pending ``SIGSTOP`` (a
    ``vfork()`` parent whose child was stopped before exec) counts as stopped: it cannot
    run user code first. Processes frozen by the cgroup freezer look ``sleeping`` to ps;
    only ``cgroup.events`` tells.
    """
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return False
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return True
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return False
    if status == psutil.STATUS_DISK_SLEEP and _stop_pending(pid):
        return True
    return _cgroup_events(pid).get("frozen") == "1"


def cli_env(state_file: Path) -> dict[str, str]:
    """This checkout importable, no daemon URL or freezer override, the default state file
    inside the test's directory as a safety net."""
    env = child_env()
    env["SANDBOXKIT_STATE_FILE"] = str(state_file)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@dataclass
class Served:
    """A ``sandboxkit serve`` child process, once it published its state file."""

    proc: subprocess.Popen[bytes]
    state_file: Path
    url: str
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``sandboxkit ARGS --state-file <ours>``."""
        return subprocess.run(
            [sys.executable, "-m", "sandboxkit", *args, "--state-file", str(self.state_file)],
            env=cli_env(self.state_file),
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )


@contextlib.contextmanager
def served(tmp: Path, *args: str) -> Iterator[Served]:
    """``sandboxkit serve ARGS`` with a state file under ``tmp``; ended on exit if it
    still runs (SIGTERM, then SIGKILL: killed outright, it left its directories in
    ``TMPDIR`` for the next daemon to find)."""
    state_file = tmp / "daemon.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state_file), *args],
        env=cli_env(state_file),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not state_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("sandboxkit serve did not publish its state file")
            time.sleep(0.02)  # sleep-ok: poll interval
        published = json.loads(state_file.read_text())
        yield Served(proc, state_file, published["url"], published["token"])
    finally:
        end_process(proc)
