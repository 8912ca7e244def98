"""Where the time of one ``run(["true"])`` goes, step by step (issue 22: a command as
cheap as a spawn).

A daemon of this checkout runs in its own process with a mark at each step of a command
(the marks wrap the daemon's own functions from outside, here; nothing in the package
knows of them), on the clock the client reads too (``time.perf_counter``: the system's
monotonic clock). The client runs ``--commands`` commands, one after another, in one
unisolated sandbox whose launcher is up; each step's time is counted from the client's
call, and the p50 of each is printed in order:

- ``request``: the daemon's route is called (the client's request built and sent, the
  daemon woken, its HTTP parsed);
- ``process made``, ``launch prepared``, ``asked the launcher``: the daemon's work
  before the launcher is asked to fork;
- ``launcher answered``: its answer (the pidfd) read; ``pipes joined``: the command's
  pipes on the daemon's loop; ``first frame sent``: the response's head and ``start``
  frame written;
- ``pipes closed``, ``exit heard``, ``log finished``, ``last frame sent``, ``body
  ended``: the command's end as the daemon sees it;
- ``client returned``.

With ``perf`` (and the right to trace), the command's own exec and exit are read from
the kernel's scheduler tracepoints on the same clock (``perf record -k CLOCK_MONOTONIC``)
and placed among the steps; and, in a second pass, beside an asyncio spawn of ``true``
in this process: fork to exec, exec to exit of each.

Last, what a hand-off between two processes costs here (a command's path crosses several:
client, daemon, launcher, command, and back): a one-byte pipe round trip between this
process and a child, p50, the two on whatever CPUs the scheduler picks and both pinned to
one CPU.

    python3 benchmarks/command_timeline.py [--commands 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _daemon import started

from sandboxkit import AsyncSandbox

MARKS = """
import asyncio, functools, json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
marks = []
def mark(name):
    marks.append((name, time.perf_counter()))
def around(owner, name, before=None, after=None):
    inner = getattr(owner, name)
    if asyncio.iscoroutinefunction(inner):
        async def outer(*a, **k):
            before and mark(before)
            result = await inner(*a, **k)
            after and mark(after)
            return result
    else:
        def outer(*a, **k):
            before and mark(before)
            result = inner(*a, **k)
            after and mark(after)
            return result
    setattr(owner, name, functools.wraps(inner)(outer))
from sandboxkit.daemon import launcher, output_log, process, spawn
from sandboxkit.daemon.http import fast_path, routes
around(routes.Api, "start_stream", "request")
around(process.ManagedProcess, "_start_via", "process made")
direct = process.direct
def marked_direct(*a, **k):
    launch = direct(*a, **k)
    mark("launch prepared")
    return launch
process.direct = marked_direct
around(spawn.Pipes, "__init__", after="asked the launcher")
message = launcher.Launcher._message
def marked_message(self, kind, *a):
    mark({ord("S"): "launcher answered", ord("X"): "exit heard"}.get(kind, "other"))
    return message(self, kind, *a)
launcher.Launcher._message = marked_message
around(launcher.Launcher, "spawn", after="pipes joined")
closed = spawn.Child._output_closed
def marked_closed(self):
    closed(self)
    if self._open_outputs == 0:
        mark("pipes closed")
spawn.Child._output_closed = marked_closed
around(output_log.OutputLog, "finish", "log finished")
around(fast_path.AsgiSink, "send_parts", "frame sent")
around(fast_path.AsgiSink, "close", after="body ended")
from sandboxkit.cli import main
try:
    main(sys.argv[1:])
finally:
    with open(os.environ["MARKS_OUT"], "w") as out:
        json.dump(marks, out)
