"""sandboxkit beside the systems people would pick instead, on the same work, in one run.

Sections (issue 11): P1 fan-out of one child's 64 KiB writes to 1 / 4 / 16 consumers
(sandboxkit raw-socket and SDK consumers vs Redis pub/sub and a bare uvicorn app); P3 child
line -> client callback latency (SDK vs bare uvicorn -> httpx); P4 reattach -> first replayed
byte after 1 MB; P5 create + first command (vs ``tmux new-session -d``), ``run(["true"])``
in a running sandbox (vs an asyncio spawn + wait), pause + resume of 4 processes, a unary
request (vs a bare uvicorn JSON endpoint); P7 client CPU per GB (SDK vs
httpx ``aiter_raw``) and daemon CPU per GB at 16 consumers; stdin batches/s and MB/s.

Each section starts once the machine is idle (or after a deadline, noted in the output);
every figure is the median of >= 3 runs with its range. P1 runs its systems in interleaved
rounds (see ``Bench.interleaved``), and with uvloop installed a daemon on asyncio besides
the default one, each compared with bare uvicorn on its own loop. The table is printed and
written to ``benchmarks/results/compare.csv`` and ``compare.png``. Everything runs on
loopback; every process started here is stopped here.

    python benchmarks/compare.py            # full run (~2 min on 2 cores)
    python benchmarks/compare.py --quick    # ~1 min, smaller transfers
    python benchmarks/compare.py --quick --baseline-daemon ../old-checkout   # before/after
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import functools
import importlib.util
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from _daemon import local_daemon, stop
from _figures import (
    BARE_REF,
    LINES,
    Lines,
    bare_lines,
    bare_replay,
    bare_unary,
    cpu_seconds,
    create_first,
    pause_resume,
    percentile,
    run_true,
    sdk_lines,
    sdk_replay,
    sdk_unary,
)
from fanout import BARE_APP, CHUNK, WRITER, _free_port, _read_all, _wait_port, bare_run

from sandboxkit import AsyncSandbox
from sandboxkit.daemon.isolation import ISOLATION_ENV, probe
from sandboxkit.daemon.server import event_loop_factory

T = TypeVar("T")
Run = Callable[[], Coroutine[Any, Any, T]]
"""One run of a figure: a fresh event loop runs it (``asyncio.run``)."""
RESULTS = Path(__file__).resolve().parent / "results"
REDIS_MISSING = "not installed (apt-get install redis-server)"
TMUX_MISSING = "not installed (apt-get install tmux)"


# -- results -------------------------------------------------------------------------


@dataclass
class Row:
    section: str
    figure: str
    unit: str
    sbx: list[float]
    ref_name: str = ""
    ref: list[float] | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if not self.sbx or not self.ref:
            return None
        ref = statistics.median(self.ref)
        return statistics.median(self.sbx) / ref if ref else None


def _fmt(values: list[float] | None) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    lo, hi = min(values), max(values)
    digits = 2 if med < 100 else 0
    return f"{med:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def print_table(rows: list[Row]) -> None:
    print("\n| figure | sandboxkit | reference | ratio |\n|---|---|---|---|")
    for r in rows:
        ref = r.note if r.ref is None and r.note else f"{r.ref_name} {_fmt(r.ref)}".strip()
        ratio = "—" if r.ratio is None else f"{r.ratio:.2f}×"
        print(f"| {r.section} {r.figure}, {r.unit} | {_fmt(r.sbx)} | {ref} | {ratio} |")


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["section", "figure", "unit", "sandboxkit_median", "sandboxkit_min",
             "sandboxkit_max", "reference", "reference_median", "reference_min",
             "reference_max", "ratio", "note"]
        )  # fmt: skip
        for r in rows:
            s = [statistics.median(r.sbx), min(r.sbx), max(r.sbx)] if r.sbx else ["", "", ""]
            ref = [statistics.median(r.ref), min(r.ref), max(r.ref)] if r.ref else ["", "", ""]
            w.writerow([r.section, r.figure, r.unit, *s, r.ref_name, *ref, r.ratio or "", r.note])


def write_png(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.ratio is not None]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(shown) + 1.5))
    labels = [f"{r.section} {r.figure} ({r.ref_name})" for r in shown]
    ratios = [r.ratio or 0.0 for r in shown]
    # Green where sandboxkit does better (more per second, or less time and CPU); grey for
    # a row of two references (a floor against uvicorn), where no one is better.
    colors = [
        "#999999" if r.extra.get("reference") else
        "#55a868" if (x >= 1.0) == r.unit.endswith("/s") else "#c44e52"
        for r, x in zip(shown, ratios, strict=True)
    ]  # fmt: skip
    bars = ax.barh(range(len(shown)), ratios, color=colors)
    ax.bar_label(bars, labels=[f"{x:.2f}×" for x in ratios], padding=3, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(shown)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    # Plain ratios on the axis (a log axis labels its ticks as powers of ten).
    low, high = min(*ratios, 1.0) / 1.3, max(*ratios, 1.0) * 1.4
    ticks = [t for t in (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0) if low <= t <= high]
    ax.set_xlim(low, high)
    ax.set_xticks(ticks, [f"{t:g}×" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("sandboxkit ÷ reference (median)\ngreen: sandboxkit better; grey: two references")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the machine ---------------------------------------------------------------------


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def busy_fraction(interval: float = 0.5) -> float:
    """Share of all cores busy over ``interval`` seconds (everyone's processes)."""
    b0, t0 = _cpu_times()
    time.sleep(interval)  # sleep-ok: the sampling window
    b1, t1 = _cpu_times()
    return (b1 - b0) / max(1, t1 - t0)


def wait_idle(deadline: float, threshold: float = 0.25) -> float:
    """Wait until the machine is idle (below ``threshold`` busy) or ``deadline`` seconds
    pass; returns the last busy share seen (noted with the section)."""
    end = time.monotonic() + deadline
    busy = busy_fraction()
    while busy > threshold and time.monotonic() < end:
        busy = busy_fraction()
    return busy


# -- reference servers ---------------------------------------------------------------

# Reads the same child as the others and publishes each read to channel d, then an end
# marker; the subscribers count bytes until they see it.
# The kernel's share of a fan-out: the least a server can do. It sends each of the
# round's n clients ``size`` bytes, in the pieces the daemon's pipe reads give (256 KiB):
# with plain non-blocking send()s from one buffer ("send": the floor under any server that
# copies, as the daemon and uvicorn do for readers that keep up), with sendfile() of one
# piece in the page cache sent again and again ("sendfile": the floor without the copy),
# or with sendfile() of new output ("sendfile of new pages"): each piece written once, in
# order, to pages never written before (a memfd per 16 MiB, closed once every client is
# past it), since a live stream's bytes are new and a page a send still references may not
# be written over (the loopback's receiver reads it later); sent up to 1 MiB a call, as the
# daemon's largest sends. No HTTP, no event loop, no pipe, no log: its CPU per GB is the
# sends alone (the copy into the socket, if any, and loopback's delivery, which runs in the
# sender's time). (The readers are bare_run's.)
FLOOR_SENDER = """
import os, selectors, socket, sys, tempfile
port, size, mode, piece = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], 256 * 1024
data = memoryview(b"y" * piece)
with tempfile.TemporaryFile() as f:  # a piece in the page cache, sent again and again
    f.write(data)
    f.flush()
    page_cache = os.dup(f.fileno())
REGION = 64 * piece  # new output: memfds of this many bytes, each written once


class Fresh:  # the round's output written once, piece by piece as the first client
    # needs it, to memfds never written over; each closed once every client is past it
    def __init__(self):
        self.regions, self.written = {}, 0

    def send(self, conn, at, n):
        while self.written < min(at + n, size):
            index, offset = divmod(self.written, REGION)
            if index not in self.regions:
                self.regions[index] = os.memfd_create("floor")
            self.written += os.pwrite(self.regions[index], data, offset)
        index, offset = divmod(at, REGION)
        return os.sendfile(conn.fileno(), self.regions[index], offset, min(n, REGION - offset))

    def past(self, at):
        for index in [i for i in self.regions if (i + 1) * REGION <= at]:
            os.close(self.regions.pop(index))


server = socket.create_server(("127.0.0.1", port))
waiting = []
while True:
    conn, _ = server.accept()
    head = b""
    while b"\\r\\n\\r\\n" not in head and (more := conn.recv(4096)):
        head += more
    if b"\\r\\n\\r\\n" not in head:  # closed before a request (the readiness probe)
        conn.close()
        continue
    n = int(head.split(b"n=", 1)[1].split(b" ", 1)[0])
    conn.sendall(b"S")
    waiting.append(conn)
    if len(waiting) < n:
        continue
    left = {c: size for c in waiting}
    fresh = Fresh()
    sel = selectors.DefaultSelector()
    for c in waiting:
        c.setblocking(False)
        sel.register(c, selectors.EVENT_WRITE)
    while left:
        for key, _ in sel.select():
            c = key.fileobj
            try:
                if mode == "send":
                    left[c] -= c.send(data[: min(piece, left[c])])
                elif mode == "sendfile":
                    left[c] -= os.sendfile(c.fileno(), page_cache, 0, min(piece, left[c]))
                else:
                    left[c] -= fresh.send(c, size - left[c], min(4 * piece, left[c]))
                    fresh.past(size - max(left.values()))
            except BlockingIOError:
                continue
            if not left[c]:
                del left[c]
                sel.unregister(c)
                c.close()
    fresh.past(size + REGION)
    waiting = []
"""

PUBLISHER = """
import asyncio, sys
END = b"__end_of_stream__"

def publish(channel, data):
    return b"*3\\r\\n$7\\r\\nPUBLISH\\r\\n$%d\\r\\n%s\\r\\n$%d\\r\\n" % (
        len(channel), channel, len(data)) + data + b"\\r\\n"

async def main():
    r, w = await asyncio.open_connection("127.0.0.1", int(sys.argv[1]))
    async def replies():
        while await r.read(65536):
            pass
    reading = asyncio.ensure_future(replies())
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", sys.argv[2], stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    proc.stdin.write(b"\\n")
    while data := await proc.stdout.read(65536):
        w.write(publish(b"d", data))
        await w.drain()
    w.write(publish(b"d", END))
    await w.drain()
    # Half-close and read every reply until redis closes: closing with replies unread
    # would reset the connection and drop the commands still in flight.
    w.write_eof()
    await reading
    await proc.wait()
    w.close()

asyncio.run(main())
"""
REDIS_END = b"__end_of_stream__"


@contextlib.contextmanager
def running(
    argv: list[str], port: int | None = None, **kw: Any
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, **kw)
    try:
        if port is not None:
            asyncio.run(_wait_port(port))
        yield proc
    finally:
        stop(proc)


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[subprocess.Popen[bytes], int] | None]:
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = _free_port()
    # No persistence, and no output-buffer limit for subscribers (the others drop nothing).
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--client-output-buffer-limit", "pubsub 0 0 0",
            "--daemonize", "no", "--logfile", ""]  # fmt: skip
    with running(argv, port, stdout=subprocess.DEVNULL) as proc:
        yield proc, port


