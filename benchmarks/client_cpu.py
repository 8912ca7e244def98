"""Client CPU-seconds per GB: the SDK consumer beside a bare httpx ``aiter_raw`` consumer
reading the same stream, in the same run (issue 11, P7; goal: SDK ≤ 1.2 × httpx).

One child writes ``--mb`` MB in 64 KiB chunks and exits; the daemon (its own process,
retention large enough to keep it all) replays it from cursor 0 to each consumer in
turn, so every consumer gets exactly the same bytes and frames. CPU is this process's
(``time.process_time``: the consumer, since the daemon runs elsewhere), per GB
received; medians of ``--repeat`` runs, ratios against httpx.

    python3 benchmarks/client_cpu.py [--mb 256] [--repeat 3]

``--consumers N`` measures N SDK consumers in this one process instead (issue 22: a
notebook holds several handles), live from one child, beside N Redis pub/sub subscribers
in this process fed the same child's writes (``compare.py``'s reference): aggregate GB/s
and this process's CPU-s per GB for each, in interleaved rounds (the first a warm-up).

    python3 benchmarks/client_cpu.py --consumers 16 [--mb 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
from _daemon import local_daemon
from compare import redis_fanout, redis_server, sdk_fanout

from sandboxkit import AsyncSandbox
from sandboxkit.statefile import DaemonState

WRITER = """
import sys
chunk = (b"0123456789abcdef" * 4096)
for _ in range({n}):
    sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()
"""


async def cpu_per_gb(consume: Callable[[], Awaitable[int]]) -> tuple[float, float]:
    """CPU-seconds and page faults per GB that ``consume`` (returning the bytes it got)
    spends: a fault is new memory touched (the kernel zeroes each page)."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.process_time()
    received = await consume()
    cpu = time.process_time() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return cpu / (received / 1e9), faults / (received / 1e9)


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
            # compare.py's P7 handle: what keeping the newest 8 MiB adds to the row above
            "SDK, text chunks, keeps 8 MiB": sdk(on_stdout=count, lines=False),
            "SDK, on_stdout (lines)": sdk(on_stdout=count, keep_output=False),
            "SDK, default (keeps 8 MiB tail)": sdk(),
        }
        results: dict[str, list[float]] = {name: [] for name in consumers}
        faults: dict[str, list[float]] = {name: [] for name in consumers}
        for _ in range(repeat):
            for name, consume in consumers.items():
                cpu, touched = await cpu_per_gb(consume)
                results[name].append(cpu)
                faults[name].append(touched)
    base = statistics.median(results["httpx aiter_raw (bare)"])
    print(
        f"{mb} MB per read, {repeat} runs; client CPU-s per GB (median [range]), ÷ httpx;"
        " page faults per GB (median)"
    )
    for name, values in results.items():
        low, mid, high = min(values), statistics.median(values), max(values)
        touched = statistics.median(faults[name])
        print(f"  {name:<34} {mid:6.3f} [{low:.3f}–{high:.3f}]  {mid / base:5.2f}x  {touched:7.0f}")


def many(state: DaemonState, mb: int, consumers: int, repeat: int) -> None:
    """``consumers`` SDK consumers in this process beside as many Redis subscribers."""
    size = mb * 1024 * 1024
    with redis_server() as found:
        systems: dict[str, Callable[[], Awaitable[tuple[int, float]]]] = {
            "SDK, on_stdout (text chunks)": lambda: sdk_fanout(
                state.url, state.token, size, consumers
            ),
        }
        if found is not None:
            systems["Redis pub/sub subscribers"] = lambda: redis_fanout(found[1], size, consumers)
        rates: dict[str, list[float]] = {name: [] for name in systems}
        cpu: dict[str, list[float]] = {name: [] for name in systems}
        for round_ in range(repeat + 1):
            for name, work in systems.items():
                start = time.process_time()
                nbytes, elapsed = asyncio.run(work())
                if round_:  # the first round warms up
                    cpu[name].append((time.process_time() - start) / (nbytes / 1e9))
                    rates[name].append(nbytes / elapsed / 1e9)
    print(f"{consumers} consumers in one process, {mb} MB each, {repeat} runs (median [range])")
    redis = statistics.median(rates["Redis pub/sub subscribers"]) if found else None
    for name in systems:
        mid, mid_cpu = statistics.median(rates[name]), statistics.median(cpu[name])
        ratio = f"{mid / redis:5.2f}x Redis" if redis else "(no redis-server)"
        print(
            f"  {name:<30} {mid:5.2f} GB/s [{min(rates[name]):.2f}–{max(rates[name]):.2f}]"
            f" {ratio}; this process {mid_cpu:.3f} CPU-s/GB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=None, help="MB per consumer")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--consumers", type=int, default=None)
    args = parser.parse_args()
    if args.consumers is not None:
        mb = args.mb or 32
        retention = str((mb + 16) * 1024 * 1024)
        with local_daemon("--retention-bytes", retention) as (_, state):
            many(state, mb, args.consumers, args.repeat)
        return
    args.mb = args.mb or 256
    retention = str((args.mb + 16) * 1024 * 1024)
    with local_daemon("--retention-bytes", retention) as (_, state):
        asyncio.run(measure(state, args.mb, args.repeat))


if __name__ == "__main__":
    main()
