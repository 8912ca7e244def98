"""A classroom on one kernel (issue 22): ``--panels N`` ProcessPanels and N
BackpressureCharts, each pair on its own sandbox and its own ~10 MB/s producer, in one
real ipykernel — counted from outside (imported by ``widgets.py`` as ``_classroom``).

Two phases, each with fresh producers:

* **kernel**: an ipykernel started with jupyter_client's ``KernelManager`` runs the
  widget code; this process reads the kernel's iopub channel and counts every
  ``comm_msg`` (anywidget custom messages and ipywidgets state updates alike) by the
  widget it belongs to — each comm is traced, through the boxes' ``children``, to the
  panel's or the chart's outer box (CSS classes ``sandboxkit-panel`` /
  ``sandboxkit-chart``). Bytes to the browser are the messages' JSON content plus their
  binary buffers. The kernel's CPU comes from psutil (user + system, all its threads —
  the sandbox client's loop thread included), and a probe task on the kernel's loop
  sleeps 5 ms in a loop: its lateness is the time a callback held the loop.
* **browser**: JupyterLab (the test suite's harness, ``tests/jupyter_harness.py``) and
  Debian's chromium through Playwright open a notebook running the same code; once all
  2N widgets show, the page counts ``requestAnimationFrame`` callbacks for a few seconds
  (frames per second) while the websocket bytes it receives are summed.

Goals: kernel ≤ 25 % of a core, ≤ 10 comm messages/s per panel, ≤ 2.5 MB/s to the
browser in all, no loop stall > 20 ms, ≥ 30 frames/s.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

PRODUCER = """
import sys, time
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
line = b"x" * 99 + b"\\n"
chunk = line * max(1, int(rate / 100 / 50))  # ~50 writes a second
t0 = time.monotonic()
sent = 0
while time.monotonic() - t0 < seconds:
    sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()
    sent += len(chunk)
    delay = t0 + sent / rate - time.monotonic()
    if delay > 0:
        time.sleep(delay)  # sleep-ok: the producer's pace
"""

PROBE = """
class Probe:
    \"\"\"Sleeps 5 ms in a loop on the kernel's loop: lateness = a callback held it.\"\"\"
    def __init__(self):
        self.worst = 0.0
        self.over = 0
        self.task = asyncio.get_running_loop().create_task(self.run())
    async def run(self):
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            late = time.perf_counter() - t - 0.005
            self.worst = max(self.worst, late)
            self.over += late > 0.020
"""
"""A loop-lag probe for the kernel's loop (the worst lateness, and how often over 20 ms)."""

# One cell: N sandboxes, each with a producer, a panel and a chart; a loop-lag probe.
CLASSROOM = """
import asyncio, json, sys, time
from IPython.display import display
from sandboxkit import Sandbox
from sandboxkit.notebook import BackpressureChart, ProcessPanel

PRODUCER = {producer!r}

{probe}
class Dropped:
    # A plain stream whose bytes are counted and dropped (stands in for a panel).
    def __init__(self, sbx, pid):
        self.bytes_received, self.skipped_total, self.state = 0, 0, self
        self.handle = sbx.commands.connect(pid, 0, on_stdout=self.count, lines=False)
    def count(self, text):
        self.bytes_received += len(text)
    def close(self):
        self.handle.disconnect()

sandboxes, panels, charts = [], [], []
for i in range({panels}):
    sbx = Sandbox.create(url={url!r}, token={token!r}, timeout=300)
    proc = sbx.commands.run([sys.executable, "-u", "-c", PRODUCER, "{rate}", "{seconds}"],
                            background=True)
    proc.disconnect()
    sandboxes.append(sbx)
    if {widgets}:
        panel = ProcessPanel(sbx, proc.pid, rows=6)
        chart = BackpressureChart(sbx, panel)
        panels.append(panel); charts.append(chart)
        display(panel, chart)
    else:  # the streams alone: what the widgets' cost is counted beyond
        panels.append(Dropped(sbx, proc.pid))
probe = Probe()
"""

