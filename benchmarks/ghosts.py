"""Ghost consumers must cost healthy consumers nothing.

A daemon (its own process) streams one fast child's output to 2 healthy consumers while
0, 1, 10 and 100 ghosts — real sockets with a small receive buffer that attached and
never read — stay attached (the run is shorter than the stall timeout, so nobody is
kicked). The child first writes a prefill that every ghost takes until its socket buffers
are full and it blocks; then the healthy consumers attach at the head and the measured
output follows. Reported per ghost count: the healthy consumers' aggregate throughput as a
ratio to the 0-ghost run of this same script (target >= 0.95), their largest pause between
two reads (target <= 50 ms), and how much resident memory the daemon gained between
attaching the ghosts and all of them being blocked (the prefill itself included).

    python3 benchmarks/ghosts.py [--mb 32] [--ghosts 0 1 10 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from typing import Any

import httpx
import psutil
from _daemon import local_daemon

WRITER = (
    "import sys\n"
    "block = b'y' * 65536\n"
    "out = sys.stdout.buffer\n"
    "for blocks in ({prefill}, {blocks}):\n"
    "    sys.stdin.readline()\n"
    "    for _ in range(blocks):\n"
    "        out.write(block)\n"
    "    out.flush()\n"
)
PREFILL_MB = 4


def _ghost(port: int, path: str, token: str) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n"
    sock.sendall(request.encode())
    return sock  # never read


async def _healthy(port: int, path: str, token: str, started: asyncio.Event) -> tuple[int, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "Connection: close\r\n\r\n".encode()
    )
    await writer.drain()
    total, last, worst = 0, None, 0.0
    while True:
        data = await reader.read(1 << 20)
        now = time.perf_counter()
        if not data:
            break
        if last is None:
            started.set()
        elif started.is_set() and total > 4096:
            worst = max(worst, now - last)
        last = now
        total += len(data)
    writer.close()
    return total, worst


async def run(url: str, token: str, daemon_pid: int, mb: int, ghosts: int) -> dict[str, float]:
    port = int(url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as http:
        sbx = (await http.post("/sandboxes", json={})).json()["sandbox_id"]
        script = WRITER.format(prefill=PREFILL_MB * 16, blocks=mb * 16)
        argv = [sys.executable, "-c", script]
        pid = (await http.post(f"/sandboxes/{sbx}/processes", json={"argv": argv})).json()["pid"]
        base = f"/sandboxes/{sbx}/processes/{pid}"
        daemon = psutil.Process(daemon_pid)
        rss_before = daemon.memory_info().rss
        socks = [_ghost(port, base + "/stream?cursor=0", token) for _ in range(ghosts)]

        async def consumers() -> list[dict[str, object]]:
            return list((await http.get(f"/sandboxes/{sbx}/consumers")).json())

        async def go(seq: int) -> None:
            body = {"session": "go", "seq": seq, "data": "Cg=="}
            await http.post(base + "/stdin", json=body)

        try:
            await _until(lambda c: len(c) >= ghosts, consumers)
            await go(0)  # the prefill: every ghost fills its buffers and blocks
            await _until(lambda c: sum(x["state"] == "blocked" for x in c) >= ghosts, consumers)
            ghost_rss = daemon.memory_info().rss - rss_before
            head = (await http.get(base)).json()["head"]
            events = [asyncio.Event() for _ in range(2)]
            path = f"{base}/stream?cursor={head}"
            readers = [asyncio.ensure_future(_healthy(port, path, token, e)) for e in events]
            await asyncio.gather(*(e.wait() for e in events))
            start = time.perf_counter()
            await go(1)
            results = await asyncio.gather(*readers)
            elapsed = time.perf_counter() - start
            kicked = sum(1 for c in await consumers() if c["state"] == "kicked")
        finally:
            for s in socks:
                s.close()
        await http.delete(f"/sandboxes/{sbx}")
    return {
        "throughput": sum(t for t, _ in results) / elapsed,
        "max_pause": max(w for _, w in results),
        "ghost_rss": ghost_rss,
        "kicked": kicked,
    }


async def _until(predicate: Any, fetch: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(await fetch()):
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting for the ghosts")
        await asyncio.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--ghosts", type=int, nargs="+", default=[0, 1, 10, 100])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    retention = str(args.mb * 2 * 1024 * 1024)
    with local_daemon("--retention-bytes", retention, "--result-ttl", "1") as (daemon, info):
        rows = []
        for n in args.ghosts:
            runs = [
                asyncio.run(run(info.url, info.token, daemon.pid, args.mb, n))
                for _ in range(args.repeat)
            ]
            best = max(runs, key=lambda r: r["throughput"])
            rows.append((n, best, max(r["max_pause"] for r in runs)))
    base = rows[0][1]["throughput"]
    print(f"{'ghosts':>6} {'MB/s':>8} {'ratio':>6} {'max pause ms':>13} {'+RSS MB':>8} kicked")
    for n, best, pause in rows:
        print(
            f"{n:>6} {best['throughput'] / 1e6:>8.1f} {best['throughput'] / base:>6.2f} "
            f"{pause * 1000:>13.1f} {best['ghost_rss'] / 1e6:>8.1f} {best['kicked']:>6}"
        )


if __name__ == "__main__":
    main()
