"""The cost curve (issue 22): what each sandbox costs one daemon at 10, 100 and 1,000.

For each size N, a fresh daemon in its own process (``_daemon.local_daemon``; its
sandboxes run with isolation **off** unless ``--isolation namespaces``) gets N sandboxes,
each with one idle process (``sleep``) and one attached raw-socket consumer of that
process's stream (which sees only the keepalive frames). Measured, from outside the
daemon:

* **create rate** — N ``POST /sandboxes`` one after another on one connection (sandboxes
  per second); the rate of the N process starts (``POST …/processes``) beside it.
* **RSS and fds per sandbox** — the daemon's anonymous RSS (``RssAnon``: its own memory,
  not mapped file pages) and its open descriptors (``/proc/PID/fd``) with everything
  attached, less the fresh daemon's, divided by N.
* **settling** — how long the daemon keeps working after the N creates and starts: each
  sandbox's launcher is started once the daemon is quiet, one at a time
  (``daemon/launcher_slot.py``); measured until two half-second windows in a row use
  under :data:`SETTLED` % of a core. Everything below is measured after it.
* **idle CPU** — the daemon's CPU (% of one core, from its threads' ``schedstat``) over
  2 s with all N sandboxes idle (housekeeping and the consumers' keepalives), and what
  that adds to the fresh daemon's (measured the same way before the first sandbox) per
  1,000 sandboxes.
* **idle CPU beside N exited processes** — in the daemon of the fan-out alone, one
  sandbox runs N short commands (``true``), which it keeps for their result TTL (15
  minutes by default, as a notebook's loop of commands leaves them); the daemon's idle
  CPU then, over 2 s, settled (goal: flat; housekeeping visited each of them every 50 ms
  until it looked only at what can have expired).
* **``GET /sandboxes`` p50** — the whole answer read, on a kept-alive connection.
* **the events stream, per event** — ``GET /events`` as a follower of the journal reads
  it: the p50 of a page of the 100 newest events (fewer if the journal is shorter),
  divided by their number, and the p50 of a poll at the head (no new event: the fixed
  cost of each poll). The journal then holds every event of the N sandboxes' creation
  (its length is printed).
* **CPU per event** — the daemon's CPU per event while 100 events are recorded (an empty
  sandbox paused and resumed), alone and with one follower per sandbox: a long poll of
  ``/sandboxes/{id}/events`` (``wait=25``) that none of these events answers, as a view
  of each sandbox holds. The difference is what followers cost each event.
* **fan-out beside idle sandboxes** — one more sandbox's process writes 64 KiB blocks at
  10 MB/s; one raw-socket consumer reads it from the head for ``--seconds``; its rate
  with the N others idle, against the same producer and consumer in a daemon of its own
  with nothing else (measured just before, so a slow spell of the machine lands on both
  alike): the ratio, goal >= 0.9; and the daemon's CPU meanwhile.

Goals: flat per-sandbox cost, the list p50 <= 10 ms at 1,000, no figure growing faster
than linearly — printed as the growth exponent between the two largest sizes
(``log(f_big / f_small) / log(N_big / N_small)``: 1 is linear, 0 flat).

The machine is shared and noisy: compare shapes and ratios of one run. Everything runs
on loopback; every process started here is stopped.

    python benchmarks/scale.py                    # 10, 100, 1000 (~1.5 min on 2 cores)
    python benchmarks/scale.py --sizes 10 100     # quicker
    python benchmarks/scale.py --json             # one JSON object
    python benchmarks/scale.py --plot docs/scale.png
    python benchmarks/scale.py --isolation namespaces

With ``--isolation namespaces`` the producer is a shell loop (1 MiB every 0.1 s, a little
under 10 MB/s: the host's interpreter may be out of the namespace's reach), whose pace
varies more; the ratio compares it with itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from _daemon import local_daemon
from _workloads import PRODUCER

from sandboxkit.statefile import DaemonState

RATE = 10 * 1000 * 1000
"""The producer's pace, bytes per second."""


