"""The client's share of a unary request, A/B on one daemon: the SDK's JSON calls over its
own kept-alive sockets (``client/transport/raw_unary.py``) against the same calls through httpx
(the path before it, and still the path for TLS daemons and custom transports),
interleaved call by call so both see the same machine; p50s and their ratio. Also the
sync facade's hop onto its loop thread, against calling on the loop directly.

Figures: ``pause()`` + ``resume()`` of a 4-process sandbox; ``GET /health``; the client
CPU per request (process CPU time; the daemon runs in its own process). The floor: the
same requests from a bare blocking socket (hand-written bytes, no parsing beyond the
Content-Length) — the daemon's and the kernel's share, with next to no client.

    python3 benchmarks/client_unary.py [--n 400] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _daemon import local_daemon

from sandboxkit import AsyncSandbox, Sandbox
from sandboxkit.client.api import ApiClient
from sandboxkit.client.transport import RawTransport
from sandboxkit.client.transport.raw_unary import RawPool

Call = Callable[[], Awaitable[Any]]


async def ab(calls: dict[str, Call], n: int) -> dict[str, tuple[float, float]]:
    """Each call ``n`` times, interleaved; per call the p50 wall time and mean CPU time."""
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, float] = dict.fromkeys(calls, 0.0)
    for call in calls.values():  # warm: connections open, code paths hot
        for _ in range(20):
            await call()
    for _ in range(n):
        for name, call in calls.items():
            c0 = time.process_time()
            t0 = time.perf_counter()
            await call()
            wall[name].append(time.perf_counter() - t0)
            cpu[name] += time.process_time() - c0
    return {name: (statistics.median(wall[name]), cpu[name] / n) for name in calls}


def bare_socket(url: str, token: str) -> tuple[socket.socket, Callable[[str, str], None]]:
    """A blocking kept-alive socket and a function sending one request on it and reading
    the whole response (the floor: no event loop, no parser)."""
    pool = RawPool(url, {"Authorization": f"Bearer {token}"})
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def request(method: str, path: str) -> None:
        sock.sendall(pool.encode(method, path, "", None))
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        while len(body) < length:
            body += sock.recv(65536)

    return sock, request


async def unary(url: str, token: str, n: int) -> dict[str, tuple[float, float]]:
    raw = ApiClient(url, token)
    # A transport of its own: the httpx path, as for a TLS daemon.
    via_httpx = ApiClient(url, token, transport=httpx.AsyncHTTPTransport())
    assert isinstance(raw.transport, RawTransport)
    assert not isinstance(via_httpx.transport, RawTransport)
    async with await AsyncSandbox.create(url=url, token=token) as sbx:
        for _ in range(4):
            await sbx.commands.start(["sleep", "600"])
        path = f"/sandboxes/{sbx.sandbox_id}"

        def pause_resume(api: ApiClient) -> Call:
            async def call() -> None:
                await api.call("POST", path + "/pause")
                await api.call("POST", path + "/resume")

            return call

        def health(api: ApiClient) -> Call:
            return lambda: api.call("GET", "/health")

        sock, send = bare_socket(url, token)

        async def bare_pause_resume() -> None:
            send("POST", path + "/pause")
            send("POST", path + "/resume")

        async def bare_health() -> None:
            send("GET", "/health")

        try:
            return await ab(
                {
                    "pause + resume, raw sockets": pause_resume(raw),
                    "pause + resume, httpx": pause_resume(via_httpx),
                    "pause + resume, bare socket": bare_pause_resume,
                    "GET /health, raw sockets": health(raw),
                    "GET /health, httpx": health(via_httpx),
                    "GET /health, bare socket": bare_health,
                },
                n,
            )
        finally:
            sock.close()
            await raw.aclose()
            await via_httpx.aclose()


def sync_hop(url: str, token: str, n: int) -> dict[str, tuple[float, float]]:
    """The sync facade's cost per call: Sandbox.pause()+resume() (one loop-thread hop
    each) against the same two calls awaited on the loop itself."""
    with Sandbox.create(url=url, token=token) as sbx:
        for _ in range(4):
            sbx.commands.run(["sleep", "600"], background=True)
        loop = sbx._loop
        inner = sbx._async

        async def on_loop() -> None:
            await inner.pause()
            await inner.resume()

        def on_loop_timed(times: list[float], cpus: list[float]) -> Any:
            async def measure() -> None:
                for _ in range(20):
                    await on_loop()
                for _ in range(n):
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    await on_loop()
                    times.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)

            return measure()

        for _ in range(20):
            sbx.pause()
            sbx.resume()
        hop_wall, hop_cpu, direct_wall, direct_cpu = [], [], [], []
        for _ in range(n // 50):  # interleaved in blocks of 50
            for _ in range(50):
                c0 = time.process_time()
                t0 = time.perf_counter()
                sbx.pause()
                sbx.resume()
                hop_wall.append(time.perf_counter() - t0)
                hop_cpu.append(time.process_time() - c0)
            loop.run(on_loop_timed(direct_wall, direct_cpu))
        return {
            "sync pause + resume (2 hops)": (
                statistics.median(hop_wall),
                statistics.fmean(hop_cpu),
            ),
            "the same awaited on the loop": (
                statistics.median(direct_wall),
                statistics.fmean(direct_cpu),
            ),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=400, help="calls per figure per run (400)")
    parser.add_argument("--runs", type=int, default=3, help="runs; medians reported (3)")
    args = parser.parse_args()
    with local_daemon() as (_, state):
        runs = [asyncio.run(unary(state.url, state.token, args.n)) for _ in range(args.runs)]
        runs = [r | sync_hop(state.url, state.token, args.n) for r in runs]
    print(f"{'figure':34} {'p50 ms':>8} {'range':>15} {'client CPU ms':>14}")
    for name in runs[0]:
        walls = [r[name][0] * 1e3 for r in runs]
        cpus = [r[name][1] * 1e3 for r in runs]
        print(
            f"{name:34} {statistics.median(walls):8.3f} "
            f"{min(walls):7.3f}-{max(walls):<7.3f} {statistics.median(cpus):14.3f}"
        )
    for a, b in (("pause + resume, raw sockets", "pause + resume, httpx"),
                 ("pause + resume, raw sockets", "pause + resume, bare socket"),
                 ("GET /health, raw sockets", "GET /health, httpx"),
                 ("GET /health, raw sockets", "GET /health, bare socket"),
                 ("sync pause + resume (2 hops)", "the same awaited on the loop")):  # fmt: skip
        ratios = [r[a][0] / r[b][0] for r in runs]
        print(f"ratio {a} / {b}: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
