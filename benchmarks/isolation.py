"""What isolation costs: the same daemon, sandboxes with and without namespaces, in one
run, in interleaved rounds (a slow spell on a noisy machine lands on both alike).

- create + first command (``run(["true"])``), p50 per round;
- a command in a running sandbox (``run(["true"])`` again), p50 per round, beside an
  asyncio spawn + wait of ``true`` in this process (issue 22's anchor);
- pause + resume of a sandbox running 4 processes, p50 per round, and of a second
  unisolated one (an A/A: how far apart two alike sandboxes measure, what "nothing
  measurable" is judged against); the 4 started right after ``create()`` (the first
  starts before the sandbox's launcher is up, through bubblewrap of its own), and again
  started 0.2 s after it, as in a notebook (all through the launcher);
- fan-out: one process writing ``--mb`` MiB (``head -c``, no interpreter path needed),
  read by 4 SDK consumers at once; seconds per round.

Printed as ratios namespaces / none with the absolute figures; the targets
(docs/isolation.md): create + first command ≤ +5 ms, pause + resume and fan-out not
measurably different (ratio ≈ 1).

    python3 benchmarks/isolation.py [--rounds 5] [--tries 20] [--mb 64] [--json]
                                    [--unprivileged]

``--unprivileged`` (as root): the daemon runs as ``nobody``, as most people run it (the
escape suite's own way, ``tests/unprivileged.py``); a root daemon's launches also drop to
``nobody`` first, one exec more.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _daemon import local_daemon

from sandboxkit import AsyncSandbox
from sandboxkit.daemon.isolation import probe

MODES = ("none", "namespaces")


async def create_first(info: Any, mode: str, tries: int) -> float:
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        sbx = await AsyncSandbox.create(url=info.url, token=info.token, isolation=mode)  # type: ignore[arg-type]
        await sbx.commands.run(["true"])
        times.append(time.perf_counter() - start)
        await sbx.kill()
    return statistics.median(times)


async def run_true(info: Any, mode: str, tries: int) -> float:
    times = []
    async with await AsyncSandbox.create(url=info.url, token=info.token, isolation=mode) as sbx:  # type: ignore[arg-type]
        await sbx.commands.run(["true"])
        for _ in range(tries):
            start = time.perf_counter()
            await sbx.commands.run(["true"])
            times.append(time.perf_counter() - start)
    return statistics.median(times)


async def spawn_wait(tries: int) -> float:
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        child = await asyncio.create_subprocess_exec("true")
        await child.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def pause_resume(info: Any, mode: str, tries: int, later: float = 0.0) -> float:
    times = []
    async with await AsyncSandbox.create(url=info.url, token=info.token, isolation=mode) as sbx:  # type: ignore[arg-type]
        await asyncio.sleep(later)  # sleep-ok: the pause before a first command, if asked
        for _ in range(4):
            await sbx.commands.start(["sleep", "600"])
        # Paused as a person pauses a sandbox, its processes up, not mid-start (an isolated
        # launch's bwrap leaves the sandbox's cgroup 5 ms in: docs/isolation.md).
        await asyncio.sleep(0.05)  # sleep-ok: the steady state is what is measured
        for _ in range(tries):
            start = time.perf_counter()
            await sbx.pause()
            await sbx.resume()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


async def fanout(info: Any, mode: str, mb: int) -> float:
    async with await AsyncSandbox.create(url=info.url, token=info.token, isolation=mode) as sbx:  # type: ignore[arg-type]
        start = time.perf_counter()
        writer = await sbx.commands.start(["sh", "-c", f"read go; head -c {mb << 20} /dev/zero"])
        got = [0] * 4

        def counter(i: int) -> Any:
            def count(data: bytes) -> None:
                got[i] += len(data)

            return count

        handles = [
            await sbx.commands.connect(
                writer.pid, cursor=0, on_stdout_bytes=counter(i), keep_output=0
            )
            for i in range(4)
        ]
        await sbx.commands.send_stdin(writer.pid, "\n")
        await asyncio.gather(*(h.wait() for h in handles))
        elapsed = time.perf_counter() - start
        assert got == [mb << 20] * 4, f"lost bytes: {got}"
        return elapsed


@contextlib.contextmanager
def _daemon(unprivileged: bool, *serve_args: str) -> Iterator[Any]:
    """The daemon measured: this user's, or (``unprivileged``, as root) ``nobody``'s."""
    if not unprivileged:
        with local_daemon(*serve_args) as (_, info):
            yield info
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from unprivileged import can_run_unprivileged, served_unprivileged

    why = can_run_unprivileged()
    if why:
        raise SystemExit(f"--unprivileged: {why}")
    with served_unprivileged(*serve_args) as served:
        yield served


def rounds_parser(doc: str, rounds: int, tries: int) -> argparse.ArgumentParser:
    """The options of a script measuring daemons in rounds: ``--rounds``, ``--tries`` (per
    figure and round), ``--json`` and ``--unprivileged`` (the daemons as ``nobody``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--tries", type=int, default=tries)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--unprivileged", action="store_true", help="the daemons as nobody")
    return parser


