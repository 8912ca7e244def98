"""Fan-out throughput: one child process to 1, 4 and 16 consumers through the daemon,
beside a bare uvicorn streaming baseline run in the same script.

The daemon and the baseline each run as their own process (as in real use); the consumers
are raw asyncio HTTP/1.1 readers in this process, identical for both, counting bytes.
Aggregate throughput = bytes delivered to all consumers / wall time. Printed as ratios
daemon / baseline; the target is >= 0.5 at 16 consumers.

    python3 benchmarks/fanout.py [--mb 16] [--consumers 1 4 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import httpx
from _daemon import local_daemon, stop

CHUNK = 64 * 1024

# The baseline: the least machinery that streams one child's output to N clients over
# uvicorn. The first request of a round names N; once N clients are connected the app runs
# the same writer and copies each read into every client's (unbounded) queue.
BARE_APP = """
import asyncio, sys, uvicorn
ROUND = {"queues": []}
SCRIPT = sys.argv[2]

async def pump(queues, proc):
    proc.stdin.write(b"\\n")
    while True:
        data = await proc.stdout.read(262144)
        for q in queues:
            q.put_nowait(data)
        if not data:
            break
    await proc.wait()

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    n = int(scope["query_string"].decode().split("=")[1])
    queue = asyncio.Queue()
    ROUND["queues"].append(queue)
    if len(ROUND["queues"]) == 1:
        ROUND["proc"] = asyncio.ensure_future(asyncio.create_subprocess_exec(
            sys.executable, "-c", SCRIPT, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/octet-stream")]})
    await send({"type": "http.response.body", "body": b"S", "more_body": True})
    if len(ROUND["queues"]) == n:
        queues, ROUND["queues"] = ROUND["queues"], []
        ROUND["task"] = asyncio.ensure_future(pump(queues, await ROUND["proc"]))
    while True:
        data = await queue.get()
        if not data:
            break
        await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            loop="asyncio", access_log=False)
"""

WRITER = (
    "import sys\n"
    "sys.stdin.readline()\n"
    "block = b'y' * 65536\n"
    "out = sys.stdout.buffer\n"
    "for _ in range({blocks}):\n"
    "    out.write(block)\n"
    "out.flush()\n"
)


async def _read_all(port: int, path: str, token: str | None, started: asyncio.Event) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode())
    await writer.drain()
    total = 0
    first = True
    while True:
        data = await reader.read(1 << 20)
        if not data:
            break
        if first:
            started.set()
            first = False
        total += len(data)
    writer.close()
    return total


async def _wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def bare_run(port: int, consumers: int) -> float:
    # Timed from the moment the last client is connected, as for the daemon.
    events = [asyncio.Event() for _ in range(consumers)]
    readers = [asyncio.ensure_future(_read_all(port, f"/?n={consumers}", None, e)) for e in events]
    await asyncio.gather(*(e.wait() for e in events))
    start = time.perf_counter()
    totals = await asyncio.gather(*readers)
    elapsed = time.perf_counter() - start
    return sum(totals) / elapsed


async def daemon_run(url: str, token: str, mb: int, consumers: int) -> float:
    port = int(url.rsplit(":", 1)[1])
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        sbx = (await http.post("/sandboxes", json={})).json()["sandbox_id"]
        script = WRITER.format(blocks=mb * 1024 * 1024 // CHUNK)
        proc = (
            await http.post(
                f"/sandboxes/{sbx}/processes", json={"argv": [sys.executable, "-c", script]}
            )
        ).json()
        pid = proc["pid"]
        path = f"/sandboxes/{sbx}/processes/{pid}/stream?cursor=0"
        events = [asyncio.Event() for _ in range(consumers)]
        readers = [asyncio.ensure_future(_read_all(port, path, token, e)) for e in events]
        await asyncio.gather(*(e.wait() for e in events))  # all attached (start frames)
        start = time.perf_counter()
        go = {"session": "go", "seq": 0, "data": "Cg=="}
        await http.post(f"/sandboxes/{sbx}/processes/{pid}/stdin", json=go)
        totals = await asyncio.gather(*readers)
        elapsed = time.perf_counter() - start
        await http.delete(f"/sandboxes/{sbx}")
    return sum(totals) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=16)
    parser.add_argument("--consumers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    bare_port = _free_port()
    size = args.mb * 1024 * 1024
    script = WRITER.format(blocks=size // CHUNK)
    bare = subprocess.Popen([sys.executable, "-c", BARE_APP, str(bare_port), script])
    try:
        with local_daemon("--retention-bytes", str(size * 2)) as (_, info):
            asyncio.run(_wait_port(bare_port))
            rows = []
            for n in args.consumers:
                b = max(asyncio.run(bare_run(bare_port, n)) for _ in range(args.repeat))
                d = max(
                    asyncio.run(daemon_run(info.url, info.token, args.mb, n))
                    for _ in range(args.repeat)
                )
                rows.append((n, b, d))
    finally:
        stop(bare)
    print(f"{'consumers':>9} {'bare MB/s':>10} {'daemon MB/s':>12} {'ratio':>6}")
    for n, b, d in rows:
        print(f"{n:>9} {b / 1e6:>10.1f} {d / 1e6:>12.1f} {d / b:>6.2f}")
    ratio16 = {n: d / b for n, b, d in rows}.get(16)
    if ratio16 is not None:
        verdict = "meets" if ratio16 >= 0.5 else "MISSES"
        print(f"16 consumers: {ratio16:.2f}x the bare baseline ({verdict} the 0.5x target)")


if __name__ == "__main__":
    main()
