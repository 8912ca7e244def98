"""Shared fixtures: an in-process daemon on loopback, a plain-asyncio host, a guard that
fails any test leaving a process behind, and for the browser tests one JupyterLab for the
run and a chromium per module."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

# The suite's daemons run on the loop a plain install has (asyncio), although the test
# extra installs uvloop for the tests that use it by name (tests/test_send_path.py).
os.environ.setdefault("SANDBOXKIT_EVENT_LOOP", "asyncio")
from sandboxkit.daemon.isolation import ISOLATION_ENV

# Most of the suite runs commands by host paths (sys.executable, scripts in tmp_path),
# which a namespaced sandbox does not see (a root daemon's sandboxes cannot even reach
# root's home, where the interpreter may live): its daemons default to no isolation.
# The isolation tests ask for namespaces by name (tests/test_isolation*.py), and the
# README's snippets run with the shipped default (tests/test_readme.py).
os.environ.setdefault(ISOLATION_ENV, "none")

# A home of the run's own, in its TMPDIR (one per worker, removed at its end). The
# suite's commands run as this user, many in login shells (the e2b SDK starts every
# command as `bash -l -c`), and a login shell runs the profile its HOME holds: the
# machine's is not the suite's to run. This one's ran pyenv's rehash, which writes under
# a lock; a shell the suite killed left the lock behind, and every login shell on the
# machine then waited a minute on it (tests/test_e2b_envd.py). JupyterLab, its kernels
# and Chromium keep their files here too.
os.environ["HOME"] = tempfile.mkdtemp(prefix="home-")

from support import fast_config, root_unlocked

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.recovery import ROOT_PREFIX
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.daemon.standby import SCRIPT as STANDBY_SCRIPT

_HOME = os.environ["HOME"]  # (above): removed when this process's run ends

if TYPE_CHECKING:
    from jupyter_harness import SharedLab
    from playwright.sync_api import Browser


@pytest.fixture
def daemon_config() -> DaemonConfig:
    """Override in a test module to change the in-process daemon's settings."""
    return fast_config()


@pytest.fixture(scope="module")
def envd_daemon() -> Iterator[DaemonServer]:
    """A real daemon that also serves the envd-compatible endpoint (the e2b SDK's way
    in), one per test module."""
    server = DaemonServer(fast_config(), envd_port=0).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def daemon(daemon_config: DaemonConfig) -> Iterator[DaemonServer]:
    """A real daemon (uvicorn on 127.0.0.1, random port, bearer token) on a thread."""
    server = DaemonServer(daemon_config).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def conn(daemon: DaemonServer) -> dict[str, str | None]:
    """Keyword arguments that point a client at the in-process daemon."""
    return {"url": daemon.url, "token": daemon.token}


@pytest.fixture
async def host() -> AsyncIterator[Host]:
    """The daemon core without HTTP, on the test's event loop."""
    async with Host(fast_config()) as h:
        yield h


@pytest.fixture(scope="session")
def jupyter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedLab]:
    """One JupyterLab server for every browser test of the run; each test takes a notebook
    (and kernel, and daemon) of its own from it (see ``jupyter_harness.SharedLab``)."""
    from jupyter_harness import SharedLab, require_browser_stack

    require_browser_stack()
    with SharedLab.running(tmp_path_factory.mktemp("jupyter")) as lab:
        yield lab


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless chromium for a module's browser tests (each test opens its own context);
    at the module's end, whatever it started is ended."""
    from jupyter_harness import chromium, require_browser_stack

    require_browser_stack()
    with chromium() as b:
        yield b


@pytest.fixture(autouse=True)
def no_leaked_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every process a test starts must be gone when it ends. A browser test's are checked
    by what starts them, which outlive a test on purpose (the ``browser`` of a module, the
    ``jupyter`` of the run), each for what it started: a notebook for its kernel and daemon
    (``SharedLab.notebook``), the browser and the server for their own processes."""
    if request.node.get_closest_marker("browser") is not None:
        yield
        return
    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}
    yield
    # A sandbox that outlives its test (in a module's daemon) keeps its launcher or its
    # next launch started (sandboxkit/daemon/launcher.py, standby.py): that is checked
    # when the module ends.
    _none_left(lambda p: p.pid not in before and not _standby(p), "test")


@pytest.fixture(scope="module", autouse=True)
def no_leaked_standbys() -> Iterator[None]:
    """No sandbox's launcher or standby outlives the module, whose daemons are gone by then (this
    fixture, set up before them, is torn down after them)."""
    yield
    _none_left(_standby, "module")


def _none_left(leaked: Callable[[psutil.Process], bool], what: str) -> None:
    me = psutil.Process(os.getpid())
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in me.children(recursive=True) if _alive(p) and leaked(p)]
        if not left:
            return
        if time.monotonic() > deadline:
            for p in left:
                p.kill()
            pytest.fail(f"{what} left processes behind: {[p.cmdline() for p in left]}")
        time.sleep(0.02)  # sleep-ok: poll interval


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _standby(p: psutil.Process) -> bool:
    """A standby's or a launcher's processes (bubblewrap's, the wrapper) end in its argv
    (a launcher's: its program's descriptor and its socket's)."""
    try:
        argv = p.cmdline()
    except psutil.Error:
        return False
    launcher = len(argv) >= 2 and _LAUNCHER.fullmatch(argv[-2]) and argv[-1].isdigit()
    return argv[-4:] == ["/bin/sh", "-c", STANDBY_SCRIPT, "sh"] or bool(launcher)


_LAUNCHER = re.compile(r"/proc/self/fd/\d+")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (pyproject's addopts): a module's tests run on one worker, in
    order, beside its module-scoped daemons (as without xdist); every browser test goes
    to one worker, where they share one JupyterLab (``jupyter``) — two at once would load
    2 cores with two servers and two Chromiums.

    xdist groups tests by a suffix it adds to their ids (``@group``) in a hook of its own
    on each worker, from the marks it finds then: this hook runs first, or the marks come
    too late and nothing is grouped. pytest 9.2 no longer takes the suffix (pytest-xdist
    issue 1386): pyproject keeps pytest below 9.2 until xdist passes groups another way.
    ``tests/test_suite.py`` fails if the groups are lost."""
    for item in items:
        group = "browser" if item.get_closest_marker("browser") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


_ROOTS_BEFORE: set[Path] = set()


def pytest_sessionstart(session: pytest.Session) -> None:
    _ROOTS_BEFORE.update(Path(tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*"))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close widgets still alive, before interpreter teardown makes ipywidgets' own
    ``__del__`` fail noisily. In the process that ran the workers (pytest-xdist's, after
    they exited): fail the run if a daemon of it left its root in the run's ``TMPDIR``
    (a root not there at the start whose lock nobody holds: one stopped at interpreter
    exit did, and one made and never started, once its process ended)."""
    import sys

    widgets = sys.modules.get("ipywidgets")
    if widgets is not None:
        widgets.Widget.close_all()
    if hasattr(session.config, "workerinput"):
        return  # a worker: its own in-process daemons' locks are still held here
    tmp = Path(tempfile.gettempdir())
    new = set(tmp.glob(f"{ROOT_PREFIX}*")) - _ROOTS_BEFORE
    left = sorted(p.name for p in new if root_unlocked(p))
    if left:
        print(f"\nFAILED: daemons of the run left their roots in {tmp}: {left}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_HOME, ignore_errors=True)
