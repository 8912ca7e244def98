"""Ghost consumers must cost healthy consumers nothing.

A daemon (its own process) streams one fast child's output to 2 healthy consumers while
0, 1, 10 and 100 ghosts — real sockets with a small receive buffer that attached and
never read — stay attached (the run is shorter than the stall timeout, so nobody is
kicked). Reported per ghost count: the healthy consumers' aggregate throughput as a ratio
to the 0-ghost run of this same script (target >= 0.95), their largest pause between two
reads (target <= 50 ms), and the daemon's resident memory with the ghosts attached.

    python3 benchmarks/ghosts.py [--mb 32] [--ghosts 0 1 10 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

WRITER = (
    "import sys\n"
    "sys.stdin.readline()\n"
    "block = b'y' * 65536\n"
    "out = sys.stdout.buffer\n"
    "for _ in range({blocks}):\n"
    "    out.write(block)\n"
    "out.flush()\n"
)


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
        script = WRITER.format(blocks=mb * 16)
        argv = [sys.executable, "-c", script]
        pid = (await http.post(f"/sandboxes/{sbx}/processes", json={"argv": argv})).json()["pid"]
        path = f"/sandboxes/{sbx}/processes/{pid}/stream?cursor=0"
        socks = [_ghost(port, path, token) for _ in range(ghosts)]
        try:
            deadline = time.monotonic() + 10
            while True:
                attached = (await http.get(f"/sandboxes/{sbx}/consumers")).json()
                if len(attached) >= ghosts or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            events = [asyncio.Event() for _ in range(2)]
            readers = [asyncio.ensure_future(_healthy(port, path, token, e)) for e in events]
            await asyncio.gather(*(e.wait() for e in events))
            start = time.perf_counter()
            go = {"session": "go", "seq": 0, "data": "Cg=="}
            await http.post(f"/sandboxes/{sbx}/processes/{pid}/stdin", json=go)
            results = await asyncio.gather(*readers)
            elapsed = time.perf_counter() - start
            rss = psutil.Process(daemon_pid).memory_info().rss
            kicked = sum(
                1
                for c in (await http.get(f"/sandboxes/{sbx}/consumers")).json()
                if c["state"] == "kicked"
            )
        finally:
            for s in socks:
                s.close()
        await http.delete(f"/sandboxes/{sbx}")
    return {
        "throughput": sum(t for t, _ in results) / elapsed,
        "max_pause": max(w for _, w in results),
        "rss": rss,
        "kicked": kicked,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--ghosts", type=int, nargs="+", default=[0, 1, 10, 100])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp()) / "daemon.json"
    daemon = subprocess.Popen(
        [
            sys.executable, "-m", "sandboxkit", "serve", "--state-file", str(state),
            "--retention-bytes", str(args.mb * 2 * 1024 * 1024), "--result-ttl", "1",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not state.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        info = json.loads(state.read_text())
        rows = []
        for n in args.ghosts:
            runs = [
                asyncio.run(run(info["url"], info["token"], daemon.pid, args.mb, n))
                for _ in range(args.repeat)
            ]
            best = max(runs, key=lambda r: r["throughput"])
            rows.append((n, best, max(r["max_pause"] for r in runs)))
        base = rows[0][1]["throughput"]
        print(f"{'ghosts':>6} {'MB/s':>8} {'ratio':>6} {'max pause ms':>13} {'daemon RSS MB':>14} kicked")
        for n, best, pause in rows:
            print(
                f"{n:>6} {best['throughput'] / 1e6:>8.1f} {best['throughput'] / base:>6.2f} "
                f"{pause * 1000:>13.1f} {best['rss'] / 1e6:>14.1f} {best['kicked']:>6}"
            )
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()


if __name__ == "__main__":
    main()
