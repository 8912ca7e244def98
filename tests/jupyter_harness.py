"""A throwaway JupyterLab server plus Debian's chromium, for the real-browser notebook tests.

Everything lives under one temporary directory (the ``marker``): the notebook copies, the
Jupyter config/data/runtime dirs, the lab settings, the browser profile and the sandboxkit
state file. Processes are found again by that marker in their command line or environment,
so a test can prove that it left nothing running.

:class:`SharedLab` is the one server every browser test of a run shares (the ``jupyter``
fixture in conftest.py): each test gets a notebook of its own from
:meth:`SharedLab.notebook` (its own directory, kernel and sandboxkit daemon), opened and run
by :meth:`Notebook.open`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
import pytest
from support import wait_until

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, Page

CHROMIUM = "/usr/bin/chromium"
INSTALL_HINT = "run `bash scripts/install-system.sh` (as root: apt-get install -y chromium)"

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]

# User settings for the lab frontend: start the notebook's kernel without a dialog, never
# fetch news or look for updates, no extension manager, no autosave racing the test.
LAB_SETTINGS: dict[str, dict[str, object]] = {
    # windowingMode none: every cell stays in the DOM, so the test can read all prompts.
    "@jupyterlab/notebook-extension:tracker": {
        "autoStartDefaultKernel": True,
        "windowingMode": "none",
    },
    "@jupyterlab/apputils-extension:notification": {
        "fetchNews": "false",
        "checkForUpdates": False,
        "doNotDisturbMode": True,
    },
    "@jupyterlab/extensionmanager-extension:plugin": {"enabled": False},
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
}

# Server-side: no news feed, no update check against PyPI, read-only extension manager.
SERVER_CONFIG: dict[str, dict[str, object]] = {
    "LabApp": {
        "news_url": None,
        "check_for_updates_class": "jupyterlab.handlers.announcements.NeverCheckForUpdate",
        "extension_manager": "readonly",
    },
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def require_browser_stack(*more_modules: str) -> None:
    """Skip (fail under ``CI=true``) when chromium or a Python package the browser tests
    need is missing."""
    missing = []
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"{CHROMIUM} ({INSTALL_HINT})")
    for module in ("playwright", "jupyterlab", "ipykernel", "ipywidgets", *more_modules):
        if importlib.util.find_spec(module) is None:
            missing.append(f"python package {module!r} (pip install -e '.[test]')")
    if not missing:
        return
    message = "real-browser notebook test needs: " + "; ".join(missing)
    if in_ci():
        pytest.fail(message + "  [CI=true: this is required, not optional]", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def deadline_poll(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1
) -> object:
    """:func:`support.wait_until` at the pace a Jupyter server's REST API is asked at."""
    return wait_until(predicate, timeout, what, interval=interval)


# -- process bookkeeping -------------------------------------------------------------------


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def snapshot_pids() -> set[int]:
    return set(psutil.pids())


def _environ_mentions(p: psutil.Process, marker: str) -> bool:
    try:
        return any(marker in v for v in p.environ().values())
    except (psutil.Error, OSError):
        return False


def suspects(marker: str, before: set[int]) -> list[psutil.Process]:
    """Live processes the test started, found even after they were re-parented: their
    command line or their environment names the test's temporary directory (the Jupyter
    server, its kernels and everything they spawn inherit ``JUPYTER_RUNTIME_DIR`` and
    ``SANDBOXKIT_STATE_FILE``; the browser's profile dir is on its command line)."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me or p.pid in before or not _alive(p):
            continue
        if marker in _cmdline(p) or _environ_mentions(p, marker):
            found.append(p)
    return found


def still_alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The distinct processes of ``procs`` that are still running (zombies count as gone)."""
    return [p for p in {p.pid: p for p in procs}.values() if _alive(p)]


def describe(procs: Iterable[psutil.Process]) -> list[str]:
    return [f"{p.pid}: {_cmdline(p)[:200]}" for p in procs]