def main() -> None:
    parser = rounds_parser(__doc__, rounds=5, tries=20)
    parser.add_argument("--mb", type=int, default=64)
    args = parser.parse_args()
    if not probe().available:
        raise SystemExit(f"no namespaces here: {probe().reason}")
    figures: dict[str, dict[str, list[float]]] = {
        name: {m: [] for m in MODES}
        for name in (
            "create_first_ms",
            "run_true_ms",
            "pause_resume_ms",
            "pause_resume_later_ms",
            "fanout_s",
        )
    }
    spawns: list[float] = []
    again: list[float] = []  # pause + resume of a second unisolated sandbox: the A/A
    retention = str((args.mb + 8) << 20)
    # No spare sandbox (daemon/spare.py): it serves one isolation only, the daemon's
    # default, and this compares what a sandbox made for the create costs either way.
    with _daemon(args.unprivileged, "--retention-bytes", retention, "--spare", "off") as info:
        for r in range(args.rounds + 1):  # round 0 warms up
            order = MODES if r % 2 else MODES[::-1]
            for mode in order:
                cf = asyncio.run(create_first(info, mode, args.tries)) * 1e3
                rt = asyncio.run(run_true(info, mode, args.tries)) * 1e3
                pr = asyncio.run(pause_resume(info, mode, args.tries)) * 1e3
                prl = asyncio.run(pause_resume(info, mode, args.tries, later=0.2)) * 1e3
                fo = asyncio.run(fanout(info, mode, args.mb))
                if r:
                    figures["create_first_ms"][mode].append(cf)
                    figures["run_true_ms"][mode].append(rt)
                    figures["pause_resume_ms"][mode].append(pr)
                    figures["pause_resume_later_ms"][mode].append(prl)
                    figures["fanout_s"][mode].append(fo)
            if r:
                spawns.append(asyncio.run(spawn_wait(args.tries)) * 1e3)
                again.append(asyncio.run(pause_resume(info, "none", args.tries)) * 1e3)
    summary = {
        name: {
            "none": statistics.median(by["none"]),
            "namespaces": statistics.median(by["namespaces"]),
            "ratio": statistics.median(by["namespaces"]) / statistics.median(by["none"]),
            "added": statistics.median(by["namespaces"]) - statistics.median(by["none"]),
        }
        for name, by in figures.items()
    }
    spawn = statistics.median(spawns)
    summary["run_true_ms"]["spawn"] = spawn
    # What "nothing measurable" is judged against: two unisolated sandboxes differ by this.
    summary["pause_resume_ms"]["aa_added"] = (
        statistics.median(again) - summary["pause_resume_ms"]["none"]
    )
    if args.json:
        print(json.dumps(summary))
        return
    print(f"{'figure':28} {'none':>10} {'namespaces':>11} {'ratio':>7} {'added':>9}")
    for name, s in summary.items():
        print(
            f"{name:28} {s['none']:10.3f} {s['namespaces']:11.3f} {s['ratio']:7.2f}"
            f" {s['added']:+9.3f}"
        )
    run = summary["run_true_ms"]
    print(
        "pause + resume of another unisolated sandbox (A/A): "
        f"{summary['pause_resume_ms']['aa_added']:+.3f} ms"
    )
    print(
        f"asyncio spawn + wait of true: {spawn:.3f} ms; run(['true']) is "
        f"{run['none'] / spawn:.2f}x it without isolation, {run['namespaces'] / spawn:.2f}x with"
    )


if __name__ == "__main__":
    main()
