"""Following the daemon's event journal as it grows: what views subscribe to.

A view that shows lifecycle state (the dashboard) re-reads the daemon when an event says
something changed — whoever caused it: this kernel, another notebook, the CLI, the idle
timer — instead of waiting for its next periodic poll. Each read is a long poll
(``GET /events?since=N&wait=S``): the daemon answers as soon as event ``N`` is recorded,
or with nothing after ``S`` seconds, so an idle daemon costs one request per ``S``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from sandboxkit.client.api import ApiClient
from sandboxkit.errors import SandboxkitError

__all__ = ["LIFECYCLE_PREFIXES", "is_lifecycle", "watch_events"]

LIFECYCLE_PREFIXES = ("sandbox.", "process.")
"""Event kinds a view of sandboxes and processes follows (pause, resume, kill, start,
exit, restart...); consumer events change no lifecycle."""

_RETRY = 1.0


def is_lifecycle(event: dict[str, Any]) -> bool:
    """Whether ``event`` changes what a sandbox or process table shows."""
    return str(event.get("kind", "")).startswith(LIFECYCLE_PREFIXES)


async def watch_events(
    api: ApiClient,
    on_events: Callable[[list[dict[str, Any]]], Any],
    *,
    wait: float = 10.0,
) -> None:
    """Call ``on_events`` (sync or async) with each batch of new events of the daemon
    behind ``api``, from now on, as soon as they are recorded. Runs until cancelled; a
    failed read (the daemon restarting) is retried after a second."""
    since: int | None = None
    while True:
        try:
            if since is None:
                since = int((await api.call("GET", "/health"))["next_event"])
            events = await api.call("GET", "/events", since=since, wait=wait)
        except SandboxkitError:
            await asyncio.sleep(_RETRY)  # sleep-ok: the daemon is away; try again later
            continue
        if not events:
            continue
        since = int(events[-1]["seq"]) + 1
        result = on_events(events)
        if inspect.isawaitable(result):
            await result
