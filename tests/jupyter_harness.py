"""A throwaway JupyterLab server plus Debian's chromium, for the real-browser notebook test.

Everything lives under one temporary directory (the ``marker``): the notebook copies, the
Jupyter config/data/runtime dirs, the lab settings, the browser profile and the sandboxkit
state file. Processes are found again by that marker in their command line, so the test can
prove that it left nothing running.
"""

from __future__ import annotations

import contextlib
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

import httpx
import psutil
from support import wait_until

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
        r = httpx.put(
            f"{self.url}/lab/api/settings/@jupyterlab/notebook-extension:tracker",
            headers={"Authorization": f"token {self.token}"},
            json={"raw": json.dumps(values)},
            timeout=10.0,
        )
        assert r.status_code in (200, 204), (r.status_code, r.text[:500])
        self.windowing_mode = mode

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
