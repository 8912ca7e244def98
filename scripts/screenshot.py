"""Make the README's picture, docs/panel.png: a ProcessPanel and a BackpressureChart in
JupyterLab, in a real (headless) Chromium, Debian's /usr/bin/chromium.

    python scripts/screenshot.py [--out docs/panel.png]

A throwaway JupyterLab and a private sandboxkit daemon (tests/jupyter_harness.py, as the
browser tests use them) run a notebook: a sandbox whose process prints a few thousand
lines a second, a panel on it, a chart of its consumers, and a pause and resume with
pause-snapshot ghosts (the fault lab), so the chart shows a ghost falling behind beside
the panel keeping up. Everything it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from jupyter_harness import (  # noqa: E402
    JupyterLab,
    deadline_poll,
    persistent_chromium,
    stop_daemon,
)

NOTEBOOK = "sandboxkit.ipynb"

CELLS = [
    '''\
from sandboxkit import Sandbox
from sandboxkit.lab import LabOptions
from sandboxkit.notebook import BackpressureChart, ProcessPanel

TRAIN = """
import math, time
for step in range(10**6):
    loss = 2.5 * math.exp(-step / 40000) + 0.05
    print(f"\\x1b[36mstep {step:6d}\\x1b[0m  loss \\x1b[33m{loss:.4f}\\x1b[0m  lr 3e-4", flush=True)
    time.sleep(0.0005)
"""
sbx = Sandbox.create(timeout=600, lab=LabOptions(pause_ghosts=True))
h = sbx.commands.run(["python3", "-u", "-c", TRAIN], background=True)
h.disconnect()
panel = ProcessPanel(sbx, h.pid, rows=12)
panel''',
    """\
chart = BackpressureChart(sbx, panel, window=30)
chart""",
    """\
import time
time.sleep(4)  # the panel streams, then a snapshot pause leaves a ghost behind
sbx.pause()
sbx.resume()""",
]

# The code cells, their prompts and the lab's cell markers: the picture is the widgets.
HIDE_CHROME = (
    ".jp-Notebook .jp-InputArea, .jp-OutputPrompt, .jp-Collapser,"
    " .jp-OutputArea-promptOverlay { display: none !important; }"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "panel.png")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds of streaming")
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="sandboxkit-shot-") as tmp:
        base = Path(tmp)
        state_file = base / "sandboxkit" / "daemon.json"
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
        nbformat.write(nb, base / NOTEBOOK)
        server = JupyterLab(
            base / "lab",
            [base / NOTEBOOK],
            extra_env={"SANDBOXKIT_STATE_FILE": str(state_file)},
        )
        try:
            server.start().wait_ready(timeout=90)
            with sync_playwright() as pw:
                context = persistent_chromium(
                    pw, base / "chromium-profile", 1100, 1000, device_scale_factor=1
                )
                try:
                    page = context.new_page()
                    page.goto(server.lab_url(NOTEBOOK), wait_until="domcontentloaded")
                    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
                    kernel = deadline_poll(lambda: server.kernel_for(NOTEBOOK), 60, "kernel")
                    deadline_poll(lambda: server.kernel_state(str(kernel)) == "idle", 60, "idle")
                    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                    page.locator(
                        ".lm-Menu-item:not(.lm-mod-hidden) .lm-Menu-itemLabel",
                        has_text="Run All Cells",
                    ).first.click()
                    page.locator(".sandboxkit-panel .xterm-rows").first.wait_for(
                        state="attached", timeout=60_000
                    )
                    page.locator(".sandboxkit-backpressure canvas").first.wait_for(
                        state="attached", timeout=60_000
                    )
                    time.sleep(args.settle)  # sleep-ok: let the chart draw a history
                    page.add_style_tag(content=HIDE_CHROME)
                    page.wait_for_timeout(500)  # sleep-ok: one relayout
                    notebook = page.locator(".jp-NotebookPanel-notebook").first
                    notebook.evaluate("el => el.scrollTo(0, 0)")
                    first = page.locator(".jp-Cell").nth(0).bounding_box()
                    second = page.locator(".jp-Cell").nth(1).bounding_box()
                    assert first and second
                    x, y = first["x"], first["y"]
                    w = max(first["width"], second["width"])
                    h = second["y"] + second["height"] - y
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(
                        path=str(args.out), clip={"x": x, "y": y, "width": w, "height": h}
                    )
                    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
                finally:
                    context.close()
        finally:
            server.stop()
            if state_file.exists():
                stop_daemon(state_file)


if __name__ == "__main__":
    main()
