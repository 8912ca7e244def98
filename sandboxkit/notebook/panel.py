"""``ProcessPanel``: a live, throttled tail of one process, with its repair buttons.

Public API (for the other notebook modules, tests and users)::

    from sandboxkit.notebook import ProcessPanel, PanelState
    panel = ProcessPanel(sbx, pid, cursor=None, max_lines=500, stall_after=5.0,
                         flush_hz=10.0)   # sbx: a sync Sandbox or an AsyncSandbox
    panel                      # displays panel.widget (a VBox, CSS class sandboxkit-panel)
    panel.pid                  # the process followed now (changes on Kill-restart)
    panel.lines                # retained complete lines (newest last, at most max_lines)
    panel.line_count           # complete lines received in total (since the last restart)
    panel.state                # the PanelState (plain Python, thread-safe): cursor, head,
                               # process_state, sandbox_state, exit_code, attached, error,
                               # version, stalled(), snapshot()
    panel.on_reattach()        # disconnect, reconnect from the cursor: no loss, no dup
    panel.on_kill_restart()    # commands.restart(pid); follow the NEW pid from cursor 0
    panel.on_pause_resume()    # pause / resume the sandbox; the button label follows
    panel.on_detach()          # stop following (the process keeps running)
    panel.on_send_stdin(text=None)  # text (default: the stdin box, then cleared) + "\n"
    panel.flush()              # push state into the widgets now (only what changed)
    panel.close()              # cancel tasks, disconnect, close widgets (idempotent)
    await panel.aclose()       # the same, awaiting every task (use it on a running loop)
    panel.tasks                # owned tasks still running (0 after a completed close)
    panel.flushes              # how many flushes changed the tail's value

    Widgets: panel.widget (VBox), panel.tail (HTML), panel.status (HTML),
    panel.buttons["Reattach" | "Kill-restart" | "Pause" | "Detach" | "Send"]
    (panel.pause_button is buttons["Pause"], labelled "Pause" or "Resume"),
    panel.stdin_box (Text), panel.send_button.

Each handler runs its client calls on the sandbox's loop. Without a running event loop
in the calling thread (a plain script, a sync test) it blocks until done, flushes and
returns ``None``; inside a running loop (a Jupyter kernel, an async test) it returns an
owned ``asyncio.Task`` at once (await it to wait; it flushes when done); called from
another thread while the kernel loop runs, it hands the action to that loop and returns
``None``. Actions are serialised. Errors are shown in the status line (``state.error``)
and raised from the call / the awaited task.

CSS classes (for browser tests): the top box ``sandboxkit-panel``; the tail, one
``ipywidgets.HTML`` whose value is the whole ring buffer in one ``<pre>`` (stderr lines
in a red ``<span>``), ``sandboxkit-tail``; the status line ``sandboxkit-status``, whose
text reads ``pid <n> · <state> · cursor <c> · [head <h> ·] lines <line_count> · <rate> ·
last byte <age>`` (plus ``detached``, ``exit <code>``, ``error: ...`` when they apply)
and, when stalled, ends with a ``<span class="sandboxkit-stalled">STALLED</span>`` badge.

Threading: stream callbacks run on the sandbox's loop and only feed the
:class:`PanelState` (under its lock). Widget values are set only by :meth:`ProcessPanel.flush`,
on the kernel thread: by a ticker on the kernel loop at most ``flush_hz`` times a second,
and only when the state's version changed (so 1000 lines/s cost at most ``flush_hz``
comm messages a second) — or, with no running loop, by explicit ``flush()`` calls.

The STALLED badge: the process is alive (running or paused), the panel is attached,
output is pending (the daemon's head, polled every second from the sandbox's consumer
metrics, is beyond our cursor) and nothing arrived for ``stall_after`` seconds. The poll
reads ``consumers()`` rather than ``commands.get(pid)`` on purpose: the latter counts as
an access, so it would restart the sandbox's idle timer every second and, with
``auto_resume``, undo a pause at once.
"""

from __future__ import annotations

import asyncio
import html
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]

from sandboxkit.client.commands import AsyncCommandHandle
from sandboxkit.errors import CommandExitError
from sandboxkit.notebook._runtime import AnySandbox, Runtime

__all__ = ["PanelSnapshot", "PanelState", "ProcessPanel"]

