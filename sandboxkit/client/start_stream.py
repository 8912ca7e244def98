"""A process started and followed in one request: ``POST …/processes/stream`` answers
with the new process's output stream from its first chunk, its pid in the ``start``
frame, where a start and then an attach are two requests (and a second connection).
envd's ``Start`` streams alike. A foreground ``run`` then costs one round trip to the
daemon, not two (docs/performance.md, "Where a command's time goes"). ``connect`` opens
its stream the same way, before a handle exists (:func:`follow_stream`): the daemon's
refusal of an unknown pid or a cursor past the head is its answer to that request, where
a look at the process and then an attach were two.

The start is not idempotent: a stream cut off before its ``start`` frame arrived is an
error (the process may or may not run, as for a lost answer to a plain start); cut off
after, it is resumed like any other, with ``GET …/stream`` from the cursor reached.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from sandboxkit._compat import within
from sandboxkit.client.api import ApiClient
from sandboxkit.client.options import FollowOptions
from sandboxkit.client.stream import ProcessStream
from sandboxkit.client.transport import raw_unary
from sandboxkit.errors import DaemonUnavailable, MalformedFrame
from sandboxkit.wire import Frame, FrameKind

__all__ = ["Opened", "follow_stream", "start_stream"]

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
    opened, start = await _open(api, path, "whether the process started", json=spec,
                                role=options.role)  # fmt: skip
    if "pid" not in start.meta:
        await opened.stack.aclose()
        raise MalformedFrame("a started process's stream did not begin with its start frame")
    return ProcessStream(api, sandbox_id, int(start.meta["pid"]), 0, options, opened=opened)


async def follow_stream(
    api: ApiClient, sandbox_id: str, pid: int, cursor: int | None, options: FollowOptions
) -> ProcessStream:
    """Process ``pid``'s :class:`ProcessStream` from ``cursor``, its stream opened here:
    an unknown or evicted pid, or a cursor past its head, raises the daemon's typed error
    now, before a handle exists. One request where asking about the pid and then
    attaching were two (a reattach's first byte, ``benchmarks/compare.py`` P4)."""
    path = f"/sandboxes/{sandbox_id}/processes/{pid}/stream"
    seq = None if cursor is None else int(cursor)
    opening = asyncio.ensure_future(
        _open(api, path, f"process {pid}'s output", cursor=seq, role=options.role)
    )
    try:
        # A daemon that does not answer is asked for its health, as a unary request's
        # is (raw_unary.PROBE_AFTER), so a hung one is told at once, not after the 10 s
        # a response head may take.
        await asyncio.wait({opening}, timeout=raw_unary.PROBE_AFTER)
        if not opening.done() and not await api.alive(raw_unary.PROBE_TIMEOUT):
            raise DaemonUnavailable(
                f"the daemon at {api.url} is hung: no answer to process {pid}'s stream "
                f"in {raw_unary.PROBE_AFTER:g}s, nor to /health in "
                f"{raw_unary.PROBE_TIMEOUT:g}s",
                url=api.url,
            )
        opened, _ = await opening
    except BaseException:
        if not opening.done():
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
        elif not opening.cancelled() and opening.exception() is None:
            await opening.result()[0].stack.aclose()  # opened just as this gave up
        raise
    return ProcessStream(api, sandbox_id, pid, cursor, options, opened=opened)


async def _open(
    api: ApiClient, path: str, what: str, json: Any = None, **params: Any
) -> tuple[Opened, Frame]:
    """The stream at ``path`` opened and its ``start`` frame read: the stream, to be read
    as its reader's first attach, and that frame."""
    async with contextlib.AsyncExitStack() as stack:
        frames = await stack.enter_async_context(api.stream(path, json=json, **params))
        # Borrowed, as every attach reads: the payloads are views until the next batch.
        batches = frames.batches(borrow=True)
        stack.push_async_callback(batches.aclose)  # before the connection goes back
        try:
            first = await within(batches.__anext__(), _START_TIMEOUT)
        except (StopAsyncIteration, TimeoutError):
            raise DaemonUnavailable(
                f"the daemon did not say {what} (its stream ended before the start frame)",
                url=api.url,
            ) from None
        if not first or first[0].kind is not FrameKind.START:
            raise MalformedFrame("a process's stream did not begin with its start frame")
        again = _again(first, batches)
        stack.push_async_callback(again.aclose)
        return Opened(stack.pop_all(), again), first[0]


async def _again(
    first: list[Frame], rest: AsyncGenerator[list[Frame], None]
) -> AsyncGenerator[list[Frame], None]:
    """``first``, then the batches of ``rest``."""
    yield first
    async for batch in rest:
        yield batch