# -- P1 fan-out ----------------------------------------------------------------------


async def daemon_fanout(url: str, token: str, size: int, consumers: int) -> tuple[int, float]:
    """Raw HTTP/1.1 consumers of one daemon process: (bytes delivered, seconds)."""
    port = int(url.rsplit(":", 1)[1])
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        sbx = (await http.post("/sandboxes", json={})).json()["sandbox_id"]
        script = WRITER.format(blocks=size // CHUNK)
        body = {"argv": [sys.executable, "-c", script]}
        pid = (await http.post(f"/sandboxes/{sbx}/processes", json=body)).json()["pid"]
        path = f"/sandboxes/{sbx}/processes/{pid}/stream?cursor=0"
        events = [asyncio.Event() for _ in range(consumers)]
        readers = [asyncio.ensure_future(_read_all(port, path, token, e)) for e in events]
        await asyncio.gather(*(e.wait() for e in events))
        start = time.perf_counter()
        go = {"session": "go", "seq": 0, "data": "Cg=="}
        await http.post(f"/sandboxes/{sbx}/processes/{pid}/stdin", json=go)
        totals = await asyncio.gather(*readers)
        elapsed = time.perf_counter() - start
        await http.delete(f"/sandboxes/{sbx}")
    return sum(totals), elapsed


async def sdk_fanout(url: str, token: str, size: int, consumers: int) -> tuple[int, float]:
    """SDK consumers (``commands.connect``, raw chunks): (bytes delivered, seconds)."""
    async with await AsyncSandbox.create(url=url, token=token) as sbx:
        info = await sbx.commands.start([sys.executable, "-c", WRITER.format(blocks=size // CHUNK)])
        counts = [0] * consumers

        def counter(i: int) -> Callable[[str], None]:
            def on_stdout(text: str) -> None:
                counts[i] += len(text)

            return on_stdout

        handles = [
            await sbx.commands.connect(info.pid, cursor=0, on_stdout=counter(i), lines=False)
            for i in range(consumers)
        ]
        deadline = time.monotonic() + 20
        while len(await sbx.consumers()) < consumers:
            if time.monotonic() > deadline:
                raise RuntimeError("SDK consumers did not attach")
            await asyncio.sleep(0.01)  # sleep-ok: polling with a deadline
        start = time.perf_counter()
        await sbx.commands.send_stdin(info.pid, "\n")
        for h in handles:
            await h.wait()
        elapsed = time.perf_counter() - start
    return sum(counts), elapsed


async def _subscriber(port: int, subscribed: asyncio.Event) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"*2\r\n$9\r\nSUBSCRIBE\r\n$1\r\nd\r\n")
    await writer.drain()
    total, tail, first = 0, b"", True
    while True:
        data = await reader.read(1 << 20)
        if not data:
            break
        if first:  # the subscribe confirmation
            subscribed.set()
            first = False
            continue
        total += len(data)
        # The marker may straddle two reads.
        if REDIS_END in tail + data[:64] or REDIS_END in data[-64:]:
            break
        tail = (tail + data[-64:])[-64:]
    writer.close()
    return total


async def redis_fanout(port: int, size: int, consumers: int) -> tuple[int, float]:
    script = WRITER.format(blocks=size // CHUNK)
    pub = subprocess.Popen(  # noqa: ASYNC220 - started once, before the timed part
        [sys.executable, "-c", PUBLISHER, str(port), script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert pub.stdout is not None
        await asyncio.to_thread(pub.stdout.readline)  # connected, child started
        events = [asyncio.Event() for _ in range(consumers)]
        subs = [asyncio.ensure_future(_subscriber(port, e)) for e in events]
        await asyncio.gather(*(e.wait() for e in events))
        start = time.perf_counter()
        assert pub.stdin is not None
        pub.stdin.write(b"\n")
        pub.stdin.flush()
        totals = await asyncio.gather(*subs)
        elapsed = time.perf_counter() - start
    finally:
        stop(pub)
    return sum(totals), elapsed


Work = Callable[[int], Awaitable[tuple[int, float]]]
"""One fan-out to ``n`` consumers through some system: (bytes delivered, seconds)."""


BARE_NAMES = {"asyncio": "bare uvicorn", "uvloop": "bare uvicorn + uvloop"}
"""The bare uvicorn reference on each event loop, by the loop's name."""

FLOORS = {
    "kernel floor": "send",
    "kernel floor, sendfile": "sendfile",
    "kernel floor, sendfile of new pages": "fresh",
}
"""The systems that only send (:data:`FLOOR_SENDER`), by name: their way of sending."""


def _daemon_work(url: str, token: str, size: int) -> Work:
    return lambda n: daemon_fanout(url, token, size, n)


def _bare_work(port: int, size: int) -> Work:
    async def work(n: int) -> tuple[int, float]:
        rate = await bare_run(port, n)
        return n * size, n * size / rate

    return work


def _redis_work(port: int, size: int) -> Work:
    return lambda n: redis_fanout(port, size, n)


def _measure(
    runs: int, pid: int | None, work: Callable[[], Awaitable[tuple[int, float]]]
) -> tuple[list[float], list[float]]:
    """``runs`` rounds of ``work``: (GB/s of each, CPU-s per GB of process ``pid``)."""
    rates, cpu = [], []
    for _ in range(runs):
        before = cpu_seconds(pid) if pid else 0.0
        nbytes, elapsed = asyncio.run(work())  # type: ignore[arg-type]
        if pid:
            cpu.append((cpu_seconds(pid) - before) / (nbytes / 1e9))
        rates.append(nbytes / elapsed / 1e9)
    return rates, cpu


# -- the sections --------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.runs: int = args.runs
        self.rows: list[Row] = []
        self.idle_deadline = 10.0 if self.quick else 60.0
        self.busy: dict[str, float] = {}

    def idle(self, section: str) -> None:
        self.busy[section] = wait_idle(self.idle_deadline)
        print(f"[{section}] machine busy {self.busy[section]:.0%} at start", flush=True)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print_table([row])

    # P1 + P7 (daemon CPU) --------------------------------------------------------------
    def interleaved(
        self, systems: dict[str, tuple[int, Work]], consumers: int
    ) -> dict[str, tuple[list[float], list[float]]]:
        """Every system's (GB/s, CPU-s per GB) at ``consumers``, run round by round: one
        run of each per round, the order rotated every round, after a first round that
        only warms them up. On a noisy machine a slow spell then lands on every system
        alike, not on whichever was measured during it, and no first run (imports, the
        first sandbox, cold caches) counts."""
        names = list(systems)
        out: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
        for round_ in range(self.runs + 1):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                pid, work = systems[name]
                rates, cpu = _measure(1, pid, functools.partial(work, consumers))
                if round_:
                    out[name][0].extend(rates)
                    out[name][1].extend(cpu)
        return out

    def p1(self, daemon: Any, extra_daemons: dict[str, Any], loops: dict[str, str]) -> None:
        """``loops``: the event loop each daemon (by name) serves on."""
        # Per consumer. Large enough that what a round costs besides the fan-out (its
        # requests, a sandbox and a process to create, ~20 ms of the daemon's CPU) is a
        # few per cent of the CPU per GB, not a fifth of it as with 16 MiB.
        size = (32 if self.quick else 128) * 1024 * 1024
        info = daemon[1]
        self.idle("P1")
        with contextlib.ExitStack() as stack:
            systems: dict[str, tuple[int, Work]] = {}
            for name, (proc, d) in {"sandboxkit": daemon, **extra_daemons}.items():
                systems[name] = (proc.pid, _daemon_work(d.url, d.token, size))
            # The daemon serves on uvloop when it is installed (DaemonConfig.event_loop):
            # then bare uvicorn on uvloop too, the like-for-like reference.
            bare_loops = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])
            for loop in bare_loops:
                port = _free_port()
                source = BARE_APP.replace('loop="asyncio"', f'loop="{loop}"')
                script = WRITER.format(blocks=size // CHUNK)
                argv = [sys.executable, "-c", source, str(port), script]
                proc = stack.enter_context(running(argv, port))
                systems[BARE_NAMES[loop]] = (proc.pid, _bare_work(port, size))
            for floor, mode in FLOORS.items():
                port = _free_port()
                argv = [sys.executable, "-c", FLOOR_SENDER, str(port), str(size), mode]
                proc = stack.enter_context(running(argv, port))
                systems[floor] = (proc.pid, _bare_work(port, size))
            found = stack.enter_context(redis_server())
            if found is not None:
                systems["Redis pub/sub"] = (found[0].pid, _redis_work(found[1], size))
            measured = {n: self.interleaved(systems, n) for n in self.args.consumers}
        sdk = {
            n: _measure(self.runs, None, lambda n=n: sdk_fanout(info.url, info.token, size, n))[0]
            for n in self.args.consumers
        }
        redis_note = "" if found is not None else REDIS_MISSING
        top = max(self.args.consumers)

        def figure(name: str, n: int, cpu: bool) -> list[float] | None:
            got = measured[n].get(name)
            return None if got is None else got[1 if cpu else 0]

        for n in self.args.consumers:
            for ref in ("Redis pub/sub", *BARE_NAMES.values(), *extra_daemons):
                if ref in measured[n] or ref == "Redis pub/sub":
                    self.add(Row("P1", f"fan-out {n} raw consumer(s)", "GB/s",
                                 measured[n]["sandboxkit"][0], ref, figure(ref, n, False),
                                 note=redis_note if ref == "Redis pub/sub" else ""))  # fmt: skip
            self.add(Row("P1", f"fan-out {n} SDK consumer(s)", "GB/s", sdk[n],
                         "Redis pub/sub", figure("Redis pub/sub", n, False),
                         note=redis_note))  # fmt: skip
        # Like for like: each daemon against bare uvicorn on the same event loop.
        for name in ("sandboxkit", *extra_daemons):
            loop = loops.get(name, "")
            bare_ref = BARE_NAMES.get(loop)
            if bare_ref is not None and bare_ref in measured[top]:
                self.add(Row("P7", f"daemon CPU-s per GB fanned out ({top}), {name}"
                             + ("" if name.endswith(loop) else f" on {loop}"),
                             "s/GB", measured[top][name][1], bare_ref,
                             measured[top][bare_ref][1]))  # fmt: skip
        self.add(Row("P7", f"daemon CPU-s per GB fanned out ({top})", "s/GB",
                     measured[top]["sandboxkit"][1], "redis-server",
                     figure("Redis pub/sub", top, True), note=redis_note))  # fmt: skip
        # Another daemon on a loop of its choosing (--baseline-daemon): beside this one.
        for name in (name for name in extra_daemons if name not in loops):
            self.add(Row("P7", f"daemon CPU-s per GB fanned out ({top})", "s/GB",
                         measured[top]["sandboxkit"][1], name, measured[top][name][1]))  # fmt: skip
        # What the goal of 0.5x bare uvicorn leaves once the kernel's copies are paid.
        bare_ref = BARE_NAMES["uvloop" if BARE_NAMES["uvloop"] in measured[top] else "asyncio"]
        for floor in FLOORS:
            self.add(Row("P7", f"CPU-s per GB of the sends alone ({top}), {floor}", "s/GB",
                         measured[top][floor][1], bare_ref, measured[top][bare_ref][1],
                         note="the floor under a server that sends this way",
                         extra={"reference": True}))  # fmt: skip

    # P3, P4, P5 unary ----------------------------------------------------------------
    def latency(self, info: Any, pid: int) -> None:
        """``info``, ``pid``: the daemon's state and process."""
        port = _free_port()
        with running([sys.executable, "-c", BARE_REF, str(port), LINES], port) as ref:
            self.idle("P3")
            # Where the three processes land moves a run's p50 more than either side's
            # code does (0.2-0.4 ms between runs): more, shorter runs, the same lines.
            n_lines = 150 if self.quick else 200
            sdk, bare = self.in_turns(
                lambda: sdk_lines(info, Lines(pid, n_lines)),
                lambda: bare_lines(port, Lines(ref.pid, n_lines)),
                self.runs if self.quick else 3 * self.runs,
            )
            for q, name in ((0.5, "p50"), (0.99, "p99")):
                self.add(Row("P3", f"child line -> callback {name}", "ms",
                             [percentile(s.latencies, q) * 1e3 for s in sdk], "uvicorn -> httpx",
                             [percentile(b.latencies, q) * 1e3 for b in bare]))  # fmt: skip
            self.add(Row("P3", "the server's CPU per line", "us",
                         [s.server_cpu * 1e6 for s in sdk], "bare uvicorn",
                         [b.server_cpu * 1e6 for b in bare]))  # fmt: skip
            self.idle("P4")
            tries = 30 if self.quick else 100
            sdk, bare = self.in_turns(
                lambda: sdk_replay(info, tries), lambda: bare_replay(port, tries)
            )
            for q, name in ((0.5, "p50"), (0.99, "p99")):
                self.add(Row("P4", f"reattach -> first replayed byte {name} (1 MB)", "ms",
                             [percentile(s, q) * 1e3 for s in sdk], "uvicorn -> httpx",
                             [percentile(b, q) * 1e3 for b in bare]))  # fmt: skip
            self.idle("P5")
            tries = 30 if self.quick else 200
            sdk, bare = self.in_turns(
                lambda: sdk_unary(info, tries), lambda: bare_unary(port, tries)
            )
            self.add(Row("P5", "unary request p50", "ms", [statistics.median(s) * 1e3 for s in sdk],
                         "uvicorn JSON", [statistics.median(b) * 1e3 for b in bare]))  # fmt: skip

    def in_turns(
        self, ours: Run[T], theirs: Run[T], runs: int | None = None
    ) -> tuple[list[T], list[T]]:
        """``runs`` runs of each (``--runs``), in turns (the first of each pair
        alternating), so that a slow spell of a noisy machine falls on both alike."""
        out: tuple[list[T], list[T]] = ([], [])
        for run in range(self.runs if runs is None else runs):
            for side in (0, 1) if run % 2 == 0 else (1, 0):
                out[side].append(asyncio.run((ours, theirs)[side]()))
        return out

    # P5 create, pause/resume -----------------------------------------------------------
    def lifecycle(self, info: Any, isolated_daemons: tuple[Any, Any] | None) -> None:
        """``isolated_daemons``: two whose sandboxes are isolated by default, with and
        without a spare sandbox (None where namespaces are not to be had)."""
        self.idle("P5")
        tries = 10 if self.quick else 40
        # Back to back, every create makes its sandbox (the spare is remade only once the
        # daemon is quiet); a create 0.1 s after the last command, as in a notebook, gets
        # the spare (daemon/spare.py), whose first command is a fork of its launcher. tmux
        # at the same pace: after 0.1 s idle, each process woken costs more (cores asleep).
        # In rounds: tmux at each pace, then each row's sandboxes, so that a slow spell of
        # a noisy machine falls on both alike.
        isolated, no_spare = isolated_daemons or (None, None)
        rows = [
            (name, daemon, pace)
            for name, daemon, pace in (
                ("", info, 0.0),
                (", isolated", isolated, 0.0),
                (", isolated, 0.1 s apart", isolated, 0.1),
                (", isolated, 0.1 s apart, no spare", no_spare, 0.1),
            )
            if daemon is not None
        ]
        tmux_ms: dict[float, list[float]] = {0.0: [], 0.1: []} if shutil.which("tmux") else {}
        sdk: dict[str, list[float]] = {name: [] for name, _, _ in rows}
        for run in range(self.runs):
            for pace, out in tmux_ms.items():
                out.append(statistics.median(self._tmux(tries, pace, run)) * 1e3)
            for name, daemon, pace in rows:
                times = asyncio.run(create_first(daemon, tries, pace))
                sdk[name].append(statistics.median(times) * 1e3)
        for name, _, pace in rows:
            ref = "tmux new-session -d" + (", 0.1 s apart" if pace else "")
            self.add(Row("P5", f"create + first command{name} p50", "ms", sdk[name], ref,
                         tmux_ms.get(pace), note="" if tmux_ms else TMUX_MISSING))  # fmt: skip
        runs = [asyncio.run(run_true(info, tries)) for _ in range(self.runs)]
        self.add(Row("P5", "run([\"true\"]) in a running sandbox, p50", "ms",
                     [statistics.median(r) * 1e3 for r, _ in runs],
                     "asyncio spawn + wait of true",
                     [statistics.median(s) * 1e3 for _, s in runs], note="goal ≤ 2×"))  # fmt: skip
        pr = [asyncio.run(pause_resume(info, tries)) for _ in range(self.runs)]
        self.add(Row("P5", "pause + resume, 4 processes, p50", "ms",
                     [statistics.median(s) * 1e3 for s in pr], note="— (goal ≤ 2 ms)"))  # fmt: skip

    def _tmux(self, tries: int, pace: float, run: int) -> list[float]:
        sock = f"sbxbench{os.getpid()}-{pace * 1000:.0f}-{run}"  # a server of its own
        out = []
        try:
            for i in range(tries):
                time.sleep(pace)  # sleep-ok: the pace the sandboxes are measured at
                start = time.perf_counter()
                subprocess.run(
                    ["tmux", "-L", sock, "new-session", "-d", "-s", f"s{i}", "sleep 600"],
                    check=True,
                )
                out.append(time.perf_counter() - start)
        finally:
            subprocess.run(["tmux", "-L", sock, "kill-server"], stderr=subprocess.DEVNULL)
        return out

    # P7 client CPU ---------------------------------------------------------------------
    def client_cpu(self, info: Any) -> None:
        self.idle("P7")
        size = (32 if self.quick else 128) * 1024 * 1024
        sdk, bare = [], []
        for _ in range(self.runs):
            s, b = asyncio.run(self._client_cpu(info, size))
            sdk.append(s)
            bare.append(b)
        self.add(Row("P7", "client CPU-s per GB, 1 consumer", "s/GB", sdk,
                     "httpx aiter_raw", bare))  # fmt: skip

    async def _client_cpu(self, info: Any, size: int) -> tuple[float, float]:
        # The same finished process's output, replayed to each: the same bytes, no producer.
        async with await AsyncSandbox.create(url=info.url, token=info.token) as sbx:
            script = WRITER.format(blocks=size // CHUNK)
            proc = await sbx.commands.start([sys.executable, "-c", script])
            await sbx.commands.send_stdin(proc.pid, "\n")
            got = 0

            def count(text: str) -> None:
                nonlocal got
                got += len(text)

            start = time.process_time()
            h = await sbx.commands.connect(proc.pid, cursor=0, on_stdout=count, lines=False)
            await h.wait()
            sdk = (time.process_time() - start) / (got / 1e9)
            headers = {"Authorization": f"Bearer {info.token}"}
            path = f"/sandboxes/{sbx.sandbox_id}/processes/{proc.pid}/stream?cursor=0"
            async with httpx.AsyncClient(base_url=info.url, headers=headers) as http:
                start = time.process_time()
                total = 0
                async with http.stream("GET", path) as r:
                    async for data in r.aiter_raw():
                        total += len(data)
                bare = (time.process_time() - start) / (total / 1e9)
        return sdk, bare

    # stdin -----------------------------------------------------------------------------
    def stdin(self, info: Any) -> None:
        self.idle("stdin")
        small = 200 if self.quick else 2000
        rates, mbs = [], []
        for _ in range(self.runs):
            r, m = asyncio.run(self._stdin(info, small))
            rates.append(r)
            mbs.append(m)
        self.add(Row("stdin", "64-byte batches to cat", "batches/s", rates, note="—"))
        self.add(Row("stdin", "256 KiB batches to cat", "MB/s", mbs, note="—"))

    async def _stdin(self, info: Any, small: int) -> tuple[float, float]:
        async with await AsyncSandbox.create(url=info.url, token=info.token) as sbx:
            proc = await sbx.commands.start(["cat"])
            line = b"x" * 63 + b"\n"
            start = time.perf_counter()
            async with sbx.commands.stdin_session(proc.pid) as session:
                for _ in range(small):
                    await session.write(line)
            rate = small / (time.perf_counter() - start)
            big, count = b"y" * (256 * 1024), 16 if self.quick else 64
            start = time.perf_counter()
            async with sbx.commands.stdin_session(proc.pid) as session:
                for _ in range(count):
                    await session.write(big)
            mbs = count * len(big) / (time.perf_counter() - start) / 1e6
        return rate, mbs


# -- main ----------------------------------------------------------------------------


def _loop_of(env: dict[str, str] | None) -> str:
    """The event loop a daemon started with ``env`` serves on (as the daemon picks it)."""
    choice = (os.environ if env is None else env).get("SANDBOXKIT_EVENT_LOOP", "auto")
    return "asyncio" if event_loop_factory(choice) is None else "uvloop"


def _fast_env(fast_path: str | None, on: bool) -> dict[str, str]:
    env = dict(os.environ)
    if fast_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [fast_path, env.get("PYTHONPATH")]))
    env["SANDBOXKIT_EVENT_LOOP"] = "uvloop" if on else "asyncio"
    env["SANDBOXKIT_HTTP"] = "auto" if on else "h11"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller transfers (< 3 min)")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median, range)")
    parser.add_argument("--consumers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--sections", nargs="+", default=["P1", "P3", "P5", "P7", "stdin"],
        choices=["P1", "P3", "P5", "P7", "stdin"],
        help="P1 (with P7 daemon CPU), P3 (with P4 and unary P5), P5 (create, pause), P7, stdin",
    )  # fmt: skip
    parser.add_argument(
        "--baseline-daemon", type=Path,
        help="another checkout whose daemon P1 also measures, its fan-out and CPU per GB "
        "(before/after a change; versus.py runs each checkout's client too)",
    )  # fmt: skip
    parser.add_argument(
        "--fast-path",
        help="a directory holding uvloop and httptools for the daemon (PYTHONPATH); P1 "
        "then also measures the daemon with and without them",
    )
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME=SERVE_ARGS",
        help="another daemon of this checkout that P1 also measures, started with extra "
        "`sandboxkit serve` arguments, e.g. 'cache 8 MiB=--output-cache-bytes 8388608' "
        "(repeatable)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    # SIGTERM ends the run through the ``finally`` blocks that stop what it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    size = (64 if args.quick else 256) * 1024 * 1024
    # A finished round's output is kept 1 s, not a daemon's default 15 min: dozens of
    # rounds of `size` each piled up past the kernel's background writeback threshold
    # (10 % of memory), and the flusher's disk writes then took a core from whichever
    # round ran (P1's 4-consumer row fell to half; docs/performance.md).
    retention = ["--retention-bytes", str(size * 2), "--result-ttl", "1"]
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        main_env = _fast_env(args.fast_path, on=False) if args.fast_path else None
        daemon = stack.enter_context(local_daemon(*retention, env=main_env))
        loops = {"sandboxkit": _loop_of(main_env)}
        extra: dict[str, Any] = {}
        if args.fast_path:
            extra["daemon + uvloop/httptools"] = stack.enter_context(
                local_daemon(*retention, env=_fast_env(args.fast_path, on=True))
            )
            loops["daemon + uvloop/httptools"] = "uvloop"
        elif loops["sandboxkit"] == "uvloop" and "P1" in args.sections:
            # A plain install serves on asyncio: measured too, against its own reference.
            extra["sandboxkit on asyncio"] = stack.enter_context(
                local_daemon(*retention, env=_fast_env(None, on=False))
            )
            loops["sandboxkit on asyncio"] = "asyncio"
        if args.baseline_daemon:
            extra["baseline daemon"] = stack.enter_context(
                local_daemon(*retention, cwd=args.baseline_daemon.resolve())
            )
        for variant in args.variant:
            name, _, serve_args = variant.partition("=")
            extra[name] = stack.enter_context(
                local_daemon(*retention, *serve_args.split(), env=main_env)
            )
        info = daemon[1]
        if "P1" in args.sections:
            bench.p1(daemon, extra, loops)
        if "P3" in args.sections:
            bench.latency(info, daemon[0].pid)
        if "P5" in args.sections:
            isolated = None
            if probe().available:  # daemons of their own: the others' run unisolated
                env = {**os.environ, ISOLATION_ENV: "auto"}
                isolated = (
                    stack.enter_context(local_daemon(env=env))[1],
                    stack.enter_context(local_daemon("--spare", "off", env=env))[1],
                )
            bench.lifecycle(info, isolated)
        if "P7" in args.sections:
            bench.client_cpu(info)
        if "stdin" in args.sections:
            bench.stdin(info)
    took = time.monotonic() - t0
    title = (
        f"sandboxkit vs references, {started}, {os.cpu_count()} cores, "
        f"{'quick' if args.quick else 'full'} run, {took:.0f} s"
    )
    print(f"\n{title}; busy at section start: "
          + ", ".join(f"{k} {v:.0%}" for k, v in bench.busy.items()))  # fmt: skip
    print_table(bench.rows)
    write_csv(bench.rows, args.out / "compare.csv")
    write_png(bench.rows, args.out / "compare.png", title)
    print(f"\nwritten: {args.out / 'compare.csv'}, {args.out / 'compare.png'}")


if __name__ == "__main__":
    main()
