"""Client CPU-seconds per GB: the SDK consumer beside a bare httpx ``aiter_raw`` consumer
reading the same stream, in the same run (issue 11, P7; goal: SDK ≤ 1.2 × httpx).

One child writes ``--mb`` MB in 64 KiB chunks and exits; the daemon (its own process,
retention large enough to keep it all) replays it from cursor 0 to each consumer in
turn, so every consumer gets exactly the same bytes and frames. CPU is this process's
(``time.process_time``: the consumer, since the daemon runs elsewhere), per GB
received; medians of ``--repeat`` runs, ratios against httpx.

    python3 benchmarks/client_cpu.py [--mb 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
from _daemon import local_daemon

from sandboxkit import AsyncSandbox
from sandboxkit.statefile import DaemonState

WRITER = """
import sys
chunk = (b"0123456789abcdef" * 4096)
for _ in range({n}):
    sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()
"""


async def cpu_per_gb(consume: Callable[[], Awaitable[int]]) -> float:
    """CPU-seconds per GB that ``consume`` (returning the bytes it got) spends."""
    start = time.process_time()
    received = await consume()
    return (time.process_time() - start) / (received / 1e9)


async def measure(state: DaemonState, mb: int, repeat: int) -> None:
    async with await AsyncSandbox.create(url=state.url, token=state.token) as sbx:
        proc = await sbx.commands.run(
            [sys.executable, "-c", WRITER.format(n=mb * 16)], background=True, keep_output=False
        )
        await proc.wait()
        path = f"{state.url}/sandboxes/{sbx.sandbox_id}/processes/{proc.pid}/stream"
        headers = {"Authorization": f"Bearer {state.token}"}

        async def bare_httpx() -> int:
            received = 0
            async with (
                httpx.AsyncClient(headers=headers, timeout=None) as http,
                http.stream("GET", path, params={"cursor": 0}) as response,
            ):
                async for data in response.aiter_raw():
                    received += len(data)
            return received

        def sdk(**options: object) -> Callable[[], Awaitable[int]]:
            async def consume() -> int:
                handle = await sbx.commands.connect(proc.pid, 0, **options)  # type: ignore[arg-type]
                await handle.wait()
                return handle.stream.stats.bytes

            return consume

        def count(data: object) -> None:
            pass

        consumers: dict[str, Callable[[], Awaitable[int]]] = {
            "httpx aiter_raw (bare)": bare_httpx,
            "SDK, on_stdout_bytes": sdk(on_stdout_bytes=count, keep_output=False),
            "SDK, on_stdout (text chunks)": sdk(on_stdout=count, lines=False, keep_output=False),
            "SDK, on_stdout (lines)": sdk(on_stdout=count, keep_output=False),
            "SDK, default (keeps 8 MiB tail)": sdk(),
        }
        results: dict[str, list[float]] = {name: [] for name in consumers}
        for _ in range(repeat):
            for name, consume in consumers.items():
                results[name].append(await cpu_per_gb(consume))
    base = statistics.median(results["httpx aiter_raw (bare)"])
    print(f"{mb} MB per read, {repeat} runs; client CPU-s per GB (median [range]), ÷ httpx")
    for name, values in results.items():
        low, mid, high = min(values), statistics.median(values), max(values)
        print(f"  {name:<34} {mid:6.3f} [{low:.3f}–{high:.3f}]  {mid / base:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    retention = str((args.mb + 16) * 1024 * 1024)
    with local_daemon("--retention-bytes", retention) as (_, state):
        asyncio.run(measure(state, args.mb, args.repeat))


if __name__ == "__main__":
    main()
