"""A process started and followed in one request: ``POST …/processes/stream`` answers
with the new process's output stream from its first chunk, its pid in the ``start``
frame, where a start and then an attach are two requests (and a second connection).
envd's ``Start`` streams alike. A foreground ``run`` then costs one round trip to the
daemon, not two (docs/performance.md, "Where a command's time goes").

The start is not idempotent: a stream cut off before its ``start`` frame arrived is an
error (the process may or may not run, as for a lost answer to a plain start); cut off
after, it is resumed like any other, with ``GET …/stream`` from the cursor reached.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from sandboxkit._compat import within
from sandboxkit.client.api import ApiClient
from sandboxkit.client.options import FollowOptions
from sandboxkit.client.stream import ProcessStream
from sandboxkit.errors import DaemonUnavailable, MalformedFrame
from sandboxkit.wire import Frame, FrameKind

__all__ = ["Opened", "start_stream"]

_START_TIMEOUT = 30.0
"""Seconds the daemon has to spawn the process and send its ``start`` frame (as a
plain start's request timeout)."""


@dataclass
class Opened:
    """A stream its start request opened, read as the stream's first attach: what closes
    it, and its batches (from the first, whose ``start`` frame was read for the pid)."""

    stack: contextlib.AsyncExitStack
    batches: AsyncGenerator[list[Frame], None]


async def start_stream(
    api: ApiClient, sandbox_id: str, spec: dict[str, Any], options: FollowOptions
) -> ProcessStream:
    """Start the process ``spec`` describes; its :class:`ProcessStream` from chunk 0, on
    the start request's own connection. Raises what a plain start raises."""
    path = f"/sandboxes/{sandbox_id}/processes/stream"
    async with contextlib.AsyncExitStack() as stack:
        frames = await stack.enter_async_context(api.stream(path, json=spec, role=options.role))
        # Borrowed, as every attach reads: the payloads are views until the next batch.
        batches = frames.batches(borrow=True)
        stack.push_async_callback(batches.aclose)  # before the connection goes back
        try:
            first = await within(batches.__anext__(), _START_TIMEOUT)
        except (StopAsyncIteration, TimeoutError):
            raise DaemonUnavailable(
                "the daemon did not say whether the process started (its stream ended "
                "before the start frame)",
                url=api.url,
            ) from None
        if not first or first[0].kind is not FrameKind.START or "pid" not in first[0].meta:
            raise MalformedFrame("a started process's stream did not begin with its start frame")
        pid = int(first[0].meta["pid"])
        again = _again(first, batches)
        stack.push_async_callback(again.aclose)
        opened = Opened(stack.pop_all(), again)
    return ProcessStream(api, sandbox_id, pid, 0, options, opened=opened)


async def _again(
    first: list[Frame], rest: AsyncGenerator[list[Frame], None]
) -> AsyncGenerator[list[Frame], None]:
    """``first``, then the batches of ``rest``."""
    yield first
    async for batch in rest:
        yield batch
