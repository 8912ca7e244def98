"""What a sandbox's launcher, or its shell standby, buys a command: each and neither, in
one run.

Three daemons of this checkout, measured in interleaved rounds, without and with
isolation: ``--standby on`` (the default: a launcher in each sandbox that forks its
commands, sandboxkit/daemon/launcher.py), ``--standby shell`` (the next launch started
ahead, a shell that one command takes, sandboxkit/daemon/standby.py) and ``--standby
off`` (the baseline):

- ``run(["true"])`` in a running sandbox, back to back (``4 × --tries``), p50 per round;
- the same at a notebook's pace (``--pace`` seconds between commands: what a person
  reading the last output leaves), p50 per round;
- ``create()`` + first command, p50 per round;

beside an asyncio spawn + wait of ``true`` in this process (issue 22's anchor). Printed as
on / off and shell / off ratios with the absolute figures, the median of the rounds.

    python3 benchmarks/standby.py [--rounds 4] [--tries 15] [--pace 0.5] [--json]
                                  [--unprivileged]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from typing import Any

from isolation import _daemon, create_first, rounds_parser, run_true, spawn_wait

from sandboxkit import AsyncSandbox
from sandboxkit.daemon.isolation import probe

DAEMONS = ("on", "shell", "off")


async def paced_run(info: Any, mode: str, tries: int, pace: float) -> float:
    times = []
    async with await AsyncSandbox.create(url=info.url, token=info.token, isolation=mode) as sbx:  # type: ignore[arg-type]
        for _ in range(tries):
            await asyncio.sleep(pace)  # sleep-ok: the pause a person leaves between commands
            start = time.perf_counter()
            await sbx.commands.run(["true"])
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = rounds_parser(__doc__, rounds=4, tries=15)
    parser.add_argument("--pace", type=float, default=0.5)
    args = parser.parse_args()
    modes = ["none", "namespaces"] if probe().available else ["none"]
    figures: dict[str, dict[str, list[float]]] = {}

    def note(name: str, daemon: str, value: float) -> None:
        figures.setdefault(name, {d: [] for d in DAEMONS})[daemon].append(value * 1e3)

    with contextlib.ExitStack() as stack:
        # No spare sandbox (daemon/spare.py, compare.py's P5 measures it): each create
        # here makes its sandbox, whichever isolation it asks for.
        daemons = {
            d: stack.enter_context(_daemon(args.unprivileged, "--standby", d, "--spare", "off"))
            for d in DAEMONS
        }
        anchor = []
        for round_ in range(args.rounds):
            order = DAEMONS[round_ % 3 :] + DAEMONS[: round_ % 3]
            anchor.append(asyncio.run(spawn_wait(args.tries)) * 1e3)
            for daemon in order:
                info = daemons[daemon]
                for mode in modes:
                    runs = {
                        # Four times the tries: a command is short, and its p50 noisy.
                        f"run, back to back, {mode}": run_true(info, mode, 4 * args.tries),
                        f"run, {args.pace} s apart, {mode}": paced_run(
                            info, mode, args.tries, args.pace
                        ),
                        f"create + first, {mode}": create_first(info, mode, args.tries),
                    }
                    for name, measure in runs.items():
                        note(name, daemon, asyncio.run(measure))
    result: dict[str, Any] = {"anchor_spawn_wait_ms": statistics.median(anchor)}
    for name, by in figures.items():
        p50 = {d: statistics.median(by[d]) for d in DAEMONS}
        result[name] = {
            **{f"{d}_ms": p50[d] for d in DAEMONS},
            "ratio": p50["on"] / p50["off"],
            "shell_ratio": p50["shell"] / p50["off"],
            "rounds": by,
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    spawn = result["anchor_spawn_wait_ms"]
    print(
        f"{'figure (p50, ms)':34} {'launcher':>9} {'shell':>7} {'off':>7} {'on/off':>7}"
        f" {'shell/off':>9} {'on/spawn':>9}"
    )
    for name, fig in result.items():
        if isinstance(fig, dict):
            print(
                f"{name:34} {fig['on_ms']:9.2f} {fig['shell_ms']:7.2f} {fig['off_ms']:7.2f}"
                f" {fig['ratio']:7.2f} {fig['shell_ratio']:9.2f} {fig['on_ms'] / spawn:9.2f}"
            )
    print(f"anchor: asyncio spawn + wait of true {spawn:.2f} ms")


if __name__ == "__main__":
    main()