"""

ORDER = [
    "request",
    "process made",
    "launch prepared",
    "asked the launcher",
    "launcher answered",
    "command exec",
    "pipes joined",
    "first frame sent",
    "command exit",
    "pipes closed",
    "exit heard",
    "log finished",
    "last frame sent",
    "body ended",
    "client returned",
]


SCHED_EVENTS = ["sched:sched_process_fork", "sched:sched_process_exec", "sched:sched_process_exit"]
_EVENT = re.compile(r"(\S+)\s+(\d+)\s+\[\d+\]\s+([\d.]+):\s+sched:(\w+): (.*)")


def perf_record(trace: Path, clock: str | None = None) -> list[str]:
    """perf recording the scheduler's process events of the whole machine to ``trace``."""
    record = ["perf", "record", *(["-k", clock] if clock else []), "-a", "-o", str(trace)]
    for event in SCHED_EVENTS:
        record += ["-e", event]
    return record


def events(trace: Path) -> list[tuple[str, str, int, float, str]]:
    """perf's records in ``trace``: (comm, event, pid, time in s, the rest)."""
    script = subprocess.run(
        ["perf", "script", "-i", str(trace)], capture_output=True, text=True, check=False
    ).stdout
    found = (_EVENT.search(line) for line in script.splitlines())
    return [(m[1], m[4], int(m[2]), float(m[3]), m[5]) for m in found if m is not None]


async def drive(
    url: str, token: str, commands: int, trace: Path | None
) -> list[tuple[float, float]]:
    """``commands`` calls of ``run(["true"])``, each (start, end) on the monotonic clock;
    with a ``trace``, perf records the scheduler's process events to it meanwhile."""
    calls = []
    async with await AsyncSandbox.create(url=url, token=token) as sbx:
        for _ in range(100):  # its launcher up, the caches warm
            await sbx.commands.run(["true"])
        perf = None
        if trace is not None:
            record = perf_record(trace, clock="CLOCK_MONOTONIC")
            perf = await asyncio.create_subprocess_exec(*record, stderr=subprocess.DEVNULL)
            await asyncio.sleep(1)  # sleep-ok: perf's set-up, which says nothing when done
        try:
            for _ in range(commands):
                start = time.perf_counter()
                await sbx.commands.run(["true"])
                calls.append((start, time.perf_counter()))
        finally:
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                await perf.wait()
    return calls


def command_marks(trace: Path) -> list[tuple[str, float]]:
    """Each command's (``true``'s) exec and exit, as marks on the monotonic clock."""
    marks = []
    for comm, event, _pid, at, rest in events(trace):
        if event == "sched_process_exec" and rest.split(" ", 1)[0].endswith("/true"):
            marks.append(("command exec", at))
        elif event == "sched_process_exit" and comm == "true":
            marks.append(("command exit", at))
    return marks


def steps(marks: list[tuple[str, float]], calls: list[tuple[float, float]]) -> dict[str, float]:
    """Each step's p50, in ms from the client's call."""
    times = [t for _, t in marks]
    seen: dict[str, list[float]] = {}
    for start, end in calls:
        one: dict[str, float] = {}
        frames = 0
        for name, t in marks[bisect.bisect_left(times, start) : bisect.bisect_right(times, end)]:
            if name == "frame sent":
                frames += 1
                name = "first frame sent" if frames == 1 else "last frame sent"
            one.setdefault(name, (t - start) * 1e3)
        one["client returned"] = (end - start) * 1e3
        for name, ms in one.items():
            seen.setdefault(name, []).append(ms)
    return {name: statistics.median(seen[name]) for name in ORDER if name in seen}