# In namespaces the host's interpreter may be out of reach: 1 MiB every 0.1 s from the
# shell (a little under 10 MB/s; the ratio compares it with itself).
SHELL_PRODUCER = ["sh", "-c", "while :; do head -c 1048576 /dev/zero; sleep 0.1; done"]

IDLE = ["sleep", "3600"]

SETTLED = 10.0
"""% of a core under which the daemon counts as settled after a burst (idle at 1,000
sandboxes: 3-5 %; starting their launchers: 20-35 %)."""


@dataclass
class Size:
    sandboxes: int
    create_per_s: float
    start_per_s: float
    rss_kib_per_sandbox: float
    fds_per_sandbox: float
    idle_cpu_pct: float
    fresh_cpu_pct: float
    """The fresh daemon's, before the first sandbox."""
    idle_cpu_per_1000: float
    """(idle - fresh) per 1,000 sandboxes, % of a core."""
    settle_s: float
    """Seconds the daemon worked on after the creates and starts (their launchers)."""
    exited_cpu_pct: float
    """Idle CPU of a daemon whose one sandbox keeps N exited processes, % of a core."""
    list_p50_ms: float
    list_bytes: int
    journal_events: int
    event_us: float
    """``GET /events`` cost per event (a page of 100, p50 / 100), microseconds."""
    poll_p50_ms: float
    event_cpu_us: float
    """Daemon CPU per event recorded, no follower (µs)."""
    followed_event_cpu_us: float
    """The same with one long-poll follower per sandbox, each of its own sandbox."""
    follower_cost_us: float
    """(followed - quiet) / N: what each follower adds to every event (µs)."""
    fanout_mb_s: float
    fanout_alone_mb_s: float
    fanout_ratio: float
    fanout_cpu_pct: float
    fanout_alone_cpu_pct: float


class Daemon:
    """What is read of the daemon's process from outside."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)

    def rss_kib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return float(line.split()[1])
        return self.proc.memory_info().rss / 1024  # not Linux

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def cpu(self) -> float:
        """CPU seconds of its threads (``schedstat``: nanoseconds, where ``cpu_times``
        counts clock ticks of 10 ms)."""
        total = 0
        try:
            for task in os.listdir(f"/proc/{self.proc.pid}/task"):
                path = f"/proc/{self.proc.pid}/task/{task}/schedstat"
                with contextlib.suppress(OSError), open(path) as f:  # OSError: it ended
                    total += int(f.read().split()[0])
        except OSError:  # no schedstat here
            times = self.proc.cpu_times()
            return float(times.user + times.system)
        return total / 1e9


class Consumer:
    """A raw-socket reader of one stream, counting the bytes after its response head."""

    def __init__(self) -> None:
        self.received = 0
        self.attached = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self, state: DaemonState, path: str) -> None:
        self.task = asyncio.ensure_future(self._run(state, path))

    async def _run(self, state: DaemonState, path: str) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(state))
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {state.token}\r\n"
                "\r\n".encode()
            )
            await reader.readuntil(b"\r\n\r\n")
            self.attached.set()
            while data := await reader.read(1 << 20):
                self.received += len(data)
        finally:
            writer.close()

    async def wait_attached(self, timeout: float = 60) -> None:
        """Until the response head came; the reader's own error if it failed first."""
        assert self.task is not None
        attached = asyncio.ensure_future(self.attached.wait())
        await asyncio.wait([attached, self.task], timeout=timeout, return_when="FIRST_COMPLETED")
        attached.cancel()
        if self.task.done():
            self.task.result()
        if not self.attached.is_set():
            raise TimeoutError("a consumer did not attach")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def _port(state: DaemonState) -> int:
    return int(state.url.rsplit(":", 1)[1])


def _client(state: DaemonState) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=state.url,
        headers={"Authorization": f"Bearer {state.token}"},
        timeout=60,
        limits=httpx.Limits(max_connections=4, max_keepalive_connections=4),
    )


