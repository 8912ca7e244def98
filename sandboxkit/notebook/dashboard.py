"""``SandboxDashboard``: create, pause, resume and kill sandboxes; start commands; see
every process of the selected sandbox with its state and number of consumers.

It shows this notebook's sandboxes (those this kernel created or connected to, and the
one it was given) by default; the "all sandboxes" toggle shows every sandbox the daemon
knows, and killed ones appear only with "killed too". Its buttons act only on a sandbox
it shows: after a Kill it selects another one it shows, or none.

The logic is plain Python a test drives without a browser: every button calls a named
handler (:meth:`SandboxDashboard.on_create`, :meth:`~SandboxDashboard.on_pause`,
:meth:`~SandboxDashboard.on_resume`, :meth:`~SandboxDashboard.on_kill`,
:meth:`~SandboxDashboard.on_start`, :meth:`~SandboxDashboard.refresh`), each one client
call followed by a refresh of :class:`DashboardState` (``dashboard_state.py``); the
widgets only render that state, with the plain functions of ``dashboard_render.py``.

Threading (see :mod:`sandboxkit.notebook._runtime`): client calls run on the client's
background loop thread and only update :class:`DashboardState` under a lock; widget values
are set only by :meth:`SandboxDashboard.flush`, on the thread that built the dashboard (the
kernel's). Inside a running kernel a handler returns an owned task at once, and one ticker
task on the kernel's loop re-reads the daemon every ``refresh_interval`` seconds without
blocking that loop; outside a running loop (a script, a test) a handler blocks until done
and nothing runs by itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]
import pandas as pd

from sandboxkit.client.api import ApiClient
from sandboxkit.client.event_watch import is_lifecycle, watch_events
from sandboxkit.client.loop_thread import LoopThread, shared_loop_thread
from sandboxkit.client.results import ProcessInfo, SandboxInfo
from sandboxkit.client.sandbox import AsyncSandbox, _connection, sandboxes_of_this_process
from sandboxkit.client.sync import Sandbox
from sandboxkit.errors import InvalidArgument, SandboxkitError, SandboxNotFound
from sandboxkit.notebook._runtime import Runtime
from sandboxkit.notebook._widget import close_tree
from sandboxkit.notebook.dashboard_render import (
    PROCESS_COLUMNS,
    SANDBOX_COLUMNS,
    processes_frame,
    processes_html,
    sandboxes_frame,
    sandboxes_html,
    status_html,
    title_html,
)
from sandboxkit.notebook.dashboard_state import SHOW_ALL, SHOW_KILLED, DashboardState, said
from sandboxkit.providers.base import load

__all__ = ["PROCESS_COLUMNS", "SANDBOX_COLUMNS", "DashboardState", "SandboxDashboard"]

T = TypeVar("T")

_Tables = tuple[list[SandboxInfo], list[ProcessInfo]]


_FLUSH_HZ = 10.0


def _loop_of(sbx: Sandbox) -> LoopThread:
    """The loop thread a sync sandbox runs its I/O on."""
    loop = getattr(sbx, "loop_thread", None)
    return loop if isinstance(loop, LoopThread) else shared_loop_thread()


class SandboxDashboard:
    """Create / pause / resume / kill sandboxes, start commands, and watch the process
    table (pid, command, state, consumers) of the selected sandbox.

    Every handler is one client call (plus a re-read of the tables) on the client's loop
    thread. Without a running event loop in the calling thread (a script, a sync test) it
    blocks until done, renders, and returns the call's value; inside a running loop (a
    Jupyter kernel) it returns an owned :class:`asyncio.Task` at once (``await`` it in a
    cell to get the value). Errors are shown in the status line (``state.error``) and
    raised from the call or the awaited task.

    Args:
        sbx: a sandbox to start with: a sync :class:`~sandboxkit.Sandbox` (used as is and
            not closed by :meth:`close`) or an :class:`~sandboxkit.AsyncSandbox` (the
            dashboard connects its own sync client to the same sandbox). ``None``: start
            empty; press "Create".
        refresh_interval: seconds between automatic refreshes inside a running kernel
            (``None`` or 0: only on actions and :meth:`refresh`).
        create_options: passed to :meth:`Sandbox.create` by :meth:`on_create` (e.g.
            ``lab=LabOptions(fanout="blocking", pause_ghosts=True)``); ``url``/``token`` also select
            the daemon the dashboard lists.
    """

    def __init__(
        self,
        sbx: Sandbox | AsyncSandbox | None = None,
        *,
        refresh_interval: float | None = 2.0,
        **create_options: Any,
    ) -> None:
        self.create_options = dict(create_options)
        self.state = DashboardState()
        self._lock = threading.Lock()
        self._clients: dict[str, Sandbox] = {}
        self._owned: set[str] = set()
        self._rendered = -1
        self._rendering = False
        self._closed = False
        self._url: str | None = create_options.get("url")
        self._token: str | None = create_options.get("token")
        inner = sbx.async_sandbox if isinstance(sbx, Sandbox) else sbx
        self._provider: str | None = create_options.get("provider") or getattr(
            inner, "provider", None
        )
        """``"e2b"``: the sandboxes are a provider's (listed and connected through it)."""
        self._provider_options: dict[str, Any] = dict(create_options.get("provider_options") or {})
        self._thread = _loop_of(sbx) if isinstance(sbx, Sandbox) else shared_loop_thread()
        self._runtime = Runtime(sbx if isinstance(sbx, Sandbox) else None)
        self._build_widgets()
        self._starting: Any
        if isinstance(sbx, AsyncSandbox):
            conn = sbx.connection
            self._url, self._token = conn.url, conn.token
            self._starting = self.select(sbx.sandbox_id)
        else:
            if sbx is not None:
                conn = sbx.async_sandbox.connection
                self._url, self._token = conn.url, conn.token
                self._clients[sbx.sandbox_id] = sbx
                self.state.selected = sbx.sandbox_id
            self._starting = self.refresh()
        self._ticker = (
            self._runtime.ticker(self._auto_refresh, 1.0 / refresh_interval)
            if refresh_interval
            else None
        )
        # Inside a kernel: the daemon's events say when to re-read (a pause, resume or
        # kill from anywhere shows within a flush), and a fast ticker renders what
        # changed (a flush with nothing new costs a comparison).
        self._flusher = self._runtime.ticker(self.flush, _FLUSH_HZ)
        if self._runtime.live and self._provider is None:
            self._runtime.start_background(
                self._follow_events(), name="sandboxkit-dashboard-events"
            )

    # -- widgets -----------------------------------------------------------------------

    def _build_widgets(self) -> None:
        layout = widgets.Layout(width="auto")
        self.title = widgets.HTML()
        self.selector = widgets.Dropdown(description="sandbox", options=[], layout=layout)
        self.selector.observe(self._on_select_change, names="value")
        self.create_button = widgets.Button(description="Create", icon="plus")
        self.pause_button = widgets.Button(description="Pause", icon="pause")
        self.resume_button = widgets.Button(description="Resume", icon="play")
        self.kill_button = widgets.Button(description="Kill", icon="trash", button_style="danger")
        self.refresh_button = widgets.Button(description="Refresh", icon="refresh")
        self.show_all_toggle = widgets.Checkbox(
            value=False, description=SHOW_ALL, indent=False, layout=layout
        )
        self.show_killed_toggle = widgets.Checkbox(
            value=False, description=SHOW_KILLED, indent=False, layout=layout
        )
        self.show_all_toggle.observe(self._on_toggle_change, names="value")
        self.show_killed_toggle.observe(self._on_toggle_change, names="value")
        self.command = widgets.Text(
            placeholder="command, e.g. python -u -c \"print('hi')\"",
            layout=widgets.Layout(width="60%"),
        )
        self.start_button = widgets.Button(description="Start", icon="terminal")
        self.sandbox_table = widgets.HTML()
        self.table = widgets.HTML()
        self.status = widgets.HTML()

        self.create_button.on_click(lambda _b: self.on_create())
        self.pause_button.on_click(lambda _b: self.on_pause())
        self.resume_button.on_click(lambda _b: self.on_resume())
        self.kill_button.on_click(lambda _b: self.on_kill())
        self.refresh_button.on_click(lambda _b: self.refresh())
        self.start_button.on_click(lambda _b: self.on_start())

        self.table.add_class("sandboxkit-processes")
        self.status.add_class("sandboxkit-dashboard-status")
        self.widget = widgets.VBox(
            [
                self.title,
                widgets.HBox(
                    [
                        self.selector,
                        self.create_button,
                        self.pause_button,
                        self.resume_button,
                        self.kill_button,
                        self.refresh_button,
                    ]
                ),
                # A row of their own: beside the buttons they squeezed "Resume" to "Resu…".
                widgets.HBox([self.show_all_toggle, self.show_killed_toggle]),
                self.sandbox_table,
                widgets.HBox([self.command, self.start_button]),
                self.table,
                self.status,
            ]
        )
        self.widget.add_class("sandboxkit-dashboard")

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)  # type: ignore[no-untyped-call, unused-ignore]

    # -- the selected sandbox ----------------------------------------------------------

    @property
    def sbx(self) -> Sandbox | None:
        """The client of the selected sandbox (``None`` if nothing is selected)."""
        with self._lock:
            selected = self.state.selected
            return None if selected is None else self._clients.get(selected)

    def select(self, sandbox_id: str | None) -> Any:
        """Make ``sandbox_id`` the sandbox the buttons act on (connects a client)."""

        async def step() -> str | None:
            await self._connect(sandbox_id)
            return sandbox_id

        return self._dispatch(step(), lambda sid: f"selected {sid}" if sid else "")

    async def _connect(self, sandbox_id: str | None) -> None:
        """Select ``sandbox_id``, connecting a client first if needed (sandbox loop)."""
        if sandbox_id is not None and sandbox_id not in self._clients:
            client: AsyncSandbox
            if self._provider is not None:
                client = await load(self._provider).connect(
                    sandbox_id, url=self._url, token=self._token, options=self._provider_options
                )
            else:
                client = await AsyncSandbox.connect(sandbox_id, url=self._url, token=self._token)
            with self._lock:
                self._clients[sandbox_id] = Sandbox(client, self._thread)
                self._owned.add(sandbox_id)
        with self._lock:
            self.state.selected = sandbox_id
            self.state.version += 1

    def _on_toggle_change(self, change: dict[str, Any]) -> None:
        if self._rendering:
            return
        if change["owner"] is self.show_all_toggle:
            self.on_show_all(change["new"])
        else:
            self.on_show_killed(change["new"])

    def _on_select_change(self, change: dict[str, Any]) -> None:
        if self._rendering or change["new"] == self.state.selected:
            return
        self.select(change["new"])

    # -- handlers ----------------------------------------------------------------------

    def on_create(self) -> Any:
        """Create a sandbox with the dashboard's ``create_options`` and select it; the
        new sync :class:`~sandboxkit.Sandbox` (or a task resolving to it)."""

        async def step() -> Sandbox:
            client = await AsyncSandbox.create(**self.create_options)
            sbx = Sandbox(client, self._thread)
            conn = client.connection
            with self._lock:
                self._url, self._token = conn.url, conn.token
                self._clients[sbx.sandbox_id] = sbx
                self._owned.add(sbx.sandbox_id)
                self.state.selected = sbx.sandbox_id
            return sbx

        return self._dispatch(step(), lambda sbx: f"created sandbox {sbx.sandbox_id}")

    def on_pause(self) -> Any:
        """Pause (freeze every process of) the selected sandbox."""

        async def step() -> str:
            sbx = self._require()
            await sbx.async_sandbox.pause()
            return sbx.sandbox_id

        return self._dispatch(step(), "paused {}".format)

    def on_resume(self) -> Any:
        """Resume (thaw) the selected sandbox."""

        async def step() -> str:
            sbx = self._require()
            await sbx.async_sandbox.resume()
            return sbx.sandbox_id

        return self._dispatch(step(), "resumed {}".format)

    def on_kill(self) -> Any:
        """Kill the selected sandbox (every process goes) and select another live one."""

        async def step() -> str:
            sbx = self._require()
            await sbx.async_sandbox.kill()  # also closes that client
            with self._lock:
                self._clients.pop(sbx.sandbox_id, None)
                self._owned.discard(sbx.sandbox_id)
            sandboxes = await self._list()
            with self._lock:
                self.state.sandboxes = sandboxes
                self.state.mine = self._mine()
                choice = self.state.next_choice(sbx.sandbox_id)
            await self._connect(choice)
            return sbx.sandbox_id

        return self._dispatch(step(), "killed {}".format)

    def on_start(self, cmd: str | list[str] | None = None) -> Any:
        """Start ``cmd`` (default: the text box, which is then cleared) in the selected
        sandbox, in the background and without following it; the new process's
        :class:`~sandboxkit.ProcessInfo` (or a task resolving to it)."""
        command = self.command.value if cmd is None else cmd
        if not command or (isinstance(command, str) and not command.strip()):
            self._set(error="type a command first")
            self.flush()
            raise InvalidArgument("type a command first", field="cmd")

        async def step() -> ProcessInfo:
            return await self._require().async_sandbox.commands.start(command)

        def started(info: ProcessInfo) -> str:
            if cmd is None and self.command.value == command:
                self.command.value = ""
            return f"started pid {info.pid}"

        return self._dispatch(step(), started)

    def on_show_all(self, show: bool = True) -> None:
        """Show every sandbox the daemon knows (``False``: only this notebook's). A
        selected sandbox the toggle hides is deselected: the buttons never act on a
        sandbox the dashboard does not show."""
        self._toggle(show_all=bool(show))

    def on_show_killed(self, show: bool = True) -> None:
        """Show killed sandboxes too (``False``: live ones only)."""
        self._toggle(show_killed=bool(show))

    def _toggle(self, **changes: bool) -> None:
        with self._lock:
            self.state.toggle(**changes)
        self.flush()

    def _mine(self) -> frozenset[str]:
        return sandboxes_of_this_process() | frozenset(self._clients)

    def refresh(self) -> Any:
        """Re-read the sandboxes and the selected sandbox's processes, then render."""
        if self._closed:
            return None

        async def step() -> None:
            return None

        return self._dispatch(step(), lambda _none: self.state.message)

    def _require(self) -> Sandbox:
        sbx = self.sbx
        if sbx is None:
            raise SandboxNotFound("no sandbox selected: press Create first")
        return sbx

    def _dispatch(self, step: Coroutine[Any, Any, T], done: Callable[[T], str]) -> Any:
        """Run ``step`` and a re-read of the tables on the loop thread; then, on the
        calling thread, record ``done(value)`` as the message and render."""

        if self._closed:
            step.close()
            raise RuntimeError("this dashboard is closed")

        async def action() -> tuple[T, _Tables]:
            value = await step
            return value, await self._fetch()

        def then(outcome: tuple[T, _Tables]) -> T:
            value, tables = outcome
            self._apply(*tables)
            self._set(message=done(value), error=None)
            self.flush()
            return value

        def failed(error: BaseException) -> None:
            self._set(error=f"{type(error).__name__}: {error}")
            self.flush()

        return self._runtime.dispatch(action(), then, failed)

    def _set(self, **changes: Any) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(self.state, key, value)
            self.state.version += 1

    # -- reading the daemon ------------------------------------------------------------

    async def _fetch(self) -> _Tables:
        """The sandbox list and the selected sandbox's processes (sandbox loop)."""
        client = self.sbx
        sandboxes = await self._list()
        processes: list[ProcessInfo] = []
        if client is not None:
            with contextlib.suppress(SandboxNotFound):
                processes = await client.async_sandbox.commands.list()
        return sandboxes, processes

    async def _list(self) -> list[SandboxInfo]:
        """The sandboxes to show: the daemon's, or the provider's (sandbox loop)."""
        if self._provider is not None:
            infos: list[SandboxInfo] = await load(self._provider).list_sandboxes(
                url=self._url, token=self._token, options=self._provider_options
            )
            return infos
        return await AsyncSandbox.list(url=self._url, token=self._token)

    def _apply(self, sandboxes: list[SandboxInfo], processes: list[ProcessInfo]) -> None:
        with self._lock:
            state = self.state
            mine = self._mine()
            if (sandboxes, processes, mine) != (state.sandboxes, state.processes, state.mine):
                state.sandboxes = sandboxes
                state.processes = processes
                state.mine = mine
                state.version += 1

    async def _follow_events(self) -> None:
        """On the sandbox loop, for the dashboard's life: re-read the tables whenever the
        daemon records a lifecycle event (from anyone)."""
        conn = await _connection(self._url, self._token)
        api = ApiClient(conn.url, conn.token)

        async def on_events(events: list[dict[str, Any]]) -> None:
            if self._closed or not any(is_lifecycle(e) for e in events):
                return
            said_now = said(events, self.state.selected)
            if said_now is not None:  # the last word: the daemon's, not this dashboard's
                self._set(message=said_now)
            with contextlib.suppress(SandboxkitError):
                self._apply(*await self._fetch())
            kernel = self._runtime.kernel_loop
            if kernel is not None and not self._closed:  # render now, on the kernel's thread
                with contextlib.suppress(RuntimeError):  # that loop is closed
                    kernel.call_soon_threadsafe(self.flush)

        try:
            await watch_events(api, on_events)
        finally:
            await api.aclose()

    async def _auto_refresh(self) -> None:
        """The ticker's callback on the kernel's loop: fetch off-loop, then render."""
        if self._closed:
            return
        try:
            tables = await self._runtime.call(self._fetch())
        except SandboxkitError as error:
            self._set(error=f"{type(error).__name__}: {error}")
        else:
            self._apply(*tables)
        self.flush()

    # -- tables ------------------------------------------------------------------------

    def processes_frame(self) -> pd.DataFrame:
        """The process table of the selected sandbox (columns :data:`PROCESS_COLUMNS`)."""
        with self._lock:
            processes = list(self.state.processes)
        return processes_frame(processes)

    def sandboxes_frame(self) -> pd.DataFrame:
        """The sandboxes shown (columns :data:`SANDBOX_COLUMNS`): this notebook's, or
        every one the daemon knows with :meth:`on_show_all`; killed ones only with
        :meth:`on_show_killed` (and the selected one, whatever became of it)."""
        with self._lock:
            sandboxes = self.state.shown()
            selected = self.state.selected
        return sandboxes_frame(sandboxes, selected)

    # -- rendering ---------------------------------------------------------------------

    def flush(self) -> bool:
        """Render the state into the widgets if it changed since the last flush; True if
        it rendered. Call on the thread that owns the widgets."""
        if self._closed:
            return False
        with self._lock:
            version = self.state.version
            if version == self._rendered:
                return False
            self._rendered = version
            selected = self.state.selected
            info = self.state.selected_info
            message, error = self.state.message, self.state.error
            options = [s.sandbox_id for s in self.state.shown() if s.state != "killed"]
            show_all, show_killed = self.state.show_all, self.state.show_killed
        processes = self.processes_frame()
        sandboxes = self.sandboxes_frame()

        if selected is not None and selected not in options:
            options.append(selected)
        self._rendering = True
        try:
            self.show_all_toggle.value = show_all
            self.show_killed_toggle.value = show_killed
            if list(self.selector.options) != options:
                self.selector.options = options
            self.selector.value = selected if selected in options else None
        finally:
            self._rendering = False

        self.title.value = title_html(selected, info, self._provider)
        running = info is not None and info.state == "running"
        self.pause_button.disabled = not running
        self.resume_button.disabled = not (info is not None and info.state == "paused")
        self.kill_button.disabled = info is None or info.state == "killed"
        self.start_button.disabled = not running
        self.sandbox_table.value = sandboxes_html(sandboxes, show_all)
        self.table.value = processes_html(processes)
        self.status.value = status_html(message, error)
        return True

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the periodic refresh and close the clients the dashboard opened (bounded).

        Sandboxes keep running (the daemon owns them); a sandbox passed in as a sync
        :class:`~sandboxkit.Sandbox` is left open for its owner. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._runtime.close(self._close_clients())
        close_tree(self.widget)

    async def aclose(self) -> None:
        """:meth:`close`, awaiting every task it stops."""
        if self._closed:
            await self._runtime.aclose()
            return
        self._closed = True
        await self._runtime.aclose(self._close_clients())
        close_tree(self.widget)

    async def _close_clients(self) -> None:
        """On the loop thread: close every client the dashboard opened."""
        with self._lock:
            owned = [self._clients[s] for s in self._owned if s in self._clients]
            self._owned.clear()
            self._clients.clear()
        for client in owned:
            with contextlib.suppress(SandboxkitError):
                await client.async_sandbox.close()

    def __enter__(self) -> SandboxDashboard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SandboxDashboard selected={self.state.selected}>"
