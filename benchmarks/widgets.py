"""What the notebook widgets cost: a real ipykernel, driven through jupyter_client, with
the widget traffic counted from outside (on the kernel's iopub channel).

Three runs of ``--seconds`` each, in one kernel, against a daemon in its own process:

* ``baseline``: a 10 MB/s producer followed by a plain stream (``commands.connect`` with a
  callback that drops the bytes) — the cost of the stream itself;
* ``flood``: the same producer followed by a ``ProcessPanel`` and a ``BackpressureChart``;
* ``trickle``: a 200 B/s producer, with a panel and a chart.

Reported per run: comm messages per second per widget (panel: its terminal, buttons and
status; chart: its canvas view and caption), bytes sent to the front end (JSON + binary
buffers) against the bytes the panel displayed, the kernel process's CPU (psutil, from
outside) and the worst lateness of a probe task on the kernel's loop (it sleeps 5 ms in a
loop: lateness = time a callback held the loop). Targets (issue 8): <= 10 msgs/s per
panel, <= 3 per chart; bytes <= 1.1 x displayed + a small constant below the rate cap;
panel + chart <= 10 % of a core beyond the baseline; the loop never blocked > 20 ms.

    python benchmarks/widgets.py [--seconds 10] [--json]

``--panels N`` runs the classroom instead (issue 22, ``_classroom.py``): N panels and N
charts on N producers of ``--rate`` bytes/s in one kernel, then in chromium
(``--no-browser`` skips that phase):

    python benchmarks/widgets.py --panels 8 [--seconds 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any

import _classroom
import psutil
from _daemon import local_daemon
from jupyter_client.manager import start_new_kernel

SETUP = """
import asyncio, json, sys, time
from sandboxkit import Sandbox
from sandboxkit.notebook import BackpressureChart, ProcessPanel
PRODUCER = {producer!r}
{probe}"""

START = """
sbx = Sandbox.create(url={url!r}, token={token!r}, timeout=120)
proc = sbx.commands.run([sys.executable, "-u", "-c", PRODUCER, "{rate}", "{seconds}"],
                        background=True)
proc.disconnect()
received = [0]
if {widgets}:
    panel = ProcessPanel(sbx, proc.pid)
    chart = BackpressureChart(sbx, panel)
    display(panel, chart)
else:
    def count(text):
        received[0] += len(text)
    handle = sbx.commands.connect(proc.pid, 0, on_stdout=count, lines=False)
probe = Probe()
"""

COLLECT = """
probe.task.cancel()
stats = {{"probe_worst_ms": round(probe.worst * 1000, 1)}}
if {widgets}:
    stats.update(displayed=panel.state.bytes_received, sent=panel.bytes_sent,
                 skipped=panel.state.skipped_total, flushes=panel.flushes, chart_sends=chart.sends)
    panel.close(); chart.close()
else:
    stats.update(displayed=received[0])
    handle.disconnect()