async def _p50(http: httpx.AsyncClient, path: str, times: int) -> tuple[float, bytes]:
    """p50 seconds of ``GET path`` (the whole body read, not parsed), and the body."""
    samples, body = [], b""
    for _ in range(times):
        start = time.perf_counter()
        response = await http.get(path)
        body = response.content
        samples.append(time.perf_counter() - start)
        response.raise_for_status()
    return statistics.median(samples), body


async def _create(http: httpx.AsyncClient, isolation: str) -> str:
    response = await http.post("/sandboxes", json={"isolation": isolation})
    response.raise_for_status()
    answer = response.json()
    if answer["isolation"] != isolation:  # what holds, not what was asked
        raise SystemExit(f"asked isolation {isolation}, got {answer['isolation']}")
    return str(answer["sandbox_id"])


async def _start(http: httpx.AsyncClient, sid: str, argv: list[str]) -> int:
    response = await http.post(f"/sandboxes/{sid}/processes", json={"argv": argv})
    response.raise_for_status()
    return int(response.json()["pid"])


async def fanout(
    state: DaemonState, daemon: Daemon, http: httpx.AsyncClient, isolation: str, seconds: float
) -> tuple[float, float]:
    """One producer at :data:`RATE`, one consumer from its head: (MB/s, daemon CPU %)."""
    sid = await _create(http, isolation)
    producer = [sys.executable, "-c", PRODUCER.format(rate=RATE)]
    pid = await _start(http, sid, producer if isolation == "none" else SHELL_PRODUCER)
    base = f"/sandboxes/{sid}/processes/{pid}"
    head = (await http.get(base)).json()["head"]
    consumer = Consumer()
    consumer.start(state, f"{base}/stream?cursor={head}&role=bench")
    try:
        await consumer.wait_attached()
        await asyncio.sleep(1.0)  # sleep-ok: past the producer's start-up
        received, cpu, start = consumer.received, daemon.cpu(), time.perf_counter()
        await asyncio.sleep(seconds)  # sleep-ok: the measurement's window
        elapsed = time.perf_counter() - start
        rate = (consumer.received - received) / elapsed / 1e6
        return rate, (daemon.cpu() - cpu) / elapsed * 100
    finally:
        await consumer.stop()
        await http.delete(f"/sandboxes/{sid}")


async def alone(
    state: DaemonState, pid: int, isolation: str, seconds: float
) -> tuple[float, float]:
    """The producer and its consumer in a daemon with nothing else."""
    async with _client(state) as http:
        return await fanout(state, Daemon(pid), http, isolation, seconds)