RESET = """
probe.worst = 0.0; probe.over = 0
start_bytes = [p.state.bytes_received for p in panels]
"""

COLLECT = """
probe.task.cancel()
stats = {
    "probe_worst_ms": round(probe.worst * 1000, 1),
    "probe_over_20ms": probe.over,
    "received_bytes": sum(p.state.bytes_received for p in panels) - sum(start_bytes),
    "skipped_bytes": sum(p.state.skipped_total for p in panels),
}
for w in panels + charts:
    w.close()
for sbx in sandboxes:
    sbx.kill()
print("STATS " + json.dumps(stats))
"""


class Comms:
    """Every comm on iopub, traced to the panel or chart that owns it."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.roots: dict[str, str] = {}  # comm id of an outer box -> "panel" / "chart"
        self.messages: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.counting = False

    def _open(self, comm_id: str, state: dict[str, Any]) -> None:
        classes = state.get("_dom_classes") or []
        if "sandboxkit-panel" in classes:
            self.roots[comm_id] = "panel"
        elif "sandboxkit-chart" in classes:
            self.roots[comm_id] = "chart"
        for child in state.get("children") or []:
            if isinstance(child, str) and child.startswith("IPY_MODEL_"):
                self.parent[child[len("IPY_MODEL_") :]] = comm_id

    def owner(self, comm_id: str) -> str:
        seen = 0
        while comm_id not in self.roots and comm_id in self.parent and seen < 10:
            comm_id, seen = self.parent[comm_id], seen + 1
        return comm_id if comm_id in self.roots else "other"

    def take(self, msg: dict[str, Any]) -> None:
        kind = msg["header"]["msg_type"]
        content = msg["content"]
        if kind == "comm_open":
            self._open(content["comm_id"], content.get("data", {}).get("state", {}))
        elif kind == "comm_msg":
            data = content.get("data", {})
            if data.get("method") == "update":
                self._open(content["comm_id"], data.get("state", {}))
            if not self.counting:
                return
            cid = content["comm_id"]
            size = len(json.dumps(content)) + sum(len(b) for b in msg.get("buffers") or [])
            self.messages[cid] = self.messages.get(cid, 0) + 1
            self.bytes[cid] = self.bytes.get(cid, 0) + size

    def per_widget(self) -> dict[str, dict[str, int]]:
        """Messages and bytes per outer box (comm id): {"kind", "messages", "bytes"}."""
        out: dict[str, dict[str, Any]] = {}
        for cid, count in self.messages.items():
            root = self.owner(cid)
            entry = out.setdefault(
                root, {"kind": self.roots.get(root, "other"), "messages": 0, "bytes": 0}
            )
            entry["messages"] += count
            entry["bytes"] += self.bytes[cid]
        return out


def _execute(kc: Any, code: str, comms: Comms, linger: float = 0.0) -> str:
    """Run ``code``; drain iopub until idle and ``linger`` seconds more; its stdout."""
    msg_id = kc.execute(code)
    out: list[str] = []
    deadline: float | None = None
    while deadline is None or time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.05)
        except queue.Empty:
            continue
        comms.take(msg)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["header"]["msg_type"]
        if kind == "stream":
            out.append(msg["content"]["text"])
        elif kind == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            deadline = time.monotonic() + linger
    return "".join(out)


def _cell(state: Any, panels: int, rate: float, seconds: float, widgets: bool = True) -> str:
    return CLASSROOM.format(
        widgets=widgets,
        producer=textwrap.dedent(PRODUCER),
        probe=PROBE,
        panels=panels,
        url=state.url,
        token=state.token,
        rate=rate,
        seconds=seconds,
    )


def _perf(pid: int, seconds: float) -> subprocess.Popen[bytes]:
    """``perf record`` of the kernel process for ``seconds`` (``--profile``); the report
    (by shared object and symbol) goes to stderr when it ends."""
    out = Path(tempfile.mkdtemp(prefix="sbx-classroom-perf-")) / "perf.data"
    script = (
        f"perf record -q -F 999 -p {pid} -o {out} -- sleep {seconds} && "
        f"perf report -q -i {out} --no-children --sort dso,sym --percent-limit 0.7 "
        "| head -60 >&2"
    )
    return subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL)


def kernel_phase(
    state: Any,
    *,
    panels: int,
    rate: float,
    seconds: float,
    profile: bool = False,
    widgets: bool = True,
) -> dict[str, Any]:
    """The classroom in an ipykernel of its own; figures counted on its iopub. Without
    ``widgets``: the same streams into callbacks that drop the bytes."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        kernel = psutil.Process(km.provisioner.pid)  # type: ignore[union-attr]
        comms = Comms()
        warmup = 2.0
        _execute(
            kc, _cell(state, panels, rate, seconds + warmup + 10, widgets), comms, linger=warmup
        )
        _execute(kc, RESET, comms)
        perf = _perf(kernel.pid, seconds) if profile else None
        comms.counting = True
        cpu0 = sum(kernel.cpu_times()[:2])
        t0 = time.monotonic()
        _execute(kc, "pass", comms, linger=seconds)
        elapsed = time.monotonic() - t0
        cpu = (sum(kernel.cpu_times()[:2]) - cpu0) / elapsed
        comms.counting = False
        if perf is not None:
            perf.wait()
        out = _execute(kc, COLLECT, comms)
        stats = json.loads(out.split("STATS ", 1)[1])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    traffic = comms.per_widget()
    rates = {
        kind: sorted(
            round(w["messages"] / elapsed, 2) for w in traffic.values() if w["kind"] == kind
        )
        for kind in ("panel", "chart")
    }
    total_bytes = sum(w["bytes"] for w in traffic.values())
    return {
        "seconds": round(elapsed, 2),
        "kernel_cpu_core_fraction": round(cpu, 3),
        "panel_msgs_per_s": rates["panel"],
        "chart_msgs_per_s": rates["chart"],
        "panel_msgs_per_s_max": max(rates["panel"], default=0.0),
        "chart_msgs_per_s_max": max(rates["chart"], default=0.0),
        "other_msgs_per_s": round(
            sum(w["messages"] for w in traffic.values() if w["kind"] == "other") / elapsed, 2
        ),
        "frontend_bytes_per_s": round(total_bytes / elapsed),
        "received_bytes_per_s": round(stats["received_bytes"] / elapsed),
        "probe_worst_ms": stats["probe_worst_ms"],
        "probe_over_20ms": stats["probe_over_20ms"],
    }


