"""Blocking work off the event loop, also while the interpreter exits.

An in-process daemon (``DaemonServer.start``) left running is stopped by an ``atexit``
hook, which runs after ``concurrent.futures`` has stopped taking work: from then on every
``asyncio.to_thread`` and executor ``submit`` raises ``RuntimeError`` before anything ran.
The daemon's close still has to end its sandboxes and remove their directories and
cgroups (it printed a traceback halfway and left its root to the next daemon), so there
the work runs on the loop itself: at exit the loop has nothing else left to serve. The
daemon runs its blocking work through here, not ``asyncio.to_thread``."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import ParamSpec, TypeVar

__all__ = ["off_loop", "on_executor"]

P = ParamSpec("P")
T = TypeVar("T")


async def off_loop(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` in the loop's default executor (``asyncio.to_thread``'s)."""
    return await on_executor(None, functools.partial(fn, *args, **kwargs))


async def on_executor(executor: Executor | None, call: Callable[[], T]) -> T:
    """``call()`` on ``executor`` (None: the loop's default), or on the loop if no thread
    takes work any more."""
    loop = asyncio.get_running_loop()
    try:
        future = loop.run_in_executor(executor, call)
    except RuntimeError:  # the interpreter is exiting: no executor takes work
        return call()
    return await future