STREAMS = ("stdout", "stderr")
_RATE_WINDOW = 2.0
_MAX_PARTIAL = 64 * 1024
_POLL_INTERVAL = 1.0
_STDERR_STYLE = "color:#c0392b"


def _display_line(line: str) -> str:
    """A carriage return rewrites the line in a terminal: show what remains visible."""
    if "\r" in line:
        line = line.rstrip("\r").rsplit("\r", 1)[-1]
    return line


@dataclass(frozen=True)
class PanelSnapshot:
    """One consistent view of a :class:`PanelState`: what the widgets render."""

    pid: int
    version: int
    lines_version: int
    entries: tuple[tuple[str, str], ...]
    """Retained complete lines as ``(stream, text)``, oldest first."""
    partial: tuple[tuple[str, str], ...]
    """Unterminated tails of stdout / stderr, if any."""
    line_count: int
    bytes_received: int
    rate: float
    """Bytes per second over the last couple of seconds."""
    age: float | None
    """Seconds since the last byte (``None``: nothing received yet)."""
    cursor: int | None
    head: int | None
    process_state: str | None
    sandbox_state: str | None
    exit_code: int | None
    attached: bool
    error: str | None
    stalled: bool

    @property
    def text(self) -> str:
        """The tail as plain text (stderr lines included, unmarked)."""
        return "\n".join(_display_line(t) for _, t in self.entries + self.partial)

    @property
    def status(self) -> str:
        """The status line as plain text (``STALLED`` at the end when stalled)."""
        parts = [f"pid {self.pid}", self.process_state or "connecting"]
        if self.exit_code is not None:
            parts.append(f"exit {self.exit_code}")
        if self.sandbox_state == "paused" and self.process_state != "paused":
            parts.append("sandbox paused")
        parts.append(f"cursor {'-' if self.cursor is None else self.cursor}")
        if self.head is not None:
            parts.append(f"head {self.head}")
        parts.append(f"lines {self.line_count}")
        parts.append(_format_rate(self.rate))
        parts.append("no output yet" if self.age is None else f"last byte {self.age:.0f}s ago")
        if not self.attached:
            parts.append("detached")
        if self.error:
            parts.append(f"error: {self.error}")
        if self.stalled:
            parts.append("STALLED")
        return " · ".join(parts)


def _format_rate(rate: float) -> str:
    if rate >= 1024 * 1024:
        return f"{rate / (1024 * 1024):.1f} MB/s"
    if rate >= 1024:
        return f"{rate / 1024:.1f} kB/s"
    return f"{rate:.0f} B/s"


