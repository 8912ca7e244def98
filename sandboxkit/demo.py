"""``sandboxkit demo`` (the stall experiment) and ``sandboxkit tour`` (a walk through the
runtime), both on the embedded default daemon."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from sandboxkit.client.sync import Sandbox

__all__ = ["run_experiment", "run_tour"]

_WORKER = (
    "import sys, time\n"
    "for i in range({lines}):\n"
    "    print(f'line {{i:04d}}', flush=True)\n"
    "    time.sleep(0.01)\n"
)


class _Collector:
    """Counts the numbered lines one consumer received."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.text: list[str] = []
        self.changed = threading.Event()

    def __call__(self, text: str) -> None:
        self.text.append(text)
        self.changed.set()

    @property
    def lines(self) -> list[str]:
        return "".join(self.text).splitlines()

    def wait_lines(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.lines) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} got {len(self.lines)} of {n} lines")
            self.changed.wait(0.1)
            self.changed.clear()


def _say(text: str) -> None:
    print(text, flush=True)


def run_tour(lines: int = 120) -> int:
    """Create a sandbox, attach two consumers to a process, pause/resume, detach and
    reattach one from its cursor, then print what each received and the timeline."""
    _say("sandboxkit demo: starting (or finding) the local daemon ...")
    with Sandbox.create() as sbx:
        _say(f"sandbox {sbx.sandbox_id} created")
        first, second = _Collector("consumer A"), _Collector("consumer B")
        script = _WORKER.format(lines=lines)
        handle_a = sbx.commands.run(
            [sys.executable, "-u", "-c", script], background=True, on_stdout=first
        )
        pid = handle_a.pid
        handle_b = sbx.commands.connect(pid, cursor=0, on_stdout=second)
        _say(f"process {pid} writes {lines} numbered lines; consumers A and B attached")
        second.wait_lines(min(20, lines))

        sbx.pause()
        paused_at = len(first.lines)
        _say(f"paused at line {paused_at}: the whole process tree is frozen")
        sbx.resume()
        _say("resumed")

        cursor = handle_b.cursor
        handle_b.disconnect()
        _say(f"B detached at cursor {cursor}; output keeps being recorded")
        first.wait_lines(min(len(first.lines) + 20, lines))
        handle_b = sbx.commands.connect(pid, cursor=cursor, on_stdout=second)
        _say(f"B reattached from cursor {cursor}")

        result = handle_a.wait()
        handle_b.wait()
        summary = pd.DataFrame(
            [
                {
                    "consumer": c.name,
                    "lines": len(c.lines),
                    "first": c.lines[0] if c.lines else "",
                    "last": c.lines[-1] if c.lines else "",
                    "complete and in order": c.lines == [f"line {i:04d}" for i in range(lines)],
                }
                for c in (first, second)
            ]
        )
        _say(f"\nprocess {pid} exited with code {result.exit_code}\n")
        _say(summary.to_string(index=False))
        events = sbx.events()
        _say("\nevent timeline:")
        timeline = events.assign(time=events["time"].dt.strftime("%H:%M:%S.%f").str[:-3])
        _say(timeline[["time", "kind", "pid", "reason"]].to_string(index=False))
        _say("\nconsumers:")
        _say(
            sbx.consumers()[
                ["name", "state", "cursor", "head", "lag_bytes", "bytes_sent"]
            ].to_string(index=False)
        )
        ok = bool(summary["complete and in order"].all())
    _say("\nsandbox killed; the daemon keeps running (`sandboxkit stop` ends it)")
    return 0 if ok else 1


def run_experiment(
    cycles: int = 6,
    policies: Sequence[str] = ("blocking", "kick", "cursor"),
    ghosts: Sequence[str] = ("pause-snapshot",),
    out: Path = Path("demo-output"),
    *,
    deadline: float = 3.0,
    kick_grace: float | None = None,
    progress: bool = True,
) -> int:
    """The main job: reproduce the stall under each fan-out policy, print the stall table,
    and write the per-cycle CSV and a PNG of the stall rates into ``out``."""
    from sandboxkit.lab.experiment import compare
    from sandboxkit.lab.plots import plot_cycle_timeline, plot_stall_rates, save_figure
    from sandboxkit.lab.stats import format_stall_table, stall_table

    _say(
        f"sandboxkit demo: {cycles} pause/resume/reattach cycles x "
        f"{', '.join(policies)} with {', '.join(ghosts)} ghosts (deadline {deadline}s)"
    )
    frame = asyncio.run(
        compare(
            policies,
            ghosts,
            cycles,
            progress=progress,
            deadline=deadline,
            kick_grace=kick_grace,
        )
    )
    table = stall_table(frame)
    _say("\n" + format_stall_table(table))
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "cycles.csv"
    frame.to_csv(csv_path, index=False)
    table.to_csv(out / "stall_table.csv", index=False)
    png = out / "stall_rates.png"
    save_figure(plot_stall_rates(table), png)
    save_figure(plot_cycle_timeline(frame), out / "timeline.png")
    _say(f"\nwrote {csv_path}, {out / 'stall_table.csv'}, {png} and {out / 'timeline.png'}")
    return 0