async def measure(
    state: DaemonState, pid: int, n: int, isolation: str, seconds: float
) -> dict[str, Any]:
    daemon = Daemon(pid)
    consumers: list[Consumer] = []
    async with _client(state) as http:
        await (await http.get("/health")).aread()  # the connection, warmed
        rss0, fds0 = daemon.rss_kib(), daemon.fds()
        fresh_cpu = await _cpu_pct(daemon, 2.0)

        start = time.perf_counter()
        sids = [await _create(http, isolation) for _ in range(n)]
        create_s = time.perf_counter() - start

        start = time.perf_counter()
        pids = [await _start(http, sid, IDLE) for sid in sids]
        start_s = time.perf_counter() - start

        for sid, p in zip(sids, pids, strict=True):
            consumer = Consumer()
            consumer.start(state, f"/sandboxes/{sid}/processes/{p}/stream?role=bench")
            consumers.append(consumer)
        await asyncio.gather(*(c.wait_attached() for c in consumers))
        try:
            settle_s = await _settle(daemon)
            rss, fds = daemon.rss_kib(), daemon.fds()
            idle_cpu = await _cpu_pct(daemon, 2.0)

            list_s, listed = await _p50(http, "/sandboxes", 31)
            head = (await http.get("/health")).json()["next_event"]
            page_s, page = await _p50(http, f"/events?since={max(head - 100, 0)}", 31)
            journal = len((await http.get("/events")).json())
            poll_s, _ = await _p50(http, f"/events?since={head}", 31)

            quiet_cpu = await _event_cpu(http, daemon, isolation)
            followers = await asyncio.gather(*(_follow(state, sid, head) for sid in sids))
            try:
                await asyncio.sleep(1.0)  # sleep-ok: the daemon reads every follower's request
                followed_cpu = await _event_cpu(http, daemon, isolation)
            finally:
                for task in followers:
                    task.cancel()
                await asyncio.gather(*followers, return_exceptions=True)

            rate, rate_cpu = await fanout(state, daemon, http, isolation, seconds)
        finally:
            await asyncio.gather(*(c.stop() for c in consumers))
    return {
        "create_per_s": n / create_s,
        "start_per_s": n / start_s,
        "rss_kib_per_sandbox": (rss - rss0) / n,
        "fds_per_sandbox": (fds - fds0) / n,
        "idle_cpu_pct": idle_cpu,
        "fresh_cpu_pct": fresh_cpu,
        "idle_cpu_per_1000": (idle_cpu - fresh_cpu) / n * 1000,
        "settle_s": settle_s,
        "list_p50_ms": list_s * 1e3,
        "list_bytes": len(listed),
        "journal_events": journal,
        "event_us": page_s / len(json.loads(page)) * 1e6,
        "poll_p50_ms": poll_s * 1e3,
        "event_cpu_us": quiet_cpu * 1e6,
        "followed_event_cpu_us": followed_cpu * 1e6,
        "follower_cost_us": (followed_cpu - quiet_cpu) * 1e6 / n,
        "fanout_mb_s": rate,
        "fanout_cpu_pct": rate_cpu,
    }


async def _settle(daemon: Daemon, deadline: float = 180.0) -> float:
    """Wait until the daemon has used under :data:`SETTLED` % of a core in two
    half-second windows in a row; the seconds that took (the last window's end)."""
    start = time.perf_counter()
    calm = 0
    while calm < 2:
        if time.perf_counter() - start > deadline:
            raise TimeoutError(f"the daemon did not settle in {deadline:.0f} s")
        calm = calm + 1 if await _cpu_pct(daemon, 0.5) < SETTLED else 0
    return time.perf_counter() - start - 1.0


async def exited(state: DaemonState, pid: int, n: int) -> float:
    """The daemon's idle CPU (% of a core) once one sandbox of its ran ``n`` commands to
    their end and keeps them."""
    daemon = Daemon(pid)
    async with _client(state) as http:
        sid = await _create(http, "none")
        pids = {await _start(http, sid, ["true"]) for _ in range(n)}
        deadline = time.perf_counter() + 120
        while True:
            listed = (await http.get(f"/sandboxes/{sid}/processes")).json()
            if sum(p["pid"] in pids and p["exit_code"] is not None for p in listed) == n:
                break
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{n} commands did not end in 120 s")
            await asyncio.sleep(0.2)  # sleep-ok: polled until they have ended
        await _settle(daemon)
        return await _cpu_pct(daemon, 2.0)


async def _cpu_pct(daemon: Daemon, seconds: float) -> float:
    """The daemon's CPU over ``seconds``, % of one core."""
    cpu, start = daemon.cpu(), time.perf_counter()
    await asyncio.sleep(seconds)  # sleep-ok: the measurement's window
    return (daemon.cpu() - cpu) / (time.perf_counter() - start) * 100


EVENTS = 100
"""Events recorded (pause, resume of one empty sandbox) for the CPU per event."""


