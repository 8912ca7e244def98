"""What a process's output costs the daemon's memory: the output log on disk (segment
files, a small cache of the newest frames) against the log kept in memory, in one run.

Sections:

* **daemon** — a daemon per run, in its own process (its RSS is what is measured: the
  anonymous part, the daemon's own memory; readers behind the cache read sealed segment
  files through mappings, whose resident pages are page cache the kernel may reclaim,
  counted in RSS as file pages and left out here). One
  process writes either 64 KiB blocks or 1-byte writes, while a raw-socket consumer
  reads its stream from cursor 0 as fast as it can (so 1-byte writes stay 1-byte chunks:
  the worst case for bookkeeping). Reported: the daemon's RSS growth per MB of output
  retained, the consumer's throughput, the replay of the retained output by a second
  consumer after the end, and the RSS after the sandbox is deleted — for ``disk``
  (``output_on_disk=True``, the default) and ``memory`` (the previous behaviour).
* **log** — the :class:`OutputLog` alone, no daemon: 1-byte chunks that a reader keeps up
  with (none can be joined) and 64 KiB chunks through the default 64 MiB retention:
  memory the log accounts for per MB retained, and append throughput.

The machine is shared and noisy: compare the ratios (disk / memory) of one run, not the
absolute figures. Everything runs on loopback; every process started here is stopped.

    python benchmarks/memory.py            # ~2 min
    python benchmarks/memory.py --quick    # smaller transfers, one repeat
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.output_log import OutputLog

MIB = 1 << 20

# A daemon in a process of its own, with the settings given as JSON in argv[1]; it prints
# its url and token and serves until its stdin closes.
DAEMON = """
import json, sys
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.server import DaemonServer
server = DaemonServer(DaemonConfig(**json.loads(sys.argv[1]))).start()
print(json.dumps({"url": server.url, "token": server.token}), flush=True)
sys.stdin.read()
server.stop()
"""

BLOCKS = (
    "import sys\n"
    "sys.stdin.readline()\n"
    "block = b'y' * 65536\n"
    "out = sys.stdout.buffer\n"
    "for _ in range({n}):\n"
    "    out.write(block)\n"
    "out.flush()\n"
)

BYTES = "import os, sys\nsys.stdin.readline()\nfor _ in range({n}):\n    os.write(1, b'x')\n"


@dataclass
class Run:
    rss_per_mb: float
    """Daemon RSS growth (MiB) per MiB of output retained at the end."""
    retained_mib: float
    chunks: int
    stream_mib_s: float
    cpu_ms_per_mib: float
    """Daemon CPU time (user + system) per MiB streamed to the live consumer."""
    replay_mib_s: float
    rss_growth_mib: float
    rss_after_delete_mib: float
    rss_after_expiry_mib: float
    rss_start_mib: float


class Daemon:
    def __init__(self, **settings: object) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", DAEMON, json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.process.stdout is not None
        info = json.loads(self.process.stdout.readline())
        self.url, self.token = info["url"], info["token"]
        self.port = int(self.url.rsplit(":", 1)[1])

    def cpu_seconds(self) -> float:
        times = psutil.Process(self.process.pid).cpu_times()
        return float(times.user + times.system)

    def rss_mib(self) -> float:
        """Anonymous resident memory (``RssAnon``): RSS less mapped file pages."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024 / MIB
        return psutil.Process(self.process.pid).memory_info().rss / MIB  # not Linux

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def _read_stream(port: int, path: str, token: str) -> tuple[int, float]:
    """Read a whole stream over a raw socket: (bytes, seconds from the first byte)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
    writer.write((request + "Connection: close\r\n\r\n").encode())
    await writer.drain()
    total, started = 0, 0.0
    while data := await reader.read(1 << 20):
        if not total:
            started = time.perf_counter()
        total += len(data)
    writer.close()
    return total, time.perf_counter() - started


async def _settled_rss(daemon: Daemon) -> float:
    # RSS after a release is read once it stops falling (the trim runs at once; the
    # kernel's accounting follows within a few tens of ms), with a deadline.
    deadline = time.monotonic() + 3
    last = daemon.rss_mib()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # sleep-ok: the measurement's pace
        now = daemon.rss_mib()
        if now >= last - 0.5:
            return now
        last = now
    return last


TTL = 2.0
"""The daemons' result TTL: a deleted sandbox's results go this long after DELETE."""


async def daemon_run(mode: str, pattern: str, mib: int, retention: int, **settings: object) -> Run:
    daemon = Daemon(
        output_on_disk=mode == "disk", result_ttl=TTL, retention_bytes=retention, **settings
    )
    try:
        headers = {"Authorization": f"Bearer {daemon.token}"}
        async with httpx.AsyncClient(base_url=daemon.url, headers=headers, timeout=60) as http:
            rss0 = daemon.rss_mib()
            sbx = (await http.post("/sandboxes", json={})).json()["sandbox_id"]
            script = BLOCKS.format(n=mib * 16) if pattern == "64KiB" else BYTES.format(n=mib * MIB)
            argv = [sys.executable, "-c", script]
            pid = (await http.post(f"/sandboxes/{sbx}/processes", json={"argv": argv})).json()[
                "pid"
            ]
            base = f"/sandboxes/{sbx}/processes/{pid}"
            reading = asyncio.ensure_future(
                _read_stream(daemon.port, f"{base}/stream?cursor=0", daemon.token)
            )
            go = {"session": "bench", "seq": 0, "data": base64.b64encode(b"go\n").decode()}
            cpu0 = daemon.cpu_seconds()
            (await http.post(f"{base}/stdin", json=go)).raise_for_status()
            streamed, seconds = await reading
            cpu = daemon.cpu_seconds() - cpu0
            info = (await http.get(base)).json()
            retained = (info["total_bytes"] - info["evicted_bytes"]) / MIB
            rss1 = daemon.rss_mib()
            replayed, replay_seconds = await _read_stream(
                daemon.port, f"{base}/stream?cursor={info['first_seq']}", daemon.token
            )
            await http.delete(f"/sandboxes/{sbx}")
            rss2 = await _settled_rss(daemon)
            deadline = time.monotonic() + TTL + 10
            while any(s["sandbox_id"] == sbx for s in (await http.get("/sandboxes")).json()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the deleted sandbox was not forgotten")
                await asyncio.sleep(0.1)  # sleep-ok: polling the daemon's housekeeping
            rss3 = await _settled_rss(daemon)
        return Run(
            rss_per_mb=(rss1 - rss0) / retained,
            retained_mib=retained,
            chunks=info["head"],
            stream_mib_s=streamed / MIB / seconds,
            cpu_ms_per_mib=cpu * 1000 / (streamed / MIB),
            replay_mib_s=replayed / MIB / replay_seconds,
            rss_growth_mib=rss1 - rss0,
            rss_after_delete_mib=rss2,
            rss_after_expiry_mib=rss3,
            rss_start_mib=rss0,
        )
    finally:
        daemon.stop()


def log_run(mode: str, pattern: str, count: int) -> tuple[float, float, float]:
    """(memory the log accounts for per MiB retained, MiB/s appended, MiB retained)."""
    config = DaemonConfig()
    with tempfile.TemporaryDirectory() as tmp:
        log = OutputLog(
            config.retention_bytes,
            charge_overhead=True,
            coalesce=4096,
            directory=Path(tmp) / "log" if mode == "disk" else None,
            cache_bytes=config.output_cache_bytes,
        )
        data = b"x" if pattern == "1B" else b"y" * 65536
        start = time.perf_counter()
        for _ in range(count):
            log.append("stdout", data)
            if pattern == "1B":
                log.read(log.head - 1, 1)  # a reader that keeps up: nothing can be joined
        seconds = time.perf_counter() - start
        retained = log.retained_bytes / MIB
        memory = log.memory_bytes / MIB
        log.close()
    return memory / retained, count * len(data) / MIB / seconds, retained


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _daemon_section(title: str, cases: list[tuple[str, int, int]], repeat: int) -> None:
    print(f"\n== daemon: {title} ==")
    results: dict[tuple[str, str], list[Run]] = {}
    for _ in range(repeat):
        for pattern, mib, retention in cases:
            for mode in ("disk", "memory"):
                run = asyncio.run(daemon_run(mode, pattern, mib, retention))
                results.setdefault((pattern, mode), []).append(run)
    print(
        f"{'writes':6} {'log':6} {'retained':>9} {'chunks':>7} {'RSS+':>8} {'RSS/MB':>7} "
        f"{'stream':>9} {'CPU/MiB':>8} {'replay':>9} {'RSS start':>9} {'after DEL':>9} "
        f"{'after TTL':>9}"
    )
    for (pattern, mode), runs in results.items():

        def med(name: str, runs: list[Run] = runs) -> float:
            return _median([getattr(r, name) for r in runs])

        print(
            f"{pattern:6} {mode:6} {med('retained_mib'):7.1f}Mi {int(med('chunks')):7d} "
            f"{med('rss_growth_mib'):6.1f}Mi {med('rss_per_mb'):7.3f} "
            f"{med('stream_mib_s'):5.0f}Mi/s {med('cpu_ms_per_mib'):6.2f}ms "
            f"{med('replay_mib_s'):5.0f}Mi/s "
            f"{med('rss_start_mib'):7.1f}Mi {med('rss_after_delete_mib'):7.1f}Mi "
            f"{med('rss_after_expiry_mib'):7.1f}Mi"
        )
    for pattern, _, _ in cases:
        disk, memory = results[(pattern, "disk")], results[(pattern, "memory")]
        ratios = []
        for name in ("rss_growth_mib", "stream_mib_s", "cpu_ms_per_mib", "replay_mib_s"):
            d = _median([getattr(r, name) for r in disk])
            m = _median([getattr(r, name) for r in memory])
            ratios.append(f"{name} {d / m if m else float('nan'):.2f}")
        print(f"   {pattern:6} disk / memory: " + ", ".join(ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller transfers, one repeat")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    default = DaemonConfig().retention_bytes
    big, small, huge = (128, 1, 256) if args.quick else (512, 2, 1024)

    _daemon_section(
        f"one process, one consumer from cursor 0, then DELETE; retention {default // MIB} "
        f"MiB (default); 64 KiB writes: {big} MiB, 1-byte writes: {small} MiB",
        [("64KiB", big, default), ("1B", small, default)],
        repeat,
    )
    _daemon_section(
        f"large retention: {huge} MiB of 64 KiB writes, all retained",
        [("64KiB", huge, huge * MIB)],
        1,
    )

    print("\n== log alone (no daemon): default retention and cache ==")
    for pattern, count, times in (
        ("1B", 300_000 if args.quick else 600_000, 1),
        ("64KiB", 2048, repeat),
    ):
        row = {}
        for mode in ("disk", "memory"):
            rates = [log_run(mode, pattern, count) for _ in range(times)]
            row[mode] = (
                _median([r[0] for r in rates]),
                _median([r[1] for r in rates]),
                _median([r[2] for r in rates]),
            )
            per_mb, rate, retained = row[mode]
            print(
                f"   {pattern:6} {mode:7} memory/MB retained {per_mb:8.3f}  "
                f"retained {retained:7.2f} MiB  append {rate:8.1f} MiB/s"
            )
        print(
            f"   {pattern:6} append throughput disk / memory = "
            f"{row['disk'][1] / row['memory'][1]:.2f}"
        )


if __name__ == "__main__":
    main()