def reap(procs: Iterable[psutil.Process], timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after ``timeout``."""
    procs = [p for p in procs if _alive(p)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)


# -- the Jupyter server ---------------------------------------------------------------------


@dataclass
class JupyterLab:
    """``jupyter lab`` (or, with ``app="notebook"``, Notebook 7's ``jupyter notebook``) on
    127.0.0.1 with a random port and token, fully isolated under ``base`` (a fresh
    temporary directory)."""

    base: Path
    notebooks: list[Path]
    extra_env: dict[str, str] = field(default_factory=dict)
    windowing_mode: str | None = "none"
    """JupyterLab's notebook windowing mode; ``None``: the lab's default."""
    app: str = "lab"
    """``"lab"``: JupyterLab; ``"notebook"``: Notebook 7 (same settings, same isolation)."""
    port: int = 0
    token: str = ""
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.root = self.base / "root"
        self.jupyter = self.base / "jupyter"
        self.log_path = self.base / "jupyter.log"
        self.port = free_port()
        self.token = secrets.token_hex(16)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lab_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?token={self.token}"

    def notebook_url(self, notebook: str) -> str:
        """Notebook 7's page for ``notebook`` (needs ``app="notebook"``)."""
        return f"{self.url}/notebooks/{notebook}?token={self.token}"

    def _prepare(self) -> dict[str, str]:
        self.root.mkdir(parents=True)
        for nb in self.notebooks:
            shutil.copy2(nb, self.root / nb.name)
        config, data, runtime = (self.jupyter / n for n in ("config", "data", "runtime"))
        settings, workspaces = self.jupyter / "lab-settings", self.jupyter / "workspaces"
        for d in (config, data, runtime, settings, workspaces, self.base / "ipython"):
            d.mkdir(parents=True, exist_ok=True)
        (config / "jupyter_server_config.json").write_text(json.dumps(SERVER_CONFIG))
        for plugin_id, values in LAB_SETTINGS.items():
            if self.windowing_mode != "none" and "windowingMode" in values:
                values = {k: v for k, v in values.items() if k != "windowingMode"}
                if self.windowing_mode is not None:
                    values["windowingMode"] = self.windowing_mode
            package, plugin = plugin_id.split(":")
            target = settings / package / f"{plugin}.jupyterlab-settings"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(values))
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in {"SANDBOXKIT_URL", "SANDBOXKIT_TOKEN", "JUPYTER_PATH", "BROWSER"}
        }
        env.update(
            JUPYTER_CONFIG_DIR=str(config),
            JUPYTER_DATA_DIR=str(data),
            JUPYTER_RUNTIME_DIR=str(runtime),
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(workspaces),
            JUPYTER_PLATFORM_DIRS="1",
            IPYTHONDIR=str(self.base / "ipython"),
            PYTHONUNBUFFERED="1",
        )
        # Keep data dirs the packages were installed into visible (labextensions such as
        # the ipywidgets manager, kernelspecs) when they live outside sys.prefix, e.g. a
        # `pip install --user`; JUPYTER_DATA_DIR above no longer points there.
        user_data = Path(site.getuserbase()) / "share" / "jupyter"
        if (user_data / "labextensions").is_dir():
            env["JUPYTER_PATH"] = str(user_data)
        env.update(self.extra_env)
        return env

    def start(self) -> JupyterLab:
        env = self._prepare()
        module, app_class = {
            "lab": ("jupyterlab", "LabApp"),
            "notebook": ("notebook", "JupyterNotebookApp"),
        }[self.app]
        cmd = [
            sys.executable,
            "-m",
            module,
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            f"--{app_class}.user_settings_dir={self.jupyter / 'lab-settings'}",
            f"--{app_class}.workspaces_dir={self.jupyter / 'workspaces'}",
            "--ServerApp.shutdown_no_activity_timeout=0",
        ]
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child
        with log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def api(self, method: str, path: str, timeout: float = 5.0) -> httpx.Response:
        return httpx.request(
            method,
            f"{self.url}{path}",
            headers={"Authorization": f"token {self.token}"},
            timeout=timeout,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        assert self.proc is not None

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"jupyter {self.app} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                return self.api("GET", "/api/status", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            deadline_poll(ready, timeout, f"jupyter {self.app} /api/status", interval=0.1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- jupyter log ---\n{self.log_tail()}") from None

    def set_windowing_mode(self, mode: str | None) -> None:
        """Switch the notebook windowing mode (``None``: the default) for pages opened
        from now on, through the lab's settings API."""
        values = dict(LAB_SETTINGS["@jupyterlab/notebook-extension:tracker"])
        values.pop("windowingMode", None)
        if mode is not None:
            values["windowingMode"] = mode
        self.set_settings("@jupyterlab/notebook-extension:tracker", values)
        self.windowing_mode = mode

    def set_settings(self, plugin_id: str, values: dict[str, object]) -> None:
        """Replace a lab plugin's user settings, for pages opened from now on."""
        r = httpx.put(
            f"{self.url}/lab/api/settings/{plugin_id}",
            headers={"Authorization": f"token {self.token}"},
            json={"raw": json.dumps(values)},
            timeout=10.0,
        )
        assert r.status_code in (200, 204), (r.status_code, r.text[:500])

    def shutdown_sessions(self, notebook: str) -> None:
        """End the sessions (and so the kernels) open on ``notebook``."""
        with contextlib.suppress(httpx.HTTPError, ValueError):
            for s in self.api("GET", "/api/sessions").json():
                if s.get("path") == notebook:
                    with contextlib.suppress(httpx.HTTPError):
                        self.api("DELETE", f"/api/sessions/{s['id']}", timeout=15.0)

    def kernel_for(self, notebook: str) -> str | None:
        """The id of the kernel of the session open on ``notebook``, if any."""
        for s in self.api("GET", "/api/sessions").json():
            if s.get("path", "").endswith(notebook) and s.get("kernel"):
                return str(s["kernel"]["id"])
        return None

    def kernel_state(self, kernel_id: str) -> str:
        r = self.api("GET", f"/api/kernels/{kernel_id}")
        return str(r.json().get("execution_state", "")) if r.status_code == 200 else ""

    def shutdown_kernels(self) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            for k in self.api("GET", "/api/kernels").json():
                with contextlib.suppress(httpx.HTTPError):
                    self.api("DELETE", f"/api/kernels/{k['id']}", timeout=15.0)

    def stop(self, timeout: float = 15.0) -> None:
        """Shut the kernels down through the API, then end the server's process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.shutdown_kernels()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        # Reap the group even if the leader is gone (e.g. a stray helper it spawned).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


# -- sandboxkit daemon ----------------------------------------------------------------------


def daemon_pid(state_file: Path) -> int | None:
    try:
        return int(json.loads(state_file.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stop_daemon(state_file: Path, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandboxkit", "stop", "--state-file", str(state_file)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def descendants(pid: int | None) -> list[psutil.Process]:
    if pid is None:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


# -- status text ----------------------------------------------------------------------------

_NUM = {name: re.compile(rf"\b{name}\s+(\d+)\b") for name in ("pid", "lines")}


def field_of(text: str, name: str) -> int | None:
    m = _NUM[name].search(text)
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - t0, 2)


# -- one server for the run; a notebook, kernel and daemon of its own per test -------------

_RUN_MENU = ".lm-MenuBar-itemLabel"
_MENU_ITEM = ".lm-Menu-item:not(.lm-mod-hidden) .lm-Menu-itemLabel"


def wait_for_leftovers(procs: list[psutil.Process], what: str, failed: bool) -> None:
    """Give ``procs`` 10 s to end (SIGTERM handlers); end the stragglers and, unless the
    test already failed, fail it naming them."""
    left = still_alive(procs)
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:
        time.sleep(0.1)  # sleep-ok: a poll with a deadline
        left = still_alive(left)
    if left:
        names = describe(left)
        reap(left)
        if not failed:
            pytest.fail(f"{what} left processes running: {names}")


def persistent_chromium(
    pw: Any, profile: Path, width: int, height: int, **options: Any
) -> BrowserContext:
    """Debian's chromium with a profile directory of its own (``profile``), headless, at
    ``width`` × ``height``: for the scripts and benchmarks that drive one page outside
    the suite's fixtures (``scripts/screenshot.py``, ``benchmarks/_classroom.py``)."""
    context: BrowserContext = pw.chromium.launch_persistent_context(
        str(profile),
        executable_path=CHROMIUM,
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": width, "height": height},
        **options,
    )
    return context


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    """Debian's chromium under Playwright; at the end, whatever it started is ended."""
    from playwright.sync_api import sync_playwright

    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children()}
    tracked: list[psutil.Process] = []
    failed = False
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            # Playwright's driver, the browser's parent: what to check at the end (not
            # whatever else this process starts meanwhile, a shared JupyterLab's kernels).
            drivers = [p for p in me.children() if p.pid not in before]
            try:
                yield browser
            finally:
                for driver in drivers:
                    tracked += descendants(driver.pid)
                browser.close()
    except BaseException:
        failed = True
        raise
    finally:
        wait_for_leftovers(still_alive(tracked), "the browser", failed)


