"""``sandboxkit demo``: a tour of the runtime on the embedded default daemon."""

from __future__ import annotations

import sys
import threading
import time

import pandas as pd

from sandboxkit.client.sync import Sandbox

__all__ = ["run_tour"]

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
            sbx.consumers()[["name", "state", "cursor", "head", "lag_bytes", "bytes_sent"]]
            .to_string(index=False)
        )
        ok = bool(summary["complete and in order"].all())
    _say("\nsandbox killed; the daemon keeps running (`sandboxkit stop` ends it)")
    return 0 if ok else 1
