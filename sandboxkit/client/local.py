"""Finding the daemon: explicit arguments, then environment, then the local state file —
starting a local daemon as a separate background process when none is running."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from sandboxkit.errors import DaemonUnavailable
from sandboxkit.statefile import DaemonState, default_state_path, read_state

__all__ = ["TOKEN_ENV", "URL_ENV", "Connection", "ensure_local_daemon", "probe", "resolve"]

URL_ENV = "SANDBOXKIT_URL"
TOKEN_ENV = "SANDBOXKIT_TOKEN"
_START_TIMEOUT = 30.0


@dataclass(frozen=True)
class Connection:
    """Where the daemon is and the token it wants."""

    url: str
    token: str | None


def resolve(url: str | None = None, token: str | None = None) -> Connection:
    """Arguments first, then ``$SANDBOXKIT_URL``/``$SANDBOXKIT_TOKEN``, then the local
    daemon found through (or started next to) the state file."""
    if url is not None:
        return Connection(url, token if token is not None else os.environ.get(TOKEN_ENV))
    env_url = os.environ.get(URL_ENV)
    if env_url:
        return Connection(env_url, token if token is not None else os.environ.get(TOKEN_ENV))
    state = ensure_local_daemon()
    return Connection(state.url, state.token)


def probe(state: DaemonState, timeout: float = 2.0) -> bool:
    """True if the daemon in ``state`` answers its health check with this token."""
    if not _pid_alive(state.pid):
        return False
    try:
        response = httpx.get(
            state.url + "/health",
            headers={"Authorization": f"Bearer {state.token}"},
            timeout=timeout,
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def ensure_local_daemon(state_path: Path | None = None) -> DaemonState:
    """The running local daemon, started first if there is none (as a background process
    in its own session, so it outlives this Python process — a notebook kernel restart
    finds it again)."""
    path = state_path or default_state_path()
    state = read_state(path)
    if state is not None and probe(state):
        return state
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(path.with_suffix(".lock")):
        state = read_state(path)  # another process may have started it meanwhile
        if state is not None and probe(state):
            return state
        return _spawn(path)


def _spawn(path: Path) -> DaemonState:
    log = open(path.with_suffix(".log"), "ab")  # noqa: SIM115 - handed to the child
    with log:
        child = subprocess.Popen(
            [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        state = read_state(path)
        if state is not None and state.pid == child.pid and probe(state):
            return state
        if child.poll() is not None:
            raise DaemonUnavailable(
                f"the local daemon exited at start (code {child.returncode}); "
                f"see {path.with_suffix('.log')}"
            )
        time.sleep(0.05)
    child.kill()
    raise DaemonUnavailable(f"the local daemon did not start within {_START_TIMEOUT}s")


@contextlib.contextmanager
def _locked(path: Path):  # type: ignore[no-untyped-def]
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