sbx.kill()
print("STATS " + json.dumps(stats))
"""


@dataclass
class Traffic:
    """Comm messages on iopub, by the widget class of their comm."""

    classes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def take(self, msg: dict[str, Any]) -> None:
        kind = msg["header"]["msg_type"]
        content = msg["content"]
        if kind == "comm_open":
            state = content.get("data", {}).get("state", {})
            name = state.get("_anywidget_id") or state.get("_model_name", "?")
            self.classes[content["comm_id"]] = str(name)
        elif kind == "comm_msg":
            name = self.classes.get(content["comm_id"], "?")
            size = len(json.dumps(content)) + sum(len(b) for b in msg.get("buffers") or [])
            self.messages[name] = self.messages.get(name, 0) + 1
            self.bytes[name] = self.bytes.get(name, 0) + size


def _owner(name: str) -> str:
    """Which widget a comm's class belongs to (the panel's box, buttons and terminal...)."""
    if "ChartWidget" in name:
        return "chart"
    if name in ("?", ""):
        return "other"
    if "TerminalWidget" in name:
        return "panel"
    return "panel-or-chart-ipywidgets"


def run(kc: Any, kernel: psutil.Process, code: str, seconds: float, traffic: Traffic) -> str:
    """Execute ``code``; drain iopub for ``seconds`` after it finished; its stdout."""
    msg_id = kc.execute(code)
    out: list[str] = []
    done = False
    deadline = None
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            msg = None
        if msg is not None:
            traffic.take(msg)
            if msg["parent_header"].get("msg_id") == msg_id:
                kind = msg["header"]["msg_type"]
                if kind == "stream":
                    out.append(msg["content"]["text"])
                elif kind == "error":
                    raise RuntimeError("\n".join(msg["content"]["traceback"]))
                elif kind == "status" and msg["content"]["execution_state"] == "idle":
                    done = True
                    deadline = time.monotonic() + seconds
        if done and deadline is not None and time.monotonic() >= deadline:
            return "".join(out)


def scenario(
    kc: Any, kernel: psutil.Process, state: Any, *, rate: float, seconds: float, widgets: bool
) -> dict[str, Any]:
    traffic = Traffic()
    start = START.format(
        url=state.url, token=state.token, rate=rate, seconds=seconds + 2, widgets=widgets
    )
    run(kc, kernel, start, 0.5, traffic)  # widgets open, the producer starts
    traffic.messages.clear()
    traffic.bytes.clear()
    cpu0 = sum(kernel.cpu_times()[:2])
    t0 = time.monotonic()
    run(kc, kernel, "pass", seconds, traffic)
    elapsed = time.monotonic() - t0
    cpu = (sum(kernel.cpu_times()[:2]) - cpu0) / elapsed
    out = run(kc, kernel, COLLECT.format(widgets=widgets), 0.0, traffic)
    stats = json.loads(out.split("STATS ", 1)[1])
    per: dict[str, dict[str, float]] = {}
    for name, count in traffic.messages.items():
        owner = _owner(name)
        entry = per.setdefault(owner, {"msgs_per_s": 0.0, "bytes": 0})
        entry["msgs_per_s"] = round(entry["msgs_per_s"] + count / elapsed, 2)
        entry["bytes"] += traffic.bytes[name]
    return {
        "rate_bytes_per_s": rate,
        "seconds": round(elapsed, 2),
        "kernel_cpu_core_fraction": round(cpu, 3),
        "traffic": per,
        **stats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, help="per run (default 10; classroom 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--panels", type=int, default=0, help="run the classroom of N panels")
    parser.add_argument("--rate", type=float, default=10e6, help="classroom producer bytes/s")
    parser.add_argument("--no-browser", action="store_true", help="classroom: kernel only")
    parser.add_argument(
        "--profile", action="store_true", help="classroom: sample the kernel's threads (stderr)"
    )
    args = parser.parse_args()
    if args.panels > 0:
        args.seconds = args.seconds or 8.0
        classroom(args)
        return
    args.seconds = args.seconds or 10.0
    with local_daemon() as (_process, state):
        km, kc = start_new_kernel(kernel_name="python3")
        try:
            kernel = psutil.Process(km.provisioner.pid)  # type: ignore[union-attr]
            run(
                kc,
                kernel,
                SETUP.format(producer=textwrap.dedent(_classroom.PRODUCER), probe=_classroom.PROBE),
                0.0,
                Traffic(),
            )
            results = {
                "baseline": scenario(
                    kc, kernel, state, rate=10e6, seconds=args.seconds, widgets=False
                ),
                "flood": scenario(kc, kernel, state, rate=10e6, seconds=args.seconds, widgets=True),
                "trickle": scenario(
                    kc, kernel, state, rate=200, seconds=args.seconds, widgets=True
                ),
            }
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)
    base, flood, trickle = results["baseline"], results["flood"], results["trickle"]
    summary = {
        "panel_msgs_per_s_flood": flood["traffic"].get("panel", {}).get("msgs_per_s", 0),
        "chart_msgs_per_s_flood": flood["traffic"].get("chart", {}).get("msgs_per_s", 0),
        "panel_msgs_per_s_trickle": trickle["traffic"].get("panel", {}).get("msgs_per_s", 0),
        "chart_msgs_per_s_trickle": trickle["traffic"].get("chart", {}).get("msgs_per_s", 0),
        "trickle_bytes_to_frontend_over_displayed": round(
            trickle["traffic"].get("panel", {}).get("bytes", 0) / max(1, trickle["displayed"]), 3
        ),
        "trickle_panel_frontend_bytes": trickle["traffic"].get("panel", {}).get("bytes", 0),
        "trickle_displayed_bytes": trickle["displayed"],
        "flood_panel_frontend_bytes_per_s": round(
            flood["traffic"].get("panel", {}).get("bytes", 0) / flood["seconds"]
        ),
        "widgets_extra_cpu_core_fraction": round(
            flood["kernel_cpu_core_fraction"] - base["kernel_cpu_core_fraction"], 3
        ),
        "probe_worst_ms": {k: v["probe_worst_ms"] for k, v in results.items()},
    }
    report = {"runs": results, "summary": summary}
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))


def classroom(args: argparse.Namespace) -> None:
    """``--panels N``: the classroom (see ``_classroom.py``)."""
    with local_daemon() as (_process, state):
        result = _classroom.run(
            state,
            panels=args.panels,
            rate=args.rate,
            seconds=args.seconds,
            browser=not args.no_browser,
            profile=args.profile,
        )
    if args.json:
        print(json.dumps(result))
        return
    kernel = result["kernel"]
    print(f"{args.panels} panels + {args.panels} charts, producers at {args.rate / 1e6:g} MB/s")
    print(f"  load average              {result['load_average']}")
    print(f"  kernel CPU                {kernel['kernel_cpu_core_fraction']:.1%} of a core")
    print(f"  comm msgs/s per panel     {kernel['panel_msgs_per_s']}")
    print(f"  comm msgs/s per chart     {kernel['chart_msgs_per_s']}")
    print(f"  to the browser            {kernel['frontend_bytes_per_s'] / 1e6:.2f} MB/s")
    print(f"  output received           {kernel['received_bytes_per_s'] / 1e6:.1f} MB/s")
    print(
        f"  worst loop stall          {kernel['probe_worst_ms']} ms"
        f" ({kernel['probe_over_20ms']} over 20 ms)"
    )
    alone = kernel["streams_only"]
    print(
        f"  the streams alone         {alone['kernel_cpu_core_fraction']:.1%} of a core at"
        f" {alone['received_bytes_per_s'] / 1e6:.1f} MB/s, worst stall {alone['probe_worst_ms']} ms"
    )
    if "browser" in result:
        browser = result["browser"]
        print(f"  browser frames/s          {browser['frames_per_s']}")
        print(f"  browser websocket         {browser['websocket_bytes_per_s'] / 1e6:.2f} MB/s")
        print(f"  kernel CPU (browser run)  {browser['kernel_cpu_core_fraction']:.1%} of a core")
    print(f"  goals met                 {result['goals_met']}")


if __name__ == "__main__":
    sys.exit(main())
