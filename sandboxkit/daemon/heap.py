"""Giving freed memory back to the system after large releases (glibc's ``malloc_trim``).

CPython frees a released log's objects, but glibc's allocator keeps the pages it got for
them when live objects are interleaved with the freed ones: the daemon's RSS measured
878 MiB after its sandboxes were deleted, 38 MiB after one ``malloc_trim(0)``. The call
costs milliseconds and is only useful after a large release, so it is made then, at most
once per :data:`MIN_INTERVAL`, and only where the C library is glibc.

Consumers leaving are such a release too, spread over many small ones: each held its
sends and its connection's buffers, 400 of them 25 MiB that stayed after they left
(benchmarks/memory.py, ``--section consumers``). Their memory is freed only once their
connections close, a moment after their streams end: :func:`released_soon`.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import platform
import time
from collections.abc import Callable

__all__ = ["COLLECT_INTERVAL", "MIN_INTERVAL", "SETTLE", "THRESHOLD", "released", "released_soon"]

THRESHOLD = 1 << 20
"""Releases smaller than this (bytes) are left to the allocator."""

MIN_INTERVAL = 1.0
"""Seconds between two trims, however many releases come in between."""


SETTLE = 0.5
"""Seconds a trim waits after :func:`released_soon`, for the memory to be freed."""

COLLECT_INTERVAL = 30.0
"""Seconds between two full garbage collections before a trim. A full collection stops
the daemon's loop for as long as it takes to walk every object (tens to hundreds of ms in
a large process): consumers that come and go every second must not pay it every second."""


def _find_trim() -> Callable[[int], int] | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_trim = _find_trim()
_last = -MIN_INTERVAL
_owed = 0
_later: asyncio.TimerHandle | None = None
_later_loop: asyncio.AbstractEventLoop | None = None
_collect = False  # a full garbage collection first (see released_soon)
_collected = -COLLECT_INTERVAL


def released(size: int) -> bool:
    """Note that ``size`` bytes were just freed; trim the heap if that (with what was
    freed since the last trim) is worth it. Returns whether it trimmed now.

    Within :data:`MIN_INTERVAL` of the last trim, the trim is put off to the end of the
    interval (on the running event loop, if any), so the last of a burst of releases is
    given back too."""
    global _last, _owed, _later, _collect, _collected
    _owed += size
    if _trim is None or _owed < THRESHOLD:
        return False
    wait = _last + MIN_INTERVAL - time.monotonic()
    if wait <= 0:
        if _later is not None:
            _later.cancel()
            _later = None
        _last, _owed = time.monotonic(), 0
        if _collect and _last - _collected >= COLLECT_INTERVAL:
            _collect = False
            _collected = _last
            gc.collect()
        _trim(0)
        return True
    _trim_later(wait)
    return False


def released_soon(size: int) -> None:
    """Note that ``size`` bytes are about to be freed (within :data:`SETTLE`); if that,
    with what was freed since the last trim, is worth it, trim the heap then — and not
    within :data:`MIN_INTERVAL` of the last trim.

    What is released this way is often held in reference cycles (a connection, its
    protocol and its transport refer to each other), which only a full collection frees,
    and those objects lived long enough to reach the oldest generation, collected
    rarely: the trim then collects first."""
    global _owed, _collect
    _owed += size
    _collect = True
    if _trim is not None and _owed >= THRESHOLD:
        _trim_later(max(SETTLE, _last + MIN_INTERVAL - time.monotonic()))


def _trim_later(wait: float) -> None:
    """A trim ``wait`` seconds from now on the running loop, unless one is due there."""
    global _later, _later_loop
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no running loop: the next release trims
        return
    if _later is not None and _later_loop is loop and not _later.cancelled():
        return
    _later, _later_loop = loop.call_later(wait, _deferred), loop


def _deferred() -> None:
    global _later
    _later = None
    released(0)
