"""``sandboxkit demo`` (the stall experiment) and ``sandboxkit tour`` (a walk through the
runtime), each on a private daemon that it stops at exit."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pandas as pd

from sandboxkit.client.local import spawn_daemon
from sandboxkit.client.sync import Sandbox
from sandboxkit.lab_options import FANOUT_POLICIES
from sandboxkit.statefile import DaemonState

__all__ = ["private_daemon", "run_experiment", "run_tour"]

_WORKER = (
    "import sys, time\n"
    "for i in range({lines}):\n"
    "    print(f'line {{i:04d}}', flush=True)\n"
    "    time.sleep(0.01)\n"
)


class _Collector:
    """The numbered lines one consumer received (its ``on_stdout``: one call per line)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lines: list[str] = []
        self.changed = threading.Event()

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self.changed.set()

    def wait_lines(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.lines) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} got {len(self.lines)} of {n} lines")
            self.changed.wait(0.1)
            self.changed.clear()


def _say(text: str) -> None:
    print(text, flush=True)


@contextlib.contextmanager
def private_daemon() -> Iterator[DaemonState]:
    """A daemon of this run's own, in a temporary directory, stopped (and its sandboxes
    killed) on exit — so a demo leaves nothing running and never touches the daemon your
    notebooks use."""
    folder = Path(tempfile.mkdtemp(prefix="sandboxkit-demo-"))
    try:
        state = spawn_daemon(folder / "daemon.json")
        try:
            yield state
        finally:
            _stop(state.pid)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _stop(pid: int, timeout: float = 20.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)  # sleep-ok: poll interval while the daemon shuts down
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def run_tour(lines: int = 120, *, url: str | None = None, token: str | None = None) -> int:
    """Create a sandbox, attach two consumers to a process, pause/resume, detach and
    reattach one from its cursor, then print what each received and the timeline.
    Without ``url``, on a private daemon stopped at the end."""
    if url is not None:
        return _tour(lines, url, token)
    with private_daemon() as state:
        _say(f"on a private daemon, pid {state.pid} at {state.url}, stopped at the end")
        code = _tour(lines, state.url, state.token)
    _say("daemon stopped; nothing is left running")
    return code


def _tour(lines: int, url: str, token: str | None) -> int:
    # Unisolated: the worker is this interpreter by its path, which a namespaced
    # sandbox of a root daemon cannot reach (docs/isolation.md); the tour is about cursors.
    with Sandbox.create(url=url, token=token, isolation="none") as sbx:
        _say(f"sandbox {sbx.sandbox_id} created")
        first, second = _Collector("consumer A"), _Collector("consumer B")
        script = _WORKER.format(lines=lines)
        handle_a = sbx.commands.run(
            [sys.executable, "-u", "-c", script], background=True, on_stdout=first
        )
        pid = handle_a.pid
        handle_b = sbx.commands.connect(pid, cursor=0, on_stdout=second)
        _say(
            f"process {pid} prints {lines} numbered lines; consumers A and B follow it "
            "from cursor 0 (a cursor counts output chunks)"
        )
        second.wait_lines(min(20, lines))

        sbx.pause()
        _say(f"paused: the whole process tree is frozen (A has {len(first.lines)} lines)")
        sbx.resume()
        _say("resumed")

        # disconnect() returns the cursor after the last chunk B received: reading
        # handle_b.cursor before it would miss a chunk arriving in between.
        cursor = handle_b.disconnect()
        _say(f"B detached at cursor {cursor}; the daemon keeps recording the output")
        first.wait_lines(min(len(first.lines) + 20, lines))
        handle_b = sbx.commands.connect(pid, cursor=cursor, on_stdout=second)
        _say(f"B reattached at cursor {cursor}: it gets what it missed, once")

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
        shown = timeline[["time", "kind", "pid", "reason"]].astype(object)
        _say(shown.where(shown.notna(), "").to_string(index=False))
        _say("\nconsumers:")
        _say(
            sbx.consumers()[
                ["name", "state", "cursor", "head", "lag_bytes", "bytes_sent"]
            ].to_string(index=False)
        )
        ok = bool(summary["complete and in order"].all())
    _say(f"\nsandbox {sbx.sandbox_id} killed")
    return 0 if ok else 1