class SharedLab:
    """One JupyterLab server for every browser test of a run (starting one costs 10-30 s
    on a loaded 2-core machine). It serves Notebook 7's pages (``/notebooks/...``) too.

    Tests stay independent: :meth:`notebook` gives each its own directory under the
    root, its own kernel (a kernelspec of its own, whose environment names the test's own
    sandboxkit state file, so the kernel starts a daemon of its own), and at the end shuts
    that kernel down, stops that daemon and fails the test if anything it started still
    runs. Lab settings a test changes (:meth:`settings`) are put back when it ends."""

    def __init__(self, base: Path) -> None:
        self.server = JupyterLab(base, [], windowing_mode="none")
        self.before = snapshot_pids()
        self._count = 0

    @classmethod
    @contextlib.contextmanager
    def running(cls, base: Path) -> Iterator[SharedLab]:
        """The server, started; at the end stopped, and nothing it started left behind."""
        lab = cls(base)
        failed = False
        try:
            lab.server.start().wait_ready(timeout=90)
            yield lab
        except BaseException:
            failed = True
            raise
        finally:
            tracked = descendants(lab.server.proc.pid if lab.server.proc else None)
            lab.server.stop()
            left = tracked + suspects(str(base), lab.before)
            wait_for_leftovers(left, "the shared JupyterLab", failed)

    @contextlib.contextmanager
    def settings(self, plugin_id: str, values: dict[str, object]) -> Iterator[None]:
        """``values`` as a lab plugin's user settings while the block runs (for pages
        opened in it)."""
        self.server.set_settings(plugin_id, values)
        try:
            yield
        finally:
            self.server.set_settings(plugin_id, LAB_SETTINGS.get(plugin_id, {}))

    @contextlib.contextmanager
    def notebook(
        self, source: list[str] | Path, name: str = "notebook.ipynb"
    ) -> Iterator[Notebook]:
        """A notebook of its own: the code ``source`` cells (or a copy of the notebook at
        ``source``), with a kernel and a daemon of its own; at the end its pages are closed,
        its kernel shut down, its daemon stopped, and the test fails if anything it
        started is still running."""
        import nbformat  # a few seconds to import: only for the browser tests

        self._count += 1
        folder = self.server.root / f"nb{self._count:03d}"
        state_file = folder / "sandboxkit" / "daemon.json"
        kernel = f"sandboxkit-test-{self._count:03d}"
        spec = self.server.jupyter / "data" / "kernels" / kernel / "kernel.json"
        spec.parent.mkdir(parents=True)
        spec.write_text(
            json.dumps(
                {
                    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": kernel,
                    "language": "python",
                    "env": {"SANDBOXKIT_STATE_FILE": str(state_file)},
                }
            )
        )
        if isinstance(source, Path):
            nb = nbformat.read(source, as_version=4)
        else:
            nb = nbformat.v4.new_notebook()
            nb.cells = [nbformat.v4.new_code_cell(cell) for cell in source]
        nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
        folder.mkdir()
        nbformat.write(nb, folder / name)
        notebook = Notebook(self.server, f"{folder.name}/{name}", folder / name, state_file)
        before = snapshot_pids()
        failed = False
        try:
            yield notebook
        except BaseException:
            failed = True
            raise
        finally:
            for page in notebook.pages:
                with contextlib.suppress(Exception):
                    page.close()
            tracked = descendants(daemon_pid(state_file))
            self.server.shutdown_sessions(notebook.path)
            if state_file.exists():
                stop_daemon(state_file)
            # The kernel and the daemon carry the folder in their environment.
            left = tracked + suspects(str(folder) + os.sep, before)
            wait_for_leftovers(left, f"the notebook {notebook.path}", failed)


