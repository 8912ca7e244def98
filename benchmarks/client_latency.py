"""Client call latency: ``AsyncSandbox.create()``, create + first command, ``run(["true"])``
in a running sandbox, and ``pause()`` + ``resume()`` of a 4-process sandbox — p50 and p90
over many calls, beside the same daemon answering a bare ``GET /health`` from one kept-alive
httpx client (the floor any SDK call sits on), in the same run.

Then a child's line to the client (issue 11, P3): a child prints its clock every 3 ms; the
p50 of (arrival - clock) per line, medians of ``--runs`` runs, for the SDK (``on_stdout``
lines, and ``on_stdout_bytes``), for a bare socket reading the same daemon stream (no
client at all: the daemon's share), and for the reference — a bare uvicorn app streaming
the same child to httpx ``aiter_raw`` (``benchmarks/compare.py``'s), and to a bare socket.
SDK minus the daemon's bare socket is the client's cost; the daemon's bare socket minus
uvicorn's is the daemon's extra.

The daemon runs as its own process, found the way a notebook finds it (through its state
file: ``create()`` with no ``url``).

    python3 benchmarks/client_latency.py [--n 50] [--lines 300] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from _daemon import local_daemon
from _figures import BARE_REF, LINES
from compare import _free_port, running

from sandboxkit import AsyncSandbox

_CLOCK = re.compile(rb"(\d{9,}\.\d+)\n")
"""A line of the child's (its clock), found in the raw bytes of a response."""


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


# -- a child's line to the reader -------------------------------------------------------


def _lines_script(n: int) -> list[str]:
    return [sys.executable, "-c", LINES.replace("N_LINES", str(n))]


async def sdk_lines(url: str, token: str, n: int, as_bytes: bool) -> list[float]:
    """Seconds from each line's clock to its SDK callback."""
    lat: list[float] = []
    pending = b""

    def on_bytes(data: bytes) -> None:
        nonlocal pending
        now = time.time()
        *lines, pending = (pending + data).split(b"\n")
        lat.extend(now - float(line) for line in lines)

    def on_line(line: str) -> None:
        lat.append(time.time() - float(line))

    async with await AsyncSandbox.create(url=url, token=token) as sbx:
        options: dict[str, Any] = (
            {"on_stdout_bytes": on_bytes, "lines": False} if as_bytes else {"on_stdout": on_line}
        )
        handle = await sbx.commands.run(
            _lines_script(n), background=True, keep_output=False, **options
        )
        await handle.wait()
    return lat[5:]


async def socket_lines(port: int, target: str, headers: str = "") -> list[float]:
    """Seconds from each line's clock to a bare socket's read of it (no HTTP client)."""
    lat: list[float] = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: bench\r\n{headers}\r\n".encode())
    tail = b""
    while data := await reader.read(65536):
        now = time.time()
        joined = tail + data
        lat.extend(now - float(m.group(1)) for m in _CLOCK.finditer(joined))
        cut = joined.rfind(b"\n")
        tail = joined[cut + 1 :][-64:] if cut >= 0 else joined[-64:]
        if joined.endswith(b"0\r\n\r\n"):  # the end of the chunked body
            break
    writer.close()
    return lat[5:]


async def daemon_socket_lines(url: str, token: str, n: int) -> list[float]:
    async with await AsyncSandbox.create(url=url, token=token) as sbx:
        info = await sbx.commands.start(_lines_script(n))
        target = f"/sandboxes/{sbx.sandbox_id}/processes/{info.pid}/stream?cursor=0"
        port = int(url.rsplit(":", 1)[1])
        return await socket_lines(port, target, f"Authorization: Bearer {token}\r\n")


async def httpx_lines(port: int, n: int) -> list[float]:
    lat: list[float] = []
    async with (
        httpx.AsyncClient() as http,
        http.stream("GET", f"http://127.0.0.1:{port}/lines?n={n}") as response,
    ):
        pending = b""
        async for data in response.aiter_raw():
            now = time.time()
            *lines, pending = (pending + data).split(b"\n")
            lat.extend(now - float(line) for line in lines)
    return lat[5:]


def measure_lines(url: str, token: str, n: int, runs: int) -> None:
    port = _free_port()
    with running([sys.executable, "-c", BARE_REF, str(port), LINES], port):
        figures: dict[str, Callable[[], Awaitable[list[float]]]] = {
            "uvicorn -> httpx aiter_raw (reference)": lambda: httpx_lines(port, n),
            "uvicorn -> bare socket": lambda: socket_lines(port, f"/lines?n={n}"),
            "daemon -> bare socket (no client)": lambda: daemon_socket_lines(url, token, n),
            "SDK on_stdout_bytes": lambda: sdk_lines(url, token, n, as_bytes=True),
            "SDK on_stdout (lines)": lambda: sdk_lines(url, token, n, as_bytes=False),
        }
        p50s: dict[str, list[float]] = {name: [] for name in figures}
        for _ in range(runs):  # interleaved: the machine's noise falls on every figure
            for name, figure in figures.items():
                p50s[name].append(statistics.median(asyncio.run(figure())) * 1e6)
    base = statistics.median(p50s["uvicorn -> httpx aiter_raw (reference)"])
    print(f"\nchild line -> reader, p50 in µs (median [range] of {runs} runs of {n} lines)")
    for name, values in p50s.items():
        mid = statistics.median(values)
        print(f"  {name:<40} {mid:7.0f} [{min(values):.0f}-{max(values):.0f}]  {mid / base:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="calls per figure")
    parser.add_argument("--lines", type=int, default=300, help="lines per latency run")
    parser.add_argument("--runs", type=int, default=3, help="runs of each line figure")
    args = parser.parse_args()
    # Unisolated (local_daemon's default): the child runs this interpreter by its host
    # path, which a namespaced sandbox cannot reach.
    with local_daemon(found=True) as (_, state):
        asyncio.run(measure(args.n, state.url, state.token or ""))
        measure_lines(state.url, state.token or "", args.lines, args.runs)


if __name__ == "__main__":
    main()