def run_experiment(
    cycles: int = 6,
    policies: Sequence[str] = FANOUT_POLICIES,
    ghosts: Sequence[str] = ("pause-snapshot",),
    out: Path = Path("demo-output"),
    *,
    deadline: float = 3.0,
    kick_grace: float | None = None,
    progress: bool = True,
    client: str = "sandboxkit",
) -> int:
    """The main job: reproduce the stall under each fan-out policy, print the stall table,
    and write the per-cycle CSV and a PNG of the stall rates into ``out``. With
    ``client="e2b"`` the official e2b SDK is the client (through the envd endpoint of an
    in-process daemon; pause-snapshot ghosts only)."""
    from sandboxkit.lab.stats import stall_table

    if client == "e2b":
        ghosts = ("pause-snapshot",)  # what envd leaves behind; the SDK makes no other
    _say(
        f"{cycles} pause/resume/reattach cycles x {', '.join(policies)} with "
        f"{', '.join(ghosts)} ghosts (deadline {deadline}s), client: {client}"
    )
    if client == "e2b":
        frame = _e2b_frame(cycles, policies, deadline=deadline, kick_grace=kick_grace)
    else:
        frame = _frame(cycles, policies, ghosts, deadline, kick_grace, progress)
    table = stall_table(frame)
    return _report(frame, table, out)


def _e2b_frame(
    cycles: int, policies: Sequence[str], *, deadline: float, kick_grace: float | None
) -> pd.DataFrame:
    from sandboxkit.daemon.server import DaemonServer
    from sandboxkit.lab.e2b_reattach import compare_e2b

    with DaemonServer(envd_port=0) as server:
        assert server.envd is not None
        _say(f"the e2b SDK in debug mode, via the envd endpoint on port {server.envd.port}")
        return asyncio.run(
            compare_e2b(
                policies,
                cycles,
                url=server.url,
                token=server.token,
                envd_url=server.envd.url,
                deadline=deadline,
                kick_grace=kick_grace,
            )
        )


def _frame(
    cycles: int,
    policies: Sequence[str],
    ghosts: Sequence[str],
    deadline: float,
    kick_grace: float | None,
    progress: bool,
) -> pd.DataFrame:
    from sandboxkit.lab.experiment import compare

    with private_daemon() as state:
        _say(f"on a private daemon, pid {state.pid} at {state.url}, stopped at the end")
        return asyncio.run(
            compare(
                policies,
                ghosts,
                cycles,
                progress=progress,
                deadline=deadline,
                kick_grace=kick_grace,
                url=state.url,
                token=state.token,
            )
        )


def _report(frame: pd.DataFrame, table: pd.DataFrame, out: Path) -> int:
    from sandboxkit.lab.plots import plot_cycle_timeline, plot_stall_rates, save_figure
    from sandboxkit.lab.stats import format_stall_table

    _say("\n" + format_stall_table(table))
    out.mkdir(parents=True, exist_ok=True)
    written = {
        "cycles.csv": "one row per cycle",
        "stall_table.csv": "the table above",
        "stall_rates.png": "stall rate per policy, 95% interval",
        "timeline.png": "each cycle's refresh over time",
    }
    frame.to_csv(out / "cycles.csv", index=False)
    table.to_csv(out / "stall_table.csv", index=False)
    save_figure(plot_stall_rates(table), out / "stall_rates.png")
    save_figure(plot_cycle_timeline(frame), out / "timeline.png")
    _say(f"\nwrote into {out.resolve()}:")
    for name, what in written.items():
        _say(f"  {name:16} {what}")
    _say("the daemon was stopped; nothing is left running")
    return 0
