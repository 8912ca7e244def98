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

from sandboxkit._proc import pid_alive
from sandboxkit.client.transport import http_options
from sandboxkit.errors import DaemonUnavailable
from sandboxkit.statefile import (
    DaemonState,
    default_state_path,
    install_state_path,
    read_state,
    same_install,
    this_install,
)

__all__ = [
    "TOKEN_ENV",
    "URL_ENV",
    "Connection",
    "ensure_local_daemon",
    "local_state_path",
    "probe",
    "resolve",
    "resolved",
    "spawn_daemon",
]

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
    known = _known_daemon()
    if known is not None:
        return known
    state = ensure_local_daemon()
    return Connection(state.url, state.token)


def resolved(url: str | None = None, token: str | None = None) -> Connection | None:
    """What :func:`resolve` answers, if that needs no waiting: arguments, environment, or
    the local daemon found before whose state file is unchanged and whose process is
    alive (a few microseconds). ``None``: call :func:`resolve` (off the event loop)."""
    if url is not None or os.environ.get(URL_ENV):
        return resolve(url, token)
    return _known_daemon()


# The local daemon resolve() found last: the state file it asked, the file the daemon
# publishes to, that file's identity then, and the daemon.
_last: tuple[Path, Path, tuple[int, int, int], DaemonState] | None = None


def _known_daemon() -> Connection | None:
    """The daemon found last, if its state file is the one asked now, unchanged since,
    and its process is alive — no need to read the file or ask the daemon again."""
    if _last is None:
        return None
    asked, path, identity, state = _last
    if asked != default_state_path() or _identity(path) != identity or not pid_alive(state.pid):
        return None
    return Connection(state.url, state.token)


def _remember(asked: Path, path: Path, state: DaemonState) -> DaemonState:
    global _last
    identity = _identity(path)
    if identity is not None:
        _last = (asked, path, identity, state)
    return state


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def probe(state: DaemonState, timeout: float = 2.0) -> bool:
    """True if the daemon in ``state`` answers its health check with this token."""
    if not pid_alive(state.pid):
        return False
    try:
        response = httpx.get(
            state.url + "/health",
            headers={"Authorization": f"Bearer {state.token}"},
            timeout=timeout,
            **http_options(state.url),
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def local_state_path(state_path: Path | None = None) -> Path:
    """The state file of this install's local daemon: the default one (or
    ``state_path``), unless a live daemon of another sandboxkit install — another venv,
    version or checkout — holds it; then a file of this install's own beside it."""
    path = state_path or default_state_path()
    state = read_state(path)
    if state is not None and not same_install(state) and probe(state):
        return install_state_path(path)
    return path


def ensure_local_daemon(state_path: Path | None = None) -> DaemonState:
    """The running local daemon of this install, started first if there is none (as a
    background process in its own session, so it outlives this Python process — a
    notebook kernel restart finds it again). A daemon started by another install is left
    alone: this one starts its own beside it (see :func:`local_state_path`)."""
    asked = state_path or default_state_path()
    path = local_state_path(state_path)
    state = read_state(path)
    if state is not None and same_install(state) and probe(state):
        return _remember(asked, path, state)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _locked(path.with_suffix(".lock")):
        state = read_state(path)  # another process may have started it meanwhile
        if state is not None and probe(state):
            if same_install(state):
                return _remember(asked, path, state)
            raise DaemonUnavailable(
                f"the state file {path} belongs to a running daemon of another install, "
                f"{state.describe()}; this is sandboxkit {_this()}. Stop it (`sandboxkit "
                "stop` from that install) or set SANDBOXKIT_STATE_FILE to another path."
            )
        return _remember(asked, path, spawn_daemon(path))


def _this() -> str:
    version, executable, install = this_install()
    return f"{version} ({executable}, {install})"


def spawn_daemon(path: Path) -> DaemonState:
    """Start ``sandboxkit serve`` publishing to ``path`` as a background process (its own
    session, output appended to ``path`` with the suffix ``.log``) and wait until it
    answers."""
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
