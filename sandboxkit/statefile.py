"""The state file through which clients find the local daemon (url, pid, token).

Like a tmux socket: the daemon writes it when it starts serving and removes it when it
stops; a client (a notebook, even after a kernel restart) reads it to reattach.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "STATE_FILE_ENV",
    "DaemonState",
    "default_state_path",
    "read_state",
    "remove_state",
    "write_state",
]

STATE_FILE_ENV = "SANDBOXKIT_STATE_FILE"


@dataclass(frozen=True)
class DaemonState:
    """Where a running daemon listens and how to authenticate to it."""

    url: str
    pid: int
    token: str
    started_at: float
    version: str


def default_state_path() -> Path:
    """``$SANDBOXKIT_STATE_FILE``, else ``$XDG_RUNTIME_DIR/sandboxkit/daemon.json``, else
    ``~/.sandboxkit/daemon.json``."""
    override = os.environ.get(STATE_FILE_ENV)
    if override:
        return Path(override)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "sandboxkit" if runtime else Path.home() / ".sandboxkit"
    return base / "daemon.json"


def write_state(path: Path, state: DaemonState) -> None:
    """Write atomically with mode 0600 (the token is a secret)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".daemon-", suffix=".json")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(state), f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_state(path: Path) -> DaemonState | None:
    """The state in ``path``, or ``None`` if it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
        return DaemonState(
            url=str(data["url"]),
            pid=int(data["pid"]),
            token=str(data["token"]),
            started_at=float(data["started_at"]),
            version=str(data.get("version", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_state(path: Path, pid: int) -> None:
    """Remove the state file if it still belongs to daemon ``pid``."""
    state = read_state(path)
    if state is not None and state.pid == pid:
        with contextlib.suppress(OSError):
            path.unlink()
