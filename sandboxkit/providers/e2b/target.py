"""Which E2B a sandbox is on — cloud or debug — and the constants every module of the
provider shares."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any

from sandboxkit.vocab import ENVD_PORT

__all__ = [
    "DEFAULT_ENVD_URL",
    "DEFAULT_LOG_BYTES",
    "USER",
    "DebugSandboxes",
    "Target",
    "signal_code",
]

DEFAULT_ENVD_URL = f"http://localhost:{ENVD_PORT}"
"""Where the SDK's debug mode finds envd unless told otherwise."""

DEFAULT_LOG_BYTES = 8 * 1024 * 1024
"""Output kept per process in this client (the replay window of a Reattach)."""

USER = "user"
"""The user commands run as: E2B's default."""

_SIGNALS = {"killed": signal.SIGKILL, "terminated": signal.SIGTERM}


def signal_code(exit_code: int | None, error: str | None) -> int | None:
    """envd reports a process ended by a signal as exit code -1 with ``signal: killed``
    in its error; sandboxkit's convention is the negative signal number (-9)."""
    if exit_code != -1 or not error or not error.startswith("signal: "):
        return exit_code
    name = error.removeprefix("signal: ").strip()
    sig = _SIGNALS.get(name)
    if sig is None:
        try:
            sig = signal.Signals["SIG" + name.upper()]
        except KeyError:
            return exit_code
    return -int(sig)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Target:
    """Cloud or debug, and the SDK options that say so."""

    debug: bool
    options: dict[str, Any]
    url: str | None

    @classmethod
    def resolve(cls, url: str | None, token: str | None, options: dict[str, Any]) -> Target:
        opts = dict(options)
        debug = opts.pop("debug", None)
        if debug is None:  # an envd URL, E2B_DEBUG, or no API key at all: debug mode
            debug = (
                bool(url)
                or _truthy(os.environ.get("E2B_DEBUG"))
                or not (token or opts.get("api_key") or os.environ.get("E2B_API_KEY"))
            )
        if debug:
            sandbox_url = url or opts.pop("sandbox_url", None) or DEFAULT_ENVD_URL
            opts.update(debug=True, sandbox_url=sandbox_url)
            return cls(True, opts, sandbox_url)
        if token:
            opts["api_key"] = token
        if url:
            opts["api_url"] = url
        return cls(False, opts, url)


class DebugSandboxes:
    """The debug-mode sandboxes made in this process: E2B's debug mode has no API to list
    or reconnect them, so this client remembers each one's envd URL and SDK options."""

    def __init__(self) -> None:
        self._ids = 0
        self._known: dict[str, tuple[str, dict[str, Any]]] = {}

    def add(self, target: Target) -> str:
        """A new local id for a sandbox made against ``target``."""
        self._ids += 1
        sandbox_id = f"e2b-debug-{self._ids}"
        self._known[sandbox_id] = (target.url or DEFAULT_ENVD_URL, dict(target.options))
        return sandbox_id

    def get(self, sandbox_id: str) -> Target | None:
        known = self._known.get(sandbox_id)
        if known is None:
            return None
        url, options = known
        return Target(True, dict(options), url)

    def forget(self, sandbox_id: str) -> None:
        self._known.pop(sandbox_id, None)

    def ids(self) -> list[str]:
        return list(self._known)


DEBUG_SANDBOXES = DebugSandboxes()
"""This process's debug sandboxes (one registry: a dashboard lists what a notebook made)."""