def sched(commands: int) -> dict[str, tuple[float, float]] | None:
    """Fork → exec → exit of ``true``, p50 in ms, by the parent that forked it: the
    launcher (a daemon's command) and this process (an asyncio spawn)."""
    if shutil.which("perf") is None:
        return None
    with tempfile.TemporaryDirectory(prefix="sbx-timeline-") as tmp:
        data = Path(tmp) / "sched.data"

        async def both(url: str, token: str) -> None:
            async with await AsyncSandbox.create(url=url, token=token) as sbx:
                for _ in range(50):
                    await sbx.commands.run(["true"])
                record = perf_record(data)
                perf = await asyncio.create_subprocess_exec(*record, stderr=subprocess.DEVNULL)
                await asyncio.sleep(1)  # sleep-ok: perf's set-up, which says nothing when done
                for _ in range(commands):
                    await sbx.commands.run(["true"])
                    child = await asyncio.create_subprocess_exec("true")
                    await child.wait()
                perf.send_signal(signal.SIGINT)
                await perf.wait()

        with MarkedDaemon() as (url, token):
            asyncio.run(both(url, token))
        recorded = events(data)
    forked: dict[int, tuple[str, float]] = {}
    execed: dict[int, float] = {}
    spans: dict[str, tuple[list[float], list[float]]] = {}
    for comm, event, pid, at, rest in recorded:
        if event == "sched_process_fork":
            child_pid = int(re.findall(r"child_pid=(\d+)", rest)[0])
            parent = "this process" if comm.startswith("python") else "the launcher"
            forked[child_pid] = (parent, at)
        elif event == "sched_process_exec" and pid in forked:
            execed[pid] = at
        elif event == "sched_process_exit" and pid in execed:
            parent, fork_at = forked[pid]
            exec_at = execed.pop(pid)
            pair = spans.setdefault(parent, ([], []))
            pair[0].append((exec_at - fork_at) * 1e3)
            pair[1].append((at - exec_at) * 1e3)
    return {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in spans.items()}


def round_trip(times: int, cpu: int | None = None) -> float:
    """p50 of a one-byte pipe round trip with a forked child, in µs (``cpu``: both on it)."""
    ping, pong = os.pipe(), os.pipe()
    everywhere = os.sched_getaffinity(0)
    child = os.fork()
    if child == 0:  # the child echoes each byte back
        try:
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            for _ in range(times):
                os.write(pong[1], os.read(ping[0], 1))
        finally:
            os._exit(0)
    took = []
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        for _ in range(times):
            start = time.perf_counter()
            os.write(ping[1], b"x")
            os.read(pong[0], 1)
            took.append(time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, everywhere)
        os.waitpid(child, 0)
        for fd in (*ping, *pong):
            os.close(fd)
    return statistics.median(took) * 1e6


class MarkedDaemon:
    """The daemon, its marks on, its state in a directory of its own; once it has
    stopped, its marks are in :attr:`result`."""

    def __enter__(self) -> tuple[str, str]:
        self._dir = tempfile.TemporaryDirectory(prefix="sbx-timeline-")
        state_path = Path(self._dir.name) / "daemon.json"
        self.marks = Path(self._dir.name) / "marks.json"
        env = {**os.environ, "SANDBOXKIT_ISOLATION": "none", "MARKS_OUT": str(self.marks)}
        self._process = subprocess.Popen(
            [sys.executable, "-c", MARKS, "serve", "--state-file", str(state_path)],
            stdout=subprocess.DEVNULL,
            env=env,
        )
        state = started(self._process, state_path)
        return state.url, state.token or ""

    def __exit__(self, *exc: object) -> None:
        self._process.send_signal(signal.SIGTERM)
        self._process.wait(30)
        self.result: list[tuple[str, float]] = (
            json.loads(self.marks.read_text()) if self.marks.exists() else []
        )
        self._dir.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commands", type=int, default=1000)
    args = parser.parse_args()
    daemon = MarkedDaemon()
    with tempfile.TemporaryDirectory(prefix="sbx-timeline-") as tmp:
        trace = Path(tmp) / "timeline.data" if shutil.which("perf") else None
        with daemon as (url, token):
            calls = asyncio.run(drive(url, token, args.commands, trace))
        marks = daemon.result + (command_marks(trace) if trace and trace.exists() else [])
    marks.sort(key=lambda mark: mark[1])
    for name, ms in steps(marks, calls).items():
        print(f"{ms:7.3f} ms  {name}")
    processes = sched(min(args.commands, 300))
    if processes:
        print("the process itself (perf's scheduler tracepoints), p50:")
        for parent, (to_exec, to_exit) in processes.items():
            print(
                f"  forked by {parent}: fork → exec {to_exec:.3f} ms, exec → exit {to_exit:.3f} ms"
            )
    across, alone = round_trip(5000), round_trip(5000, cpu=min(os.sched_getaffinity(0)))
    print(f"a pipe round trip between two processes, p50: {across:.1f} µs (one CPU: {alone:.1f})")


if __name__ == "__main__":
    main()
