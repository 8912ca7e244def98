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
* **consumers** — many consumers of one process (issue 19): a daemon on the loop a plain
  install serves on (asyncio; ``--loop uvloop`` for the other), one process writing
  64 KiB blocks at 10 MB/s, then 400 raw-socket consumers attached at its head for 30 s,
  a quarter of them reading slowly (~1 MB/s, so they fall behind, onto the segment
  files and into gaps), the rest as fast as they can. Reported: the daemon's anonymous
  RSS above the idle daemon (the process writing, no consumer) at its peak and at the
  end, and 10 s after the consumers left; the targets are <= 100 MB and <= 20 MB. About
  60 s.

The machine is shared and noisy: compare the ratios (disk / memory) of one run, not the
absolute figures. Everything runs on loopback; every process started here is stopped.

    python benchmarks/memory.py            # ~3 min
    python benchmarks/memory.py --quick    # smaller transfers, one repeat
    python benchmarks/memory.py --section consumers [--consumers 400 --loop asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from _workloads import PRODUCER

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.isolation import ISOLATION_ENV
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
        # Its sandboxes unisolated unless told (as benchmarks/_daemon.py's): the workloads
        # run this interpreter by its host path, which a namespaced sandbox cannot reach.
        env = {**os.environ}
        env.setdefault(ISOLATION_ENV, "none")
        self.process = subprocess.Popen(
            [sys.executable, "-c", DAEMON, json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
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
            if info["exit_code"] != 0:
                raise RuntimeError(f"the writer failed: {info}")
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


async def _consume(port: int, path: str, token: str, slow: bool, received: list[int]) -> None:
    """One consumer on a raw socket, until cancelled: as fast as it can, or ``slow``
    (256 KiB every quarter of a second)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
        )
        while data := await reader.read(256 * 1024):
            received[0] += len(data)
            if slow:
                await asyncio.sleep(0.25)  # sleep-ok: a slow reader's pace
        received[1] += 1  # the daemon ended the stream (a kick)
    finally:
        writer.close()


@dataclass
class ConsumersRun:
    fresh: float
    idle: float
    peak: float
    end: float
    after: float
    received_mib: float
    ended: int
    """Consumers whose stream the daemon ended before they left (kicked)."""


async def consumers_run(count: int, seconds: float, rate: int, loop: str) -> ConsumersRun:
    """The daemon's anonymous RSS (MiB) with ``count`` consumers of one process writing
    ``rate`` bytes/s for ``seconds``, and 10 s after they left."""
    daemon = Daemon(event_loop=loop)
    try:
        headers = {"Authorization": f"Bearer {daemon.token}"}
        async with httpx.AsyncClient(base_url=daemon.url, headers=headers, timeout=60) as http:
            fresh = daemon.rss_mib()
            sbx = (await http.post("/sandboxes", json={})).json()["sandbox_id"]
            argv = [sys.executable, "-c", PRODUCER.format(rate=rate)]
            pid = (await http.post(f"/sandboxes/{sbx}/processes", json={"argv": argv})).json()[
                "pid"
            ]
            base = f"/sandboxes/{sbx}/processes/{pid}"
            await asyncio.sleep(3)  # sleep-ok: the idle daemon, its process's cache filled
            idle = daemon.rss_mib()
            info = (await http.get(base)).json()
            if info["state"] != "running":
                raise RuntimeError(f"the writer is not running: {info}")
            head = info["head"]
            received = [0, 0]
            path = f"{base}/stream?cursor={head}"
            readers = [
                asyncio.ensure_future(
                    _consume(daemon.port, path, daemon.token, i % 4 == 3, received)
                )
                for i in range(count)
            ]
            peak, started = idle, time.monotonic()
            while time.monotonic() - started < seconds:
                await asyncio.sleep(0.5)  # sleep-ok: the measurement's pace
                peak = max(peak, daemon.rss_mib())
            end = daemon.rss_mib()
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)
            await asyncio.sleep(10)  # sleep-ok: the target is 10 s after they left
            after = daemon.rss_mib()
            await http.delete(f"/sandboxes/{sbx}")
        return ConsumersRun(fresh, idle, peak, end, after, received[0] / MIB, received[1])
    finally:
        daemon.stop()


def _consumers_section(count: int, seconds: float, loop: str) -> None:
    rate = 10 * 1000 * 1000
    print(
        f"\n== consumers: {count} raw-socket consumers (a quarter slow) of one process "
        f"writing {rate / 1e6:.0f} MB/s, {seconds:.0f} s, daemon on {loop} =="
    )
    run = asyncio.run(consumers_run(count, seconds, rate, loop))
    mb = MIB / 1e6
    print(
        f"   RSS (anonymous): fresh {run.fresh:.1f} MiB, idle (process writing) "
        f"{run.idle:.1f} MiB; with consumers: peak +{(run.peak - run.idle) * mb:.1f} MB, "
        f"at the end +{(run.end - run.idle) * mb:.1f} MB (target <= 100 MB); 10 s after "
        f"they left +{(run.after - run.idle) * mb:.1f} MB (target <= 20 MB)"
    )
    print(
        f"   delivered {run.received_mib:.0f} MiB in all, "
        f"{run.received_mib / seconds:.0f} MiB/s; per consumer "
        f"{(run.peak - run.idle) * MIB / count / 1024:.0f} KiB at the peak; "
        f"{run.ended} streams ended by the daemon (kicks)"
    )


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
    parser.add_argument("--section", choices=["all", "daemon", "log", "consumers"], default="all")
    parser.add_argument("--consumers", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    if args.section in ("all", "consumers"):
        _consumers_section(args.consumers, args.seconds, args.loop)
    if args.section in ("all", "daemon"):
        _daemon_sections(args.quick, repeat)
    if args.section in ("all", "log"):
        _log_section(args.quick, repeat)


def _daemon_sections(quick: bool, repeat: int) -> None:
    default = DaemonConfig().retention_bytes
    big, small, huge = (128, 1, 256) if quick else (512, 2, 1024)
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


def _log_section(quick: bool, repeat: int) -> None:
    print("\n== log alone (no daemon): default retention and cache ==")
    for pattern, count, times in (
        ("1B", 300_000 if quick else 600_000, 1),
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