async def _event_cpu(http: httpx.AsyncClient, daemon: Daemon, isolation: str) -> float:
    """Daemon CPU seconds per event while :data:`EVENTS` events are recorded (an empty
    sandbox paused and resumed; the median of three batches)."""
    sid = await _create(http, isolation)
    try:
        samples = []
        for _ in range(3):
            cpu = daemon.cpu()
            for _ in range(EVENTS // 2):
                (await http.post(f"/sandboxes/{sid}/pause")).raise_for_status()
                (await http.post(f"/sandboxes/{sid}/resume")).raise_for_status()
            samples.append((daemon.cpu() - cpu) / EVENTS)
        return statistics.median(samples)
    finally:
        await http.delete(f"/sandboxes/{sid}")


async def _follow(state: DaemonState, sid: str, since: int) -> asyncio.Task[None]:
    """A view of one sandbox: a long poll of its events (``wait=25``) that no event of
    the measurement answers. Returns once the request is sent (as the task holding its
    connection), so that every follower waits before the events begin."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(state))
    writer.write(
        f"GET /sandboxes/{sid}/events?since={since}&wait=25 HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {state.token}\r\n\r\n".encode()
    )
    await writer.drain()

    async def hold() -> None:
        try:
            await reader.read()
        finally:
            writer.close()

    return asyncio.ensure_future(hold())


def run_size(n: int, isolation: str, seconds: float) -> Size:
    with local_daemon() as (process, state):
        alone_rate, alone_cpu = asyncio.run(alone(state, process.pid, isolation, seconds))
        exited_cpu = asyncio.run(exited(state, process.pid, n))
    with local_daemon() as (process, state):
        figures = asyncio.run(measure(state, process.pid, n, isolation, seconds))
    return Size(
        sandboxes=n,
        fanout_alone_mb_s=alone_rate,
        fanout_ratio=figures["fanout_mb_s"] / alone_rate,
        fanout_alone_cpu_pct=alone_cpu,
        exited_cpu_pct=exited_cpu,
        **figures,
    )


COLUMNS: list[tuple[str, str, str]] = [
    ("create_per_s", "create/s", "{:.0f}"),
    ("start_per_s", "start/s", "{:.0f}"),
    ("rss_kib_per_sandbox", "RSS/sbx KiB", "{:.1f}"),
    ("fds_per_sandbox", "fds/sbx", "{:.2f}"),
    ("idle_cpu_pct", "idle CPU %", "{:.1f}"),
    ("idle_cpu_per_1000", "… per 1,000 sbx", "{:.1f}"),
    ("settle_s", "settle s", "{:.1f}"),
    ("exited_cpu_pct", "idle CPU % beside N exited", "{:.1f}"),
    ("list_p50_ms", "list p50 ms", "{:.2f}"),
    ("journal_events", "journal", "{:d}"),
    ("event_us", "event µs", "{:.1f}"),
    ("poll_p50_ms", "poll p50 ms", "{:.2f}"),
    ("event_cpu_us", "CPU/event µs", "{:.0f}"),
    ("followed_event_cpu_us", "… N followers µs", "{:.0f}"),
    ("fanout_mb_s", "fan-out MB/s", "{:.2f}"),
    ("fanout_ratio", "vs alone", "{:.2f}×"),
    ("fanout_cpu_pct", "fan-out CPU %", "{:.1f}"),
]

# Figures that are a total (grow with N at best linearly) and how they relate to N; the
# per-sandbox ones should stay flat (exponent 0).
GROWTH = [
    ("list_p50_ms", "total"),
    ("idle_cpu_pct", "total"),
    ("settle_s", "total"),
    ("exited_cpu_pct", "total: goal flat"),
    ("event_us", "per event"),
    ("poll_p50_ms", "per poll"),
    ("followed_event_cpu_us", "per event, a follower per sandbox"),
    ("rss_kib_per_sandbox", "per sandbox"),
    ("fds_per_sandbox", "per sandbox"),
    ("idle_cpu_per_1000", "per sandbox"),
    ("create_per_s", "rate"),
    ("start_per_s", "rate"),
]


def exponents(sizes: list[Size]) -> dict[str, float]:
    """Growth exponent of each figure between the two largest sizes."""
    if len(sizes) < 2:
        return {}
    small, big = sizes[-2], sizes[-1]
    scale = math.log(big.sandboxes / small.sandboxes)
    out = {}
    for name, _ in GROWTH:
        a, b = getattr(small, name), getattr(big, name)
        if a > 0 and b > 0:
            out[name] = math.log(b / a) / scale
    return out


def isolation_note(isolation: str) -> str:
    if isolation == "none":
        return "isolation off: sandboxes run without namespaces (--isolation namespaces)"
    return f"isolation {isolation}"


def print_table(sizes: list[Size], isolation: str) -> None:
    print(isolation_note(isolation))
    header = "| sandboxes | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    print(header)
    print("|" + "---|" * (len(COLUMNS) + 1))
    for s in sizes:
        cells = [fmt.format(getattr(s, name)) for name, _, fmt in COLUMNS]
        print(f"| {s.sandboxes:,} | " + " | ".join(cells) + " |")
    growth = exponents(sizes)
    if growth:
        a, b = sizes[-2].sandboxes, sizes[-1].sandboxes
        print(f"\ngrowth exponent {a:,} → {b:,} (1 linear, 0 flat):")
        for name, kind in GROWTH:
            if name in growth:
                print(f"   {name:22} {growth[name]:+.2f}   ({kind})")


def write_png(sizes: list[Size], path: Path, isolation: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rss_kib_per_sandbox", "daemon RSS per sandbox (KiB)", None),
        ("fds_per_sandbox", "fds per sandbox", None),
        ("create_per_s", "create rate (sandboxes/s)", None),
        ("list_p50_ms", "GET /sandboxes p50 (ms)", 10.0),
        ("event_us", "GET /events, per event (µs)", None),
        ("poll_p50_ms", "GET /events poll at head, p50 (ms)", None),
        ("followed_event_cpu_us", "daemon CPU per event, a follower\nper sandbox (µs)", None),
        (
            "idle_cpu_per_1000",
            "daemon CPU, all idle, above the fresh\ndaemon's, per 1,000 sandboxes (% of a core)",
            None,
        ),
        ("fanout_ratio", "10 MB/s fan-out beside N idle / alone", 0.9),
    ]
    xs = [s.sandboxes for s in sizes]
    fig, axes = plt.subplots(3, 3, figsize=(12, 9.5))
    for ax, (name, title, goal) in zip(axes.flat, panels, strict=True):
        ys = [getattr(s, name) for s in sizes]
        ax.plot(xs, ys, "o-", color="#4c72b0")
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=8)  # fmt: skip
        if goal is not None:
            ax.axhline(goal, color="#c44e52", linestyle="--", linewidth=1, label=f"goal {goal}")
            ax.legend(fontsize=8, loc="best")
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0, top=max([*ys, goal or 0]) * 1.25 or 1)
        ax.set_xlabel("sandboxes (each: 1 idle process, 1 consumer)", fontsize=8)
    off = " — isolation off" if isolation == "none" else f" — isolation {isolation}"
    fig.suptitle(f"sandboxkit: the cost curve (benchmarks/scale.py){off}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--seconds", type=float, default=3.0, help="fan-out window")
    parser.add_argument("--isolation", choices=["none", "namespaces"], default="none")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, help="write the curve as a PNG here")
    args = parser.parse_args()
    # Two sockets per sandbox in this process (its consumer, its events follower).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if 2 * max(args.sizes) + 64 > hard:
        raise SystemExit(f"{max(args.sizes)} consumers need more descriptors than {hard}")
    sizes = []
    for n in sorted(args.sizes):
        sizes.append(run_size(n, args.isolation, args.seconds))
        if not args.json:
            print(f"   {n:,} sandboxes measured", file=sys.stderr)
    if args.plot is not None:
        write_png(sizes, args.plot, args.isolation)
    if args.json:
        print(
            json.dumps(
                {
                    "isolation": args.isolation,
                    "note": isolation_note(args.isolation),
                    "sizes": [asdict(s) for s in sizes],
                    "growth_exponents": exponents(sizes),
                }
            )
        )
        return
    print_table(sizes, args.isolation)


if __name__ == "__main__":
    main()
