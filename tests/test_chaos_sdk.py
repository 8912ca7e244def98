"""Chaos replay through the SDK: a seeded random byte stream is followed by a chain of SDK
handles, each disconnected at a random moment and the next attached from its cursor, with
the stream's connection cut under a handle now and then (the SDK reattaches by itself) and
the sandbox paused and resumed in between. What the handles delivered, joined, is exactly
what the producer wrote: the same sha256, no byte lost or repeated; and text decoded across
all those reattaches has no U+FFFD where the producer wrote valid UTF-8.

The producer writes random bytes (non-UTF-8 included, and UTF-8 characters split at random
points) to stdout, consumed through the bytes API, and valid UTF-8 split at random points to
stderr, consumed as text. CI runs a small stream in a few seconds; for a long run set
``SANDBOXKIT_CHAOS_MB`` (MiB of stdout; stderr is a quarter of it), e.g.::

    SANDBOXKIT_CHAOS_MB=50 pytest tests/test_chaos_sdk.py -s
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from support import fast_config

from sandboxkit import AsyncSandbox
from sandboxkit.client.commands import AsyncCommandHandle
from sandboxkit.daemon.config import DaemonConfig

_LONG_MB = float(os.environ.get("SANDBOXKIT_CHAOS_MB", "0"))

# Run in the child and in the test alike: ``plan(seed, size)`` is the list of writes, each
# (fd, bytes), so the test knows exactly what the producer wrote.
PRODUCER = """
import random

TEXT = "aé€😀\\n\\t" + "ßж中🎉"


def plan(seed, size):
    rng = random.Random(seed)
    writes = []
    written = {1: 0, 2: 0}
    while written[1] < size or written[2] < size // 4:
        if written[1] < size and (written[2] >= size // 4 or rng.random() < 0.7):
            if rng.random() < 0.5:  # random bytes: mostly not UTF-8
                data = rng.randbytes(rng.randint(1, 4096))
            else:  # UTF-8 text, cut anywhere (a character may straddle two writes)
                data = "".join(rng.choices(TEXT, k=rng.randint(1, 1500))).encode()
                data = data[rng.randint(0, 3):]
            fd = 1
        else:  # valid UTF-8 only, written in pieces that split characters
            data = "".join(rng.choices(TEXT, k=rng.randint(1, 1200))).encode()
            fd = 2
        cut = rng.randint(0, len(data))
        for piece in (data[:cut], data[cut:]):
            if piece:
                writes.append((fd, piece))
                written[fd] += len(piece)
    return writes


def main(seed, size, pace):
    import os, time
    rng = random.Random(seed + 1)
    for fd, piece in plan(seed, size):
        os.write(fd, piece)
        if rng.random() < pace:
            time.sleep(0.002)  # sleep-ok: the producer's pace, so readers follow it live
"""


def _expected(seed: int, size: int) -> tuple[bytes, bytes, int]:
    """The producer's stdout and stderr, and how many writes it makes."""
    namespace: dict[str, Any] = {}
    exec(PRODUCER, namespace)
    writes = namespace["plan"](seed, size)
    return (
        b"".join(data for fd, data in writes if fd == 1),
        b"".join(data for fd, data in writes if fd == 2),
        len(writes),
    )


@pytest.fixture
def daemon_config() -> DaemonConfig:
    # Retention that holds a long run's whole output: a gap here would be a lost byte.
    return fast_config(retention_bytes=max(64, 2 * int(_LONG_MB)) * 1024 * 1024)


@dataclass
class Figures:
    handles: int = 0
    reattaches: int = 0
    internal_reattaches: int = 0
    cuts: int = 0
    pauses: int = 0
    gaps: int = 0
    bytes_lost: int = 0


def _cut(handle: AsyncCommandHandle) -> int:
    """Abort the handle's open stream connection under it, as a network failure would."""
    cut = 0
    for stream in list(handle.stream.api.streams):
        stream.abort()
        cut += 1
    return cut


async def _chaos(conn: dict[str, str], seed: int, size: int, seconds: float) -> None:
    rng = random.Random(seed)
    stdout, stderr, writes = _expected(seed, size)
    # A 2 ms pause after this fraction of writes: the producer runs about ``seconds``, so
    # readers attach while it writes, and after it ended (a replay from the daemon's log).
    pace = min(1.0, seconds / 0.0025 / writes)
    delivered: list[bytes] = []
    text: list[str] = []
    figures = Figures()
    script = f"{PRODUCER}\nmain({seed}, {size}, {pace})"
    async with await AsyncSandbox.create(**conn) as sbx:
        info = await sbx.commands.start([sys.executable, "-c", script])
        cursor: int | None = 0
        paused = False
        while True:
            handle = await sbx.commands.connect(
                info.pid,
                cursor,
                on_stderr=text.append,
                on_stdout_bytes=delivered.append,
                lines=False,
                keep_output=False,
            )
            figures.handles += 1
            # Wait on the handle for a random moment (an event with a timeout, not a
            # sleep): it may end, or be cut from under it, or be disconnected.
            finished = asyncio.ensure_future(handle.wait())
            done, _ = await asyncio.wait([finished], timeout=rng.expovariate(1 / 0.03))
            if not done and rng.random() < 0.3:
                figures.cuts += _cut(handle)
                done, _ = await asyncio.wait([finished], timeout=rng.expovariate(1 / 0.02))
            if done:
                await finished  # raises if the handle failed
                figures.internal_reattaches += max(0, handle.stream.stats.attaches - 1)
                figures.gaps += handle.stream.stats.gaps
                figures.bytes_lost += handle.stream.stats.bytes_lost
                break
            finished.cancel()
            cursor = await handle.disconnect()
            figures.internal_reattaches += max(0, handle.stream.stats.attaches - 1)
            figures.gaps += handle.stream.stats.gaps
            figures.bytes_lost += handle.stream.stats.bytes_lost
            figures.reattaches += 1
            if paused:
                await sbx.resume()
                paused = False
            elif rng.random() < 0.25:
                await sbx.pause()
                figures.pauses += 1
                # Half the time the next handle attaches to the paused sandbox (its
                # replay must not need a running producer), else it is resumed first.
                paused = rng.random() < 0.5
                if not paused:
                    await sbx.resume()

    got = b"".join(delivered)
    print(
        f"\nchaos seed={seed}: {len(got)} stdout bytes + {len(stderr)} stderr bytes, "
        f"{figures.reattaches} reattaches by disconnect, {figures.cuts} connection cuts, "
        f"{figures.internal_reattaches} SDK reattaches, {figures.pauses} pauses, "
        f"{figures.gaps} gaps, bytes lost {len(stdout) - len(got)}"
    )
    assert figures.gaps == 0 and figures.bytes_lost == 0
    assert len(got) == len(stdout)
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(stdout).hexdigest()
    decoded = "".join(text)
    assert "\ufffd" not in decoded
    assert decoded == stderr.decode()
    assert figures.reattaches >= 10 and figures.handles > figures.reattaches


@pytest.mark.timeout(120 if not _LONG_MB else 3600)
@pytest.mark.parametrize("seed", [11, pytest.param(29, marks=pytest.mark.slow)])
async def test_replay_through_sdk_reattaches_is_byte_exact(conn: dict[str, str], seed: int) -> None:
    size = int(_LONG_MB * 1024 * 1024) if _LONG_MB else 256 * 1024
    await _chaos(conn, seed, size, seconds=60.0 if _LONG_MB else 1.5)
