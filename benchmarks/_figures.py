"""One run of each latency figure, through sandboxkit's client or its bare reference
(imported as ``_figures`` by ``compare.py``, ``versus.py`` and ``client_latency.py``).

Only the client's public API is used (``AsyncSandbox`` and its commands), the same since
the first releases, so that ``versus.py`` can run these with an older checkout's
``sandboxkit`` first on ``sys.path``. ``info``: a daemon's state (its ``url`` and
``token``); ``port``: a :data:`BARE_REF` server's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any

import httpx

from sandboxkit import AsyncSandbox


def cpu_seconds(pid: int) -> float:
    """The CPU time of process ``pid`` so far (all its threads), to the nanosecond (the
    scheduler's own count; ``/proc/<pid>/stat`` counts in ticks of 10 ms)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Lines:
    """One P3 run's lines as they reach the callback: each one's latency from the child's
    clock, and the CPU the server (``pid``) spent per line from the first counted to the
    last (what each side does for a line; the first lines warm the run up)."""

    SKIP = 5

    def __init__(self, pid: int, n: int) -> None:
        self.pid = pid
        self.n = n
        self._lat: list[float] = []
        self._cpu_from = 0.0
        self.server_cpu = 0.0

    def line(self, text: str | bytes) -> None:
        self._lat.append(time.time() - float(text))
        if len(self._lat) == self.SKIP:
            self._cpu_from = cpu_seconds(self.pid)
        elif len(self._lat) == self.n:
            self.server_cpu = (cpu_seconds(self.pid) - self._cpu_from) / (self.n - self.SKIP)

    @property
    def latencies(self) -> list[float]:
        return self._lat[self.SKIP :]


# -- the reference server -------------------------------------------------------------

# A bare uvicorn app for the non-fan-out references: a JSON endpoint, a line streamer
# (a child printing timestamps) and a 1 MB replay.
BARE_REF = """
import asyncio, json, logging, sys, uvicorn
REPLAY = b"r" * (1 << 20)
# A reader that leaves after its first byte makes asyncio log every later send: quiet.
logging.getLogger("asyncio").setLevel(logging.ERROR)

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    headers = [(b"content-type", b"application/json")]
    if path == "/json":
        body = json.dumps({"sandbox_id": "sbx-0", "state": "running"}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/octet-stream")]})
    if path == "/replay":
        for i in range(0, len(REPLAY), 65536):
            await send({"type": "http.response.body", "body": REPLAY[i:i + 65536],
                        "more_body": True})
    elif path == "/lines":
        n = int(scope["query_string"].decode().split("=")[1])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", sys.argv[2].replace("N_LINES", str(n)),
            stdout=asyncio.subprocess.PIPE)
        while line := await proc.stdout.readline():
            await send({"type": "http.response.body", "body": line, "more_body": True})
        await proc.wait()
    await send({"type": "http.response.body", "body": b"", "more_body": False})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            loop="asyncio", access_log=False)
"""

# A child printing its clock, paced so each line is its own write.
LINES = (
    "import sys, time\n"
    "for _ in range(N_LINES):\n"
    "    print(repr(time.time()), flush=True)\n"
    "    time.sleep(0.003)\n"  # sleep-ok: the producer's pace; each line is its own write
)

# Writes 1 MB, then stays running (a reattach replays it from the daemon's log).
REPLAY_WRITER = (
    "import sys, time\n"
    "sys.stdout.write('r' * (1 << 20))\n"
    "sys.stdout.flush()\n"
    "time.sleep(600)\n"  # sleep-ok: keeps the process running while readers reattach
)


# -- one run of each figure ----------------------------------------------------------


async def sdk_lines(info: Any, lines: Lines) -> Lines:
    """P3: a child's printed lines, each to ``on_stdout``."""
    async with await AsyncSandbox.create(url=info.url, token=info.token) as sbx:
        script = LINES.replace("N_LINES", str(lines.n))
        h = await sbx.commands.run(
            [sys.executable, "-c", script], background=True, on_stdout=lines.line
        )
        await h.wait()
    return lines


async def bare_lines(port: int, lines: Lines) -> Lines:
    url = f"http://127.0.0.1:{port}/lines?n={lines.n}"
    async with httpx.AsyncClient() as http, http.stream("GET", url) as r:
        buf = b""
        async for data in r.aiter_raw():
            buf += data
            *got, buf = buf.split(b"\n")
            for line in got:
                lines.line(line)
    return lines


async def sdk_replay(info: Any, tries: int) -> list[float]:
    """P4: a reattach to a process that wrote 1 MB, to its first replayed byte."""
    out: list[float] = []
    async with await AsyncSandbox.create(url=info.url, token=info.token) as sbx:
        proc = await sbx.commands.start([sys.executable, "-c", REPLAY_WRITER])
        got = 0
        whole = asyncio.Event()

        def count(text: str) -> None:
            nonlocal got
            got += len(text)
            if got >= 1 << 20:
                whole.set()

        h = await sbx.commands.connect(proc.pid, cursor=0, on_stdout=count, lines=False)
        await asyncio.wait_for(whole.wait(), 30)
        await h.disconnect()
        for _ in range(tries):
            first = asyncio.Event()
            start = time.perf_counter()
            h = await sbx.commands.connect(
                proc.pid, cursor=0, on_stdout=lambda _t, e=first: e.set(), lines=False
            )
            await first.wait()
            out.append(time.perf_counter() - start)
            await h.disconnect()
    return out


async def bare_replay(port: int, tries: int) -> list[float]:
    out: list[float] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        for _ in range(tries):
            start = time.perf_counter()
            async with http.stream("GET", "/replay") as r:
                async for _data in r.aiter_raw():
                    out.append(time.perf_counter() - start)
                    break
    return out


async def sdk_unary(info: Any, tries: int) -> list[float]:
    """P5: one unary request (a sandbox's info)."""
    out: list[float] = []
    async with await AsyncSandbox.create(url=info.url, token=info.token) as sbx:
        await sbx.get_info()
        for _ in range(tries):
            start = time.perf_counter()
            await sbx.get_info()
            out.append(time.perf_counter() - start)
    return out


async def bare_unary(port: int, tries: int) -> list[float]:
    out: list[float] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        await http.get("/json")
        for _ in range(tries):
            start = time.perf_counter()
            (await http.get("/json")).json()
            out.append(time.perf_counter() - start)
    return out


async def create_first(info: Any, tries: int, pace: float) -> list[float]:
    """P5: ``create()`` and its first command, ``pace`` seconds after the last."""
    out = []
    for _ in range(tries):
        await asyncio.sleep(pace)  # sleep-ok: the time a person takes between sandboxes
        start = time.perf_counter()
        sbx = await AsyncSandbox.create(url=info.url, token=info.token)
        await sbx.commands.run(["true"])
        out.append(time.perf_counter() - start)
        await sbx.kill()
    return out


async def run_true(info: Any, tries: int) -> tuple[list[float], list[float]]:
    """P5: ``run(["true"])`` in a sandbox, and a spawn + wait of ``true`` here, in turns."""
    out: tuple[list[float], list[float]] = ([], [])
    async with await AsyncSandbox.create(url=info.url, token=info.token) as sbx:
        await sbx.commands.run(["true"])
        for _ in range(tries):
            start = time.perf_counter()
            await sbx.commands.run(["true"])
            out[0].append(time.perf_counter() - start)
            start = time.perf_counter()
            child = await asyncio.create_subprocess_exec("true")
            await child.wait()
            out[1].append(time.perf_counter() - start)
    return out


async def pause_resume(info: Any, tries: int) -> list[float]:
    """P5: ``pause()`` + ``resume()`` of a sandbox running 4 processes."""
    out = []
    async with await AsyncSandbox.create(url=info.url, token=info.token) as sbx:
        for _ in range(4):
            await sbx.commands.start(["sleep", "600"])
        for _ in range(tries):
            start = time.perf_counter()
            await sbx.pause()
            await sbx.resume()
            out.append(time.perf_counter() - start)
    return out
