"""Real-browser end-to-end test of the notebook layer.

On the run's JupyterLab (the ``jupyter`` fixture, on 127.0.0.1), drives Debian's chromium
(``/usr/bin/chromium``, installed by ``scripts/install-system.sh``; never ``playwright
install``) with Playwright, runs all cells of ``notebooks/04_remediation_by_hand.ipynb``
(a copy, with a kernel and a daemon of its own), watches the live ProcessPanel's line
count grow, clicks "Kill-restart" and sees the panel follow the new pid.

Under ``CI=true`` a missing browser (or Playwright/JupyterLab) is a failure; locally it is
a skip. The screenshot is written to pytest's ``tmp_path`` and, if set, to
``$SANDBOXKIT_SCREENSHOT_DIR``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from jupyter_harness import deadline_poll, field_of, timed

if TYPE_CHECKING:
    from jupyter_harness import SharedLab
    from playwright.sync_api import Browser, Page

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "04_remediation_by_hand.ipynb"
STATUS = ".sandboxkit-panel .sandboxkit-status"
PROMPTS = ".jp-Notebook .jp-CodeCell .jp-InputPrompt"

# Run All marks every code cell "[*]"; it has finished (or stopped at an error) once none is.
_JS_RUNNING = "(sel) => [...document.querySelectorAll(sel)].some(p => p.textContent.includes('*'))"
_JS_SETTLED = "(sel) => ![...document.querySelectorAll(sel)].some(p => p.textContent.includes('*'))"

# True once the status element's text shows ``<name> <n>`` with n != / > the given value.
_JS_FIELD = """
([selector, name, op, old]) => {
    const el = document.querySelector(selector);
    if (!el) return false;
    const m = el.textContent.match(new RegExp("\\\\b" + name + "\\\\s+(\\\\d+)\\\\b"));
    if (!m) return false;
    const v = Number(m[1]);
    return op === "gt" ? v > old : v !== old;
}
"""


def _wait(page: Page, js: str, arg: object, what: str, timeout: float = 45) -> None:
    """``page.wait_for_function`` that fails with what it was waiting for."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(js, arg=arg, timeout=timeout * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}") from None


def _wait_status(page: Page, name: str, op: str, old: int, what: str) -> None:
    """Wait until the panel's status shows ``<name> <n>`` with n > old (op "gt") or
    n != old (op "ne"); on timeout, fail quoting the status text."""
    try:
        _wait(page, _JS_FIELD, [STATUS, name, op, old], what)
    except AssertionError as e:
        texts = page.locator(STATUS).all_inner_texts()
        raise AssertionError(f"{e}; panel status now: {texts}") from None


def _daemon_processes(state_file: Path) -> list[dict[str, object]]:
    """Every process of every sandbox, straight from the daemon (not from the page)."""
    state = json.loads(state_file.read_text())
    headers = {"Authorization": f"Bearer {state['token']}"}
    with httpx.Client(base_url=state["url"], headers=headers, timeout=5.0) as client:
        out: list[dict[str, object]] = []
        for sandbox in client.get("/sandboxes").json():
            sid = sandbox["sandbox_id"]
            out.extend(client.get(f"/sandboxes/{sid}/processes").json())
        return out