# -- the browser phase ------------------------------------------------------------------

_JS_FPS = """
async (ms) => {
  let frames = 0, worst = 0, last = performance.now();
  const t0 = last;
  await new Promise(done => {
    const tick = (now) => {
      frames += 1; worst = Math.max(worst, now - last); last = now;
      if (now - t0 < ms) requestAnimationFrame(tick); else done();
    };
    requestAnimationFrame(tick);
  });
  return [frames, performance.now() - t0, worst];
}
"""


@contextlib.contextmanager
def _lab(base: Path, cell: str) -> Iterator[Any]:
    """JupyterLab with one notebook holding ``cell``; stopped (kernels too) at the end."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import nbformat
    from jupyter_harness import JupyterLab

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(cell)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    source = base / "classroom.ipynb"
    nbformat.write(nb, source)
    server = JupyterLab(base / "lab", [source])
    try:
        server.start().wait_ready(timeout=90)
        yield server
    finally:
        server.stop()


def _kernel_process(server: Any) -> psutil.Process | None:
    assert server.proc is not None
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ipykernel" in " ".join(child.cmdline()):
                return child
    return None


def _browser(state: Any, *, panels: int, rate: float, seconds: float) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    warmup = 3.0
    with (
        tempfile.TemporaryDirectory(prefix="sbx-classroom-") as made,
        _lab(Path(made), _cell(state, panels, rate, seconds + warmup + 60)) as server,
    ):
        base = Path(made)
        from jupyter_harness import deadline_poll, persistent_chromium

        with sync_playwright() as pw:
            context = persistent_chromium(pw, base / "chromium-profile", 1300, 1100)
            try:
                context.set_default_timeout(60_000)
                page = context.new_page()
                received = [0]
                counting = [False]

                def frame(payload: str | bytes) -> None:
                    if counting[0]:
                        received[0] += len(payload)

                page.on("websocket", lambda ws: ws.on("framereceived", frame))
                page.goto(server.lab_url("classroom.ipynb"), wait_until="domcontentloaded")
                page.locator(".jp-Notebook .jp-Cell").first.wait_for(state="visible")
                # As tests/test_browser_widgets.py: the kernel idle before Run All Cells.
                kid = deadline_poll(lambda: server.kernel_for("classroom.ipynb"), 60, "kernel")
                deadline_poll(lambda: server.kernel_state(str(kid)) == "idle", 60, "idle")
                page.locator(
                    ".jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator[data-status='idle']"
                ).wait_for(state="attached")
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(
                    ".lm-Menu-item:not(.lm-mod-hidden) .lm-Menu-itemLabel",
                    has_text="Run All Cells",
                ).first.click()
                try:
                    for widget in (".sandboxkit-panel .xterm-rows", ".sandboxkit-chart canvas"):
                        page.locator(widget).nth(panels - 1).wait_for(state="attached")
                except Exception:
                    page.screenshot(path=str(base / "failure.png"))
                    shown = page.locator(".jp-OutputArea").first.inner_text()[:3000]
                    print(f"the widgets did not show ({base}/failure.png):\n{shown}")
                    raise
                kernel = deadline_poll(lambda: _kernel_process(server), 30, "the kernel")
                assert isinstance(kernel, psutil.Process)
                page.wait_for_timeout(warmup * 1000)  # sleep-ok: let the widgets settle
                counting[0] = True
                cpu0 = sum(kernel.cpu_times()[:2])
                t0 = time.monotonic()
                frames, ms, worst = page.evaluate(_JS_FPS, seconds * 1000)
                elapsed = time.monotonic() - t0
                cpu = (sum(kernel.cpu_times()[:2]) - cpu0) / elapsed
                counting[0] = False
                live = page.evaluate(
                    "() => [document.querySelectorAll('.sandboxkit-panel').length,"
                    " document.querySelectorAll('.sandboxkit-chart').length]"
                )
            finally:
                context.close()
    return {
        "seconds": round(elapsed, 2),
        "widgets_live": {"panels": live[0], "charts": live[1]},
        "frames_per_s": round(frames / (ms / 1000), 1),
        "worst_frame_ms": round(worst, 1),
        "websocket_bytes_per_s": round(received[0] / elapsed),
        "kernel_cpu_core_fraction": round(cpu, 3),
    }


def run(
    state: Any, *, panels: int, rate: float, seconds: float, browser: bool, profile: bool = False
) -> dict[str, Any]:
    """Both phases; the figures and whether each goal is met."""
    kernel = kernel_phase(state, panels=panels, rate=rate, seconds=seconds, profile=profile)
    streams = kernel_phase(state, panels=panels, rate=rate, seconds=seconds, widgets=False)
    kernel["streams_only"] = {
        k: streams[k]
        for k in ("kernel_cpu_core_fraction", "received_bytes_per_s", "probe_worst_ms")
    }
    result: dict[str, Any] = {
        "panels": panels,
        "charts": panels,
        "producer_rate_bytes_per_s": rate,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "kernel": kernel,
    }
    goals = {
        "kernel_cpu_le_25pct": kernel["kernel_cpu_core_fraction"] <= 0.25,
        "panel_msgs_le_10_per_s": kernel["panel_msgs_per_s_max"] <= 10.0,
        "frontend_le_2_5_MB_per_s": kernel["frontend_bytes_per_s"] <= 2.5e6,
        "loop_never_blocked_gt_20ms": kernel["probe_over_20ms"] == 0,
    }
    if browser:
        result["browser"] = _browser(state, panels=panels, rate=rate, seconds=min(seconds, 5.0))
        goals["frames_ge_30_per_s"] = result["browser"]["frames_per_s"] >= 30.0
    result["goals_met"] = goals
    return result
