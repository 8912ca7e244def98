"""Client call latency: ``AsyncSandbox.create()``, create + first command, ``run(["true"])``
in a running sandbox, and ``pause()`` + ``resume()`` of a 4-process sandbox — p50 and p90
over many calls, beside the same daemon answering a bare ``GET /health`` from one kept-alive
httpx client (the floor any SDK call sits on), in the same run.

The daemon runs as its own process, found the way a notebook finds it (through its state
file: ``create()`` with no ``url``).

    python3 benchmarks/client_latency.py [--n 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from sandboxkit import AsyncSandbox
from sandboxkit.statefile import STATE_FILE_ENV, read_state


async def timed(n: int, step: Callable[[], Awaitable[Any]]) -> list[float]:
    """Milliseconds per call of ``step``, after two warm-up calls."""
    for _ in range(2):
        await step()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await step()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def row(name: str, samples: list[float], floor: float) -> str:
    p50 = statistics.median(samples)
    p90 = statistics.quantiles(samples, n=10)[-1]
    return f"{name:<34} {p50:8.2f} {p90:8.2f} {p50 / floor:8.1f}x"


async def measure(n: int, url: str, token: str) -> None:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:

        async def health() -> None:
            (await http.get(url + "/health")).raise_for_status()

        floor = await timed(n, health)

    made: list[AsyncSandbox] = []

    async def create() -> None:
        made.append(await AsyncSandbox.create())

    async def create_and_run() -> None:
        sbx = await AsyncSandbox.create()
        made.append(sbx)
        await sbx.commands.run(["true"])

    results = {"create()": await timed(n, create)}
    results["create() + run(true)"] = await timed(n, create_and_run)
    for sbx in made:  # not timed
        await sbx.kill()
    async with await AsyncSandbox.create() as sbx:
        results['run(["true"])'] = await timed(n, lambda: sbx.commands.run(["true"]))
        for _ in range(4):
            await sbx.commands.start(["sleep", "600"])

        async def pause_resume() -> None:
            await sbx.pause()
            await sbx.resume()

        results["pause() + resume(), 4 processes"] = await timed(n, pause_resume)

    base = statistics.median(floor)
    print(f"{'call (ms)':<34} {'p50':>8} {'p90':>8} {'÷ GET':>9}")
    print(row("GET /health (bare httpx)", floor, base))
    for name, samples in results.items():
        print(row(name, samples, base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="calls per figure")
    args = parser.parse_args()
    state_path = Path(tempfile.mkdtemp()) / "daemon.json"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while (state := read_state(state_path)) is None:
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise RuntimeError("the daemon did not start")
            time.sleep(0.05)  # sleep-ok: polling for the daemon's state file
        os.environ[STATE_FILE_ENV] = str(state_path)
        asyncio.run(measure(args.n, state.url, state.token or ""))
    finally:
        daemon.terminate()
        daemon.wait(15)


if __name__ == "__main__":
    main()
