"""The state file through which clients find the local daemon (url, pid, token).

Like a tmux socket: the daemon writes it when it starts serving and removes it when it
stops; a client (a notebook, even after a kernel restart) reads it to reattach. It also
records which sandboxkit the daemon is — its version, interpreter and package directory —
so that a client from another install does not silently talk to it (see
:func:`same_install`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandboxkit._version import __version__

__all__ = [
    "STATE_FILE_ENV",
    "DaemonState",
    "default_state_path",
    "install_state_path",
    "read_state",
    "remove_state",
    "same_install",
    "this_install",
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
    executable: str = field(default_factory=lambda: sys.executable)
    """The interpreter the daemon runs on (``""`` in files written before it was recorded)."""
    install: str = field(default_factory=lambda: this_install()[2])
    """The directory of the ``sandboxkit`` package the daemon imported."""
    prefix: str = field(default_factory=lambda: sys.prefix)
    """The environment (venv) of that interpreter: ``python`` and ``python3`` in one venv
    are different paths to one install."""

    def describe(self) -> str:
        """``sandboxkit 0.1.0 (/path/python, /path/sandboxkit)``, for messages."""
        return f"sandboxkit {self.version or '?'} ({self.executable or '?'}, {self.install or '?'})"


def this_install() -> tuple[str, str, str]:
    """(version, interpreter, package directory) of the sandboxkit running here."""
    return __version__, sys.executable, str(Path(__file__).resolve().parent)


def same_install(state: DaemonState) -> bool:
    """True if the daemon in ``state`` is this very sandboxkit: same version, environment
    and package directory. A daemon from another venv or checkout may speak another
    protocol, so a client does not use it silently."""
    version, _executable, install = this_install()
    return (state.version, state.prefix, state.install) == (version, sys.prefix, install)


def install_state_path(path: Path) -> Path:
    """The state file beside ``path`` that belongs to this install only — where a client
    starts its own daemon when ``path`` is held by another install's."""
    version, _executable, install = this_install()
    key = hashlib.sha256(f"{version}\0{sys.prefix}\0{install}".encode()).hexdigest()[:12]
    return path.with_name(f"{path.stem}-{key}{path.suffix}")


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
            executable=str(data.get("executable", "")),
            install=str(data.get("install", "")),
            prefix=str(data.get("prefix", "")),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_state(path: Path, pid: int) -> None:
    """Remove the state file if it still belongs to daemon ``pid``."""
    state = read_state(path)
    if state is not None and state.pid == pid:
        with contextlib.suppress(OSError):
            path.unlink()