class PanelState:
    """What a :class:`ProcessPanel` shows, as plain thread-safe Python.

    Stream callbacks feed it from the sandbox's loop (:meth:`feed_stdout`,
    :meth:`feed_stderr`); the panel's poll updates the process facts
    (:meth:`update_process`); the widget layer reads :meth:`snapshot`. Every change bumps
    :attr:`version` (and a change to the lines, :attr:`lines_version`), so a flush can skip
    unchanged state. ``clock`` (monotonic seconds) is injectable for tests.
    """

    def __init__(
        self,
        pid: int,
        *,
        max_lines: int = 500,
        stall_after: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_lines < 1:
            raise ValueError("max_lines must be at least 1")
        self.max_lines = max_lines
        self.stall_after = stall_after
        self.clock = clock
        self._lock = threading.Lock()
        self.version = 0
        self.lines_version = 0
        self._reset(pid)

    def _reset(self, pid: int) -> None:
        self.pid = pid
        self._entries: deque[tuple[str, str]] = deque(maxlen=self.max_lines)
        self._partial: dict[str, str] = {s: "" for s in STREAMS}
        self.line_count = 0
        self.bytes_received = 0
        self.chunks = 0
        self._recent: deque[tuple[float, int]] = deque()
        self.last_byte_at: float | None = None
        self.attached_at: float | None = None
        self.attached = False
        self.cursor: int | None = None
        self.head: int | None = None
        self.process_state: str | None = None
        self.sandbox_state: str | None = None
        self.exit_code: int | None = None
        self.error: str | None = None

    def _set_cursor(self, cursor: int) -> None:
        self.cursor = cursor
        if self.head is not None and cursor > self.head:
            self.head = cursor  # we received it, so the daemon's head is at least here

    def _bump(self, lines: bool = False) -> None:
        self.version += 1
        if lines:
            self.lines_version += 1

    # -- writers ---------------------------------------------------------------------

    def reset(self, pid: int) -> None:
        """Forget everything: a new process (after a restart) starts from scratch."""
        with self._lock:
            self._reset(pid)
            self._bump(lines=True)

    def feed(self, stream: str, text: str, cursor: int | None = None) -> None:
        """Add decoded output of ``stream``; ``cursor`` is the stream's cursor after it.

        Lines may span chunks: an unterminated tail waits for its newline (and is shown
        meanwhile). A tail longer than 64 KiB is cut into a line of its own.
        """
        stream = "stderr" if stream == "stderr" else "stdout"
        now = self.clock()
        with self._lock:
            if cursor is not None:
                self._set_cursor(cursor)
            if not text:
                self._bump()
                return
            size = len(text.encode("utf-8", "surrogateescape"))
            self.bytes_received += size
            self.chunks += 1
            self.last_byte_at = now
            self._recent.append((now, size))
            self._trim_recent(now)
            buffered = self._partial[stream] + text
            parts = buffered.split("\n")
            tail = parts.pop()
            while len(tail) > _MAX_PARTIAL:
                parts.append(tail[:_MAX_PARTIAL])
                tail = tail[_MAX_PARTIAL:]
            self._partial[stream] = tail
            for line in parts:
                self._entries.append((stream, line[:-1] if line.endswith("\r") else line))
            self.line_count += len(parts)
            self._bump(lines=True)

    def feed_stdout(self, text: str, cursor: int | None = None) -> None:
        """:meth:`feed` for stdout (usable as an ``on_stdout`` callback)."""
        self.feed("stdout", text, cursor)

    def feed_stderr(self, text: str, cursor: int | None = None) -> None:
        """:meth:`feed` for stderr (usable as an ``on_stderr`` callback)."""
        self.feed("stderr", text, cursor)

    def set_attached(self, attached: bool, cursor: int | None = None) -> None:
        """Record that the panel (re)attached (silence counts from now) or detached."""
        with self._lock:
            self.attached = attached
            if attached:
                self.attached_at = self.clock()
            if cursor is not None:
                self._set_cursor(cursor)
            self._bump()

    def update_process(
        self,
        *,
        state: str | None = None,
        sandbox_state: str | None = None,
        head: int | None = None,
        cursor: int | None = None,
        exit_code: int | None = None,
    ) -> None:
        """Record polled facts; only the given ones change. ``head`` never goes back
        (the daemon's head is monotonic per process)."""
        with self._lock:
            before = (self.process_state, self.sandbox_state, self.head, self.cursor)
            before_exit = self.exit_code
            if state is not None:
                self.process_state = state
            if sandbox_state is not None:
                self.sandbox_state = sandbox_state
            if head is not None:
                self.head = max(head, self.head or 0, self.cursor or 0)
            if cursor is not None:
                self._set_cursor(cursor)
            if exit_code is not None:
                self.exit_code = exit_code
            after = (self.process_state, self.sandbox_state, self.head, self.cursor)
            if after != before or self.exit_code != before_exit:
                self._bump()

    def set_error(self, error: str | None) -> None:
        """Show (or clear, with ``None``) an error in the status line."""
        with self._lock:
            if error != self.error:
                self.error = error
                self._bump()

    # -- readers ---------------------------------------------------------------------

    @property
    def lines(self) -> list[str]:
        """The retained complete lines, oldest first."""
        with self._lock:
            return [text for _, text in self._entries]

    def _trim_recent(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > _RATE_WINDOW:
            self._recent.popleft()

    def _rate(self, now: float) -> float:
        self._trim_recent(now)
        return sum(size for _, size in self._recent) / _RATE_WINDOW

    def rate(self, now: float | None = None) -> float:
        """Bytes per second received over the last two seconds."""
        with self._lock:
            return self._rate(self.clock() if now is None else now)

    def _pending(self) -> bool:
        return self.head is not None and self.head > (self.cursor or 0)

    def _stalled(self, now: float) -> bool:
        if not self.attached or self.process_state not in ("running", "paused"):
            return False
        if not self._pending():
            return False
        since = self.last_byte_at if self.last_byte_at is not None else self.attached_at
        if since is None:
            return False
        if self.attached_at is not None:
            since = max(since, self.attached_at)
        return now - since >= self.stall_after

    def stalled(self, now: float | None = None) -> bool:
        """Alive (running or paused), attached, output pending (head beyond cursor) and
        silent — nothing received since attaching or for ``stall_after`` seconds."""
        with self._lock:
            return self._stalled(self.clock() if now is None else now)

    def snapshot(self, now: float | None = None) -> PanelSnapshot:
        """A consistent copy of everything the widgets render."""
        with self._lock:
            now = self.clock() if now is None else now
            partial = tuple((s, self._partial[s]) for s in STREAMS if self._partial[s])
            return PanelSnapshot(
                pid=self.pid,
                version=self.version,
                lines_version=self.lines_version,
                entries=tuple(self._entries),
                partial=partial,
                line_count=self.line_count,
                bytes_received=self.bytes_received,
                rate=self._rate(now),
                age=None if self.last_byte_at is None else max(0.0, now - self.last_byte_at),
                cursor=self.cursor,
                head=self.head,
                process_state=self.process_state,
                sandbox_state=self.sandbox_state,
                exit_code=self.exit_code,
                attached=self.attached,
                error=self.error,
                stalled=self._stalled(now),
            )


def render_tail(snapshot: PanelSnapshot) -> str:
    """The tail widget's HTML: every retained line in one ``<pre>``, newest at the bottom
    and kept in view (a ``column-reverse`` box anchors its scroll position at the end)."""
    rows = []
    for stream, text in snapshot.entries + snapshot.partial:
        line = html.escape(_display_line(text))
        rows.append(f'<span style="{_STDERR_STYLE}">{line}</span>' if stream == "stderr" else line)
    body = "\n".join(rows)
    return (
        '<div style="display:flex;flex-direction:column-reverse;max-height:24em;'
        'overflow-y:auto;border:1px solid #ddd;background:#fafafa">'
        '<pre style="margin:0;padding:4px;font-size:12px;line-height:1.3">'
        f"{body}</pre></div>"
    )


def render_status(snapshot: PanelSnapshot) -> str:
    """The status widget's HTML (a STALLED badge span when stalled)."""
    text = html.escape(snapshot.status.removesuffix(" · STALLED"))
    if snapshot.stalled:
        text += (
            ' <span class="sandboxkit-stalled" style="background:#c0392b;color:white;'
            'padding:0 6px;border-radius:3px;font-weight:bold">STALLED</span>'
        )
    return f'<span style="font-family:monospace;font-size:12px">{text}</span>'


class _Follower:
    """Callbacks of one attach: feed the state with the stream's cursor, until retired."""

    def __init__(self, state: PanelState) -> None:
        self.state = state
        self.handle: AsyncCommandHandle | None = None
        self.active = True
        self.seen: tuple[str | None, str | None] = (None, None)

    def _cursor(self) -> int | None:
        return None if self.handle is None else self.handle.cursor

    def stdout(self, text: str) -> None:
        if self.active:
            self.state.feed("stdout", text, self._cursor())

    def stderr(self, text: str) -> None:
        if self.active:
            self.state.feed("stderr", text, self._cursor())


class ProcessPanel:
    """A live tail of process ``pid`` with Reattach / Kill-restart / Pause-Resume /
    Detach buttons and a stdin box (see the module docstring for the whole API)."""

    def __init__(
        self,
        sbx: AnySandbox,
        pid: int,
        *,
        cursor: int | None = None,
        max_lines: int = 500,
        stall_after: float = 5.0,
        flush_hz: float = 10.0,
    ) -> None:
        self._rt = Runtime(sbx)
        assert self._rt.sandbox is not None
        self._sbx = self._rt.sandbox
        self.state = PanelState(pid, max_lines=max_lines, stall_after=stall_after)
        self.flush_hz = flush_hz
        self.poll_interval = _POLL_INTERVAL
        self.flushes = 0
        """How many flushes changed the tail widget's value."""
        self._follower: _Follower | None = None
        self._action_lock = asyncio.Lock()  # used on the sandbox loop only
        self._closed = False
        self._flushed_lines = -1
        self._build_widgets()
        self.state.update_process(sandbox_state=self._sbx.info.state)
        self._rt.start_background(self._poll_loop(), name=f"sandboxkit-panel-poll-{pid}")
        self._starting = self._action(self._attach(cursor))
        self._ticker = self._rt.ticker(self.flush, flush_hz)

    # -- widgets ---------------------------------------------------------------------

    def _build_widgets(self) -> None:
        self.tail = widgets.HTML(value=render_tail(self.state.snapshot()))
        self.tail.add_class("sandboxkit-tail")
        self.status = widgets.HTML(value="")
        self.status.add_class("sandboxkit-status")
        names = ("Reattach", "Kill-restart", "Pause", "Detach")
        self.buttons: dict[str, widgets.Button] = {
            name: widgets.Button(description=name, layout=widgets.Layout(width="auto"))
            for name in names
        }
        self.buttons["Reattach"].on_click(lambda _b: self.on_reattach())
        self.buttons["Kill-restart"].on_click(lambda _b: self.on_kill_restart())
        self.buttons["Pause"].on_click(lambda _b: self.on_pause_resume())
        self.buttons["Detach"].on_click(lambda _b: self.on_detach())
        self.pause_button = self.buttons["Pause"]
        self.stdin_box = widgets.Text(placeholder="stdin (Send appends a newline)")
        self.send_button = widgets.Button(description="Send", layout=widgets.Layout(width="auto"))
        self.send_button.on_click(lambda _b: self.on_send_stdin())
        self.buttons["Send"] = self.send_button
        self.widget = widgets.VBox(
            [
                self.status,
                self.tail,
                widgets.HBox(list(self.buttons.values())[:4]),
                widgets.HBox([self.stdin_box, self.send_button]),
            ]
        )
        self.widget.add_class("sandboxkit-panel")

    def _widgets(self) -> list[widgets.Widget]:
        return [
            self.tail,
            self.status,
            *self.buttons.values(),
            self.stdin_box,
            *self.widget.children,
            self.widget,
        ]

    def flush(self) -> bool:
        """Push the state into the widgets, setting only what changed; True when the
        tail's value was set. Call on the kernel thread (the ticker does, ``flush_hz``
        times a second at most); with no running loop, call it yourself."""
        if self._closed:
            return False
        snap = self.state.snapshot()
        changed = False
        if snap.lines_version != self._flushed_lines:
            self._flushed_lines = snap.lines_version
            value = render_tail(snap)
            if value != self.tail.value:
                self.tail.value = value
                self.flushes += 1
                changed = True
        status = render_status(snap)
        if status != self.status.value:
            self.status.value = status
        label = "Resume" if snap.sandbox_state == "paused" else "Pause"
        if self.pause_button.description != label:
            self.pause_button.description = label
        return changed

    # -- public attributes -------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The process followed now (a Kill-restart switches it to the new one)."""
        return self.state.pid

    @property
    def lines(self) -> list[str]:
        """The retained complete lines (at most ``max_lines``), newest last."""
        return self.state.lines

    @property
    def line_count(self) -> int:
        """Complete lines received in total since the panel (re)started the process."""
        return self.state.line_count

    @property
    def tasks(self) -> int:
        """Owned tasks still running (0 once closed)."""
        return self._rt.tasks

    # -- handlers ----------------------------------------------------------------------

    def _action(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        if self._closed:
            coro.close()
            raise RuntimeError("this panel is closed")

        def done(_: None) -> None:
            self.flush()

        def failed(exc: BaseException) -> None:
            self.state.set_error(f"{type(exc).__name__}: {exc}")
            self.flush()

        return self._rt.dispatch(self._locked(coro), done, failed)

    async def _locked(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            async with self._action_lock:
                self.state.set_error(None)
                await coro
        finally:
            coro.close()  # never started if cancelled while waiting for the lock

    def on_reattach(self) -> asyncio.Task[None] | None:
        """Disconnect the current stream and reconnect from its cursor: the line
        sequence continues with no loss and no duplicate."""
        return self._action(self._reattach())

    def on_kill_restart(self) -> asyncio.Task[None] | None:
        """Kill and restart the process (``commands.restart``) and follow the new pid
        from cursor 0, with a fresh state."""
        return self._action(self._kill_restart())

    def on_pause_resume(self) -> asyncio.Task[None] | None:
        """Pause the sandbox, or resume it if it is paused; the button label follows."""
        return self._action(self._pause_resume())

    def on_detach(self) -> asyncio.Task[None] | None:
        """Stop following the output (the process keeps running; Reattach resumes from
        the cursor)."""
        return self._action(self._detach())

    def on_send_stdin(self, text: str | None = None) -> asyncio.Task[None] | None:
        """Send ``text`` (default: the stdin box's value, which is then cleared) and a
        newline to the process's stdin."""
        if text is None:
            text = self.stdin_box.value
            self.stdin_box.value = ""
        return self._action(self._send_stdin(text + "\n"))

    # -- actions (on the sandbox loop) -----------------------------------------------

    async def _attach(self, cursor: int | None) -> None:
        if self._closed:
            return
        follower = _Follower(self.state)
        handle = await self._sbx.commands.connect(
            self.state.pid, cursor, on_stdout=follower.stdout, on_stderr=follower.stderr
        )
        follower.handle = handle
        self._follower = follower
        self.state.set_attached(True, cursor)
        self._rt.spawn_background(
            self._watch(follower), name=f"sandboxkit-panel-watch-{handle.pid}"
        )

    async def _watch(self, follower: _Follower) -> None:
        """Record the end of a followed stream: exit code, or a definitive error."""
        assert follower.handle is not None
        try:
            await follower.handle.wait()
        except CommandExitError:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a definitive stream error (ResultUnavailable...)
            if follower.active:
                self.state.set_error(f"{type(exc).__name__}: {exc}")
        if follower.active and follower.handle.exit_code is not None:
            self.state.update_process(
                state="exited", exit_code=follower.handle.exit_code, cursor=follower.handle.cursor
            )

    async def _detach_stream(self) -> int | None:
        """Disconnect the current stream; the cursor it reached (``None`` if none)."""
        follower, self._follower = self._follower, None
        if follower is None or follower.handle is None:
            return None
        await follower.handle.disconnect()
        follower.active = False
        cursor = follower.handle.cursor
        self.state.set_attached(False, cursor)
        return cursor

    async def _reattach(self) -> None:
        cursor = await self._detach_stream()
        if cursor is None:
            cursor = self.state.cursor
        await self._attach(cursor)

    async def _kill_restart(self) -> None:
        await self._detach_stream()
        info = await self._sbx.commands.restart(self.state.pid)
        self.state.reset(info.pid)
        self.state.update_process(state=info.state, sandbox_state=self._sbx.info.state)
        await self._attach(0)

    async def _pause_resume(self) -> None:
        if self.state.sandbox_state == "paused":
            await self._sbx.resume()
        else:
            await self._sbx.pause()
        self.state.update_process(sandbox_state=self._sbx.info.state)

    async def _detach(self) -> None:
        await self._detach_stream()

    async def _send_stdin(self, data: str) -> None:
        await self._sbx.commands.send_stdin(self.state.pid, data)

    # -- the poll (on the sandbox loop) ----------------------------------------------

    async def _poll_loop(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # e.g. the sandbox was killed: show it, keep going
                self.state.set_error(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(self.poll_interval)

    async def poll(self) -> None:
        """Refresh the process facts once: states from the stream's keepalives, the
        daemon's head from the consumer metrics. Runs on the sandbox loop."""
        follower = self._follower
        if follower is not None and follower.handle is not None and follower.active:
            stream = follower.handle.stream
            seen = (stream.process_state, stream.sandbox_state)
            if seen != follower.seen:  # only news: never undo a state set by an action
                follower.seen = seen
                self.state.update_process(state=seen[0], sandbox_state=seen[1])
            self.state.update_process(cursor=follower.handle.cursor)
        pid = self.state.pid
        frame = await self._sbx.consumers()
        rows = frame[frame["pid"] == pid]
        if len(rows):
            self.state.update_process(head=int(rows["head"].max()))

    # -- display and teardown ----------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)  # type: ignore[no-untyped-call, unused-ignore]

    async def _teardown(self) -> None:
        async with self._action_lock:
            await self._detach_stream()

    def close(self) -> None:
        """Stop the ticker, the poll and the stream (the process keeps running) and close
        every widget. Idempotent. With an AsyncSandbox the stream's teardown finishes on
        the loop shortly after; ``await panel.aclose()`` waits for it."""
        if self._closed:
            return
        self._closed = True
        self._rt.close(self._teardown())
        self._close_widgets()

    async def aclose(self) -> None:
        """:meth:`close`, awaiting every task and stream it stops."""
        if not self._closed:
            self._closed = True
            self._close_widgets()
            await self._rt.aclose(self._teardown())
        else:
            await self._rt.aclose()

    def _close_widgets(self) -> None:
        for widget in self._widgets():
            widget.close()

    def __repr__(self) -> str:
        return f"<ProcessPanel pid={self.pid} lines={self.line_count}>"