def drive_notebook(
    jupyter: SharedLab, browser: Browser, notebook: Path, tmp_path: Path
) -> dict[str, float]:
    """The whole scenario against a copy of ``notebook`` on the run's JupyterLab (with a
    kernel and a daemon of its own, ended and checked for leftovers at the end: see
    ``SharedLab.notebook``); returns per-phase timings in seconds."""
    timings: dict[str, float] = {}
    shot = tmp_path / f"{notebook.stem}.png"
    with jupyter.notebook(notebook, notebook.name) as nb:
        lab, state_file = nb.server, nb.state_file
        with timed(timings, "browser_context"):
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
        try:
            context.set_default_timeout(45_000)
            page = context.new_page()
            nb.pages.append(page)
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))

            with timed(timings, "lab_load"):
                if lab.windowing_mode != "none":
                    lab.set_windowing_mode("none")
                page.goto(nb.url(), wait_until="domcontentloaded")
                page.locator(".jp-Notebook .jp-Cell").first.wait_for(state="visible")

            with timed(timings, "kernel_idle"):
                kernel_id = deadline_poll(lambda: lab.kernel_for(nb.path), 60, "the kernel")
                deadline_poll(
                    lambda: lab.kernel_state(str(kernel_id)) == "idle",
                    60,
                    "the notebook's kernel to be idle",
                )
                # The page's own connection to that kernel must be up too.
                page.locator(
                    ".jp-NotebookPanel-toolbar .jp-Notebook-ExecutionIndicator[data-status='idle']"
                ).wait_for(state="attached")

            with timed(timings, "run_all"):
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(
                    ".lm-Menu-item:not(.lm-mod-hidden) .lm-Menu-itemLabel",
                    has_text="Run All Cells",
                ).first.click()
                _wait(page, _JS_RUNNING, PROMPTS, "Run All to start")
                _wait(page, _JS_SETTLED, PROMPTS, "Run All to finish", timeout=120)
            prompts = page.locator(PROMPTS).all_inner_texts()
            errors = [
                text
                for text in page.locator(
                    ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
                ).all_inner_texts()
                if "Traceback (most recent call last)" in text
            ]
            ran = bool(prompts) and all(re.fullmatch(r"\[\d+\]:", p.strip()) for p in prompts)
            assert ran and not errors, (
                f"Run All did not run every cell cleanly: prompts {prompts}\n"
                + "\n---\n".join(e[-3000:] for e in errors)
            )

            # The panel the first cell displayed is live after the whole notebook ran.
            status = page.locator(STATUS).first
            status.wait_for(state="visible")
            _wait_status(page, "lines", "gt", 0, "the panel to show received lines")
            text1 = status.inner_text()
            lines1, pid1 = field_of(text1, "lines"), field_of(text1, "pid")
            assert lines1 is not None and pid1 is not None, f"bad status text: {text1!r}"

            with timed(timings, "lines_grow"):
                _wait_status(page, "lines", "gt", lines1, "the line count to grow")
            text2 = status.inner_text()
            lines2 = field_of(text2, "lines")
            assert lines2 is not None and lines2 > lines1, (text1, text2)
            assert field_of(text2, "pid") == pid1, (text1, text2)

            # The pid the page shows is the daemon's running process.
            by_pid = {p["pid"]: p for p in _daemon_processes(state_file)}
            assert pid1 in by_pid and by_pid[pid1]["state"] == "running", by_pid

            with timed(timings, "kill_restart"):
                page.locator(".sandboxkit-panel").first.get_by_role(
                    "button", name="Kill-restart"
                ).click()
                _wait_status(page, "pid", "ne", pid1, "a new pid after Kill-restart")
            text3 = status.inner_text()
            pid2, lines3 = field_of(text3, "pid"), field_of(text3, "lines")
            assert pid2 is not None and pid2 != pid1 and lines3 is not None, (text2, text3)

            by_pid = {p["pid"]: p for p in _daemon_processes(state_file)}
            assert by_pid.get(pid2, {}).get("state") == "running", by_pid
            assert by_pid[pid2].get("restarted_from") == pid1, by_pid[pid2]
            assert by_pid[pid1]["state"] != "running", by_pid[pid1]

            with timed(timings, "new_pid_streams"):
                # The panel follows the NEW process: its output keeps arriving.
                _wait_status(page, "lines", "gt", lines3, "lines from the new process")

            status.scroll_into_view_if_needed()
            page.screenshot(path=str(shot))
            print(f"\nscreenshot: {shot}")
            target = os.environ.get("SANDBOXKIT_SCREENSHOT_DIR")
            if target:
                Path(target).mkdir(parents=True, exist_ok=True)
                shutil.copy2(shot, Path(target) / shot.name)
                print(f"screenshot copied to: {Path(target) / shot.name}")
        except BaseException:
            console_errors = [c for c in console if c.startswith("error")]
            sys.stderr.write(
                f"\n--- jupyter log ---\n{lab.log_tail()}"
                "\n--- browser console errors ---\n" + "\n".join(console_errors[-20:]) + "\n"
                f"--- daemon log ---\n{_tail(state_file.with_suffix('.log'))}\n"
            )
            with contextlib.suppress(Exception):
                page.screenshot(path=str(tmp_path / "failure.png"))
                sys.stderr.write(f"failure screenshot: {tmp_path / 'failure.png'}\n")
            raise
        finally:
            with timed(timings, "browser_close"):
                context.close()
    return timings


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_notebook_04_panel_in_real_browser(
    jupyter: SharedLab, browser: Browser, tmp_path: Path
) -> None:
    assert NOTEBOOK.is_file(), f"{NOTEBOOK} is missing"
    t0 = time.monotonic()
    timings = drive_notebook(jupyter, browser, NOTEBOOK, tmp_path)
    print(f"timings (s): {timings}; total {time.monotonic() - t0:.1f}")