@dataclass
class Notebook:
    """One test's notebook on the shared server."""

    server: JupyterLab
    path: str
    """Relative to the server's root (what its URLs and sessions name)."""
    file: Path
    state_file: Path
    """The state file of the daemon its kernel starts."""
    pages: list[Page] = field(default_factory=list)

    def open(
        self,
        context: BrowserContext,
        *,
        ready: str | None = None,
        app: str = "lab",
        windowing_mode: str | None = "none",
        run: bool = True,
    ) -> Page:
        """A page of ``context`` showing the notebook (in JupyterLab, or in Notebook 7
        for ``app="notebook"``) in ``windowing_mode``, with every cell run (``run``) and
        ``ready`` attached."""
        if windowing_mode != self.server.windowing_mode:  # Notebook 7 reads it too
            self.server.set_windowing_mode(windowing_mode)
        page = context.new_page()
        self.pages.append(page)
        page.goto(self.url(app), wait_until="domcontentloaded")
        page.locator(".jp-Notebook .jp-Cell").first.wait_for(state="visible", timeout=60_000)
        if run:
            self.run_all(page)
        if ready is not None:
            page.locator(ready).first.wait_for(state="attached", timeout=60_000)
        return page

    def url(self, app: str = "lab") -> str:
        """The notebook's page: in JupyterLab, in a workspace of its own (the default
        workspace would reopen, and start kernels for, every notebook an earlier test
        opened); in Notebook 7 for ``app="notebook"``."""
        server = self.server
        if app == "notebook":
            return server.notebook_url(self.path)
        workspace = self.path.split("/", 1)[0]
        return f"{server.url}/lab/workspaces/{workspace}/tree/{self.path}?token={server.token}"

    def run_all(self, page: Page) -> str:
        """Once the page's kernel is idle, Run > Run All Cells; returns the kernel's id."""
        server = self.server
        kernel = str(deadline_poll(lambda: server.kernel_for(self.path), 60, "the kernel"))
        deadline_poll(lambda: server.kernel_state(kernel) == "idle", 60, "the kernel idle")
        # The page's own connection to that kernel must be up too.
        page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(
            state="attached", timeout=60_000
        )
        page.locator(_RUN_MENU, has_text="Run").first.click()
        page.locator(_MENU_ITEM, has_text="Run All Cells").first.click()
        return kernel

    def menu(self, page: Page, menu: str, item: str) -> None:
        """Click ``menu`` > ``item`` in the page's menu bar."""
        page.locator(_RUN_MENU, has_text=menu).first.click()
        page.locator(_MENU_ITEM, has_text=item).first.click()


