"""How long the daemon's garbage collector holds it, as results pile up.

A daemon keeps every exited command's result for ``result_ttl`` (15 minutes by default):
a notebook's loop of commands leaves thousands. Python's collector then walks every
object the daemon holds in each full collection, and the daemon serves nothing
meanwhile. This runs ``--commands`` ``run(["true"])`` in one sandbox and reads, from
inside the daemon (``gc.callbacks``, installed before it starts), each collection's
pause: the longest full collection, and the collector's time per command, at each
``--step`` commands kept. With ``--baseline-daemon DIR``, another checkout's daemon is
measured the same way, in turns.

    python3 benchmarks/gc_pause.py [--commands 3000] [--step 1000] [--baseline-daemon DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _daemon import started

from sandboxkit import AsyncSandbox

HOOK = """
import gc, json, os, signal, sys, time
pauses = []
started = [0.0]
def timed(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        pauses.append((info["generation"], time.perf_counter() - started[0]))
gc.callbacks.append(timed)
def report(*_):
    with open(os.environ["GC_OUT"], "w") as out:
        json.dump({"pauses": pauses, "objects": len(gc.get_objects())}, out)
signal.signal(signal.SIGUSR1, report)
from sandboxkit.cli import main
main(["serve", "--state-file", sys.argv[1]])
"""


def read(process: subprocess.Popen[bytes], out: Path) -> dict[str, Any]:
    out.unlink(missing_ok=True)
    process.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not out.exists() or not out.stat().st_size:
        if time.monotonic() > deadline:
            raise RuntimeError("the daemon did not report")
        time.sleep(0.02)  # sleep-ok: polling for the report's file
    time.sleep(0.05)  # sleep-ok: the report written whole (one write)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


async def commands(url: str, token: str, count: int) -> None:
    async with await AsyncSandbox.create(url=url, token=token, timeout=3600) as sbx:
        for _ in range(count):
            await sbx.commands.run(["true"])


def measure(cwd: Path | None, total: int, step: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="sbx-gc-") as tmp:
        state_path, out = Path(tmp) / "daemon.json", Path(tmp) / "gc.json"
        env = {**os.environ, "GC_OUT": str(out), "SANDBOXKIT_ISOLATION": "none"}
        process = subprocess.Popen(
            [sys.executable, "-c", HOOK, str(state_path)], cwd=cwd, env=env,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            state = started(process, state_path)
            rows, seen = [], len(read(process, out)["pauses"])  # (those of its start: not)
            for kept in range(step, total + 1, step):
                asyncio.run(commands(state.url, state.token or "", step))
                report = read(process, out)
                new = report["pauses"][seen:]
                seen = len(report["pauses"])
                full = [p for g, p in new if g == 2]
                rows.append({
                    "kept": kept,
                    "objects": report["objects"],
                    "longest_full_ms": round(max(full, default=0.0) * 1e3, 1),
                    "full_collections": len(full),
                    "gc_ms_per_command": round(sum(p for _, p in new) * 1e3 / step, 3),
                })  # fmt: skip
            return rows
        finally:
            process.terminate()
            process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commands", type=int, default=3000)
    parser.add_argument("--step", type=int, default=1000)
    parser.add_argument("--baseline-daemon", type=Path)
    args = parser.parse_args()
    daemons: list[tuple[str, Path | None]] = [("this checkout", None)]
    if args.baseline_daemon is not None:
        daemons.insert(0, ("baseline", args.baseline_daemon.resolve()))
    for name, cwd in daemons:
        print(name)
        for row in measure(cwd, args.commands, args.step):
            print(
                f"  {row['kept']:6d} results kept: {row['objects']:7d} objects, longest full "
                f"collection {row['longest_full_ms']:6.1f} ms ({row['full_collections']} "
                f"full), collector {row['gc_ms_per_command']:.3f} ms per command"
            )


if __name__ == "__main__":
    main()