def shot(page: Page, request: pytest.FixtureRequest, name: str) -> Path:
    """Save what ``page`` shows as ``name`` in a folder named after the test (under
    ``$SANDBOXKIT_SCREENSHOT_DIR`` if set, else pytest's base temporary directory)."""
    root = os.environ.get("SANDBOXKIT_SCREENSHOT_DIR")
    base = Path(root) if root else request.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    folder = base / "browser-shots" / re.sub(r"[^\w.-]", "_", request.node.name)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with contextlib.suppress(Exception):
        page.screenshot(path=str(path))
        print(f"\nscreenshot: {path}")
    return path


@contextlib.contextmanager
def screenshot_on_failure(page: Page, request: pytest.FixtureRequest) -> Iterator[None]:
    """On failure, save what the page showed into a folder named after the test; with
    ``$SANDBOXKIT_SCREENSHOT_DIR`` set, on success too (for a person to look at)."""
    try:
        yield
    except BaseException:
        shot(page, request, "failure.png")
        raise
    if os.environ.get("SANDBOXKIT_SCREENSHOT_DIR"):
        shot(page, request, "passed.png")


# -- a sandboxkit panel, as the page shows it ------------------------------------------------

PANEL = ".sandboxkit-panel"
ROWS = ".xterm-rows"
STATUS = ".sandboxkit-status"

# The terminal's visible rows, top to bottom, of the n-th panel.
_JS_ROWS = """
([n]) => {
  const panel = document.querySelectorAll(".sandboxkit-panel")[n];
  const rows = panel && panel.querySelector(".xterm-rows");
  return rows ? [...rows.children].map(r => r.textContent.replace(/\\u00a0/g, " ")) : null;
}
"""


def rows_of(page: Page, n: int = 0) -> list[str]:
    """The n-th panel's terminal rows on screen, top to bottom."""
    rows = page.evaluate(_JS_ROWS, [n])
    assert rows is not None, "no terminal rows in the DOM"
    return list(rows)


def status_of(page: Page, n: int = 0) -> str:
    """The n-th panel's status line."""
    return str(page.locator(f"{PANEL} {STATUS}").nth(n).inner_text())


def wait_rows(
    page: Page, predicate: Callable[[list[str]], object], timeout: float, what: str, n: int = 0
) -> list[str]:
    """The n-th panel's rows once ``predicate`` holds for them; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        rows = rows_of(page, n)
        if predicate(rows):
            return rows
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}: {rows}")
        page.wait_for_timeout(50)  # sleep-ok: a poll of the page with a deadline


def wait_status(page: Page, pattern: str, timeout: float, what: str, n: int = 0) -> str:
    """The n-th panel's status once it matches ``pattern``; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        text = status_of(page, n)
        if re.search(pattern, text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}: {text!r}")
        page.wait_for_timeout(20)  # sleep-ok: a poll of the page with a deadline
