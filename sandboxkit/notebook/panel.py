"""``ProcessPanel``: a live terminal of one process, with its repair buttons.

A button's handler is a named method (``on_reattach``, ``on_kill_restart``,
``on_pause_resume``, ``on_detach``, ``on_send_stdin``) that a test or a cell can call; the
widgets are ``panel.widget``, ``panel.terminal`` and ``panel.buttons[label]``.

What goes to the browser (the front end is ``panel.js``, xterm.js inside an anywidget): only
new bytes, as binary buffers of anywidget custom messages, at most ``flush_hz`` comm
messages a second *including* the status line, which rides along only when something a
person reads changed, and the Pause button's label (:class:`DeltaPump`, ``panel_pump.py``;
a click's result and a view rendering go out at once). Beyond ``rate_cap`` bytes a second the
newest output is shown after a marker ``… N bytes skipped (cursor a–b)`` (bytes, and the
chunks a to b-1 in the status line's cursor unit): the kernel keeps at most one flush's
worth pending, so it never builds a backlog. A (re)rendered view asks for a
snapshot (the kernel's byte tail, bounded by ``tail_bytes``) and then applies deltas. The
browser keeps ``scrollback`` lines. Every buffer here is bounded in bytes.

What the panel shows is :class:`PanelState` (``panel_state.py``): plain Python that
tests drive without a widget; this module holds the widget, the stream it follows and
the handlers.

Each handler runs its client calls on the sandbox's loop. Without a running event loop
in the calling thread (a plain script, a sync test) it blocks until done, flushes and
returns ``None``; inside a running loop (a Jupyter kernel, an async test) it returns an
owned ``asyncio.Task`` at once (await it to wait; it flushes when done); called from
another thread while the kernel loop runs, it hands the action to that loop and returns
``None``. Actions are serialised, and each bumps the state's ``epoch``: a poll that began
before an action never writes its result after it. Errors are shown in the status line
(``state.error``) and raised from the call / the awaited task.

The status line (CSS class ``sandboxkit-status``) reads ``pid <n> · <state> · cursor <c> ·
[head <h> ·] lines <line_count> · <rate>`` (plus ``detached``, ``exit <code>``,
``error: ...`` when they apply); the browser appends ``last byte <age>`` by itself, and a
``<span class="sandboxkit-stalled">STALLED</span>`` badge when stalled.

The STALLED badge: the process is alive (running or paused), the panel is attached,
output is pending (the daemon's head, polled every second from the sandbox's consumer
metrics, is beyond our cursor) and nothing arrived for ``stall_after`` seconds. The poll
reads ``consumers()`` rather than ``commands.get(pid)`` on purpose: the latter counts as
an access, so it would restart the sandbox's idle timer every second and, with
``auto_resume``, undo a pause at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]
import traitlets

from sandboxkit.client.commands import AsyncCommandHandle
from sandboxkit.client.stream import GapInfo
from sandboxkit.errors import CommandExitError, SandboxkitError
from sandboxkit.notebook._frontend import HERE, VendoredWidget, esm
from sandboxkit.notebook._runtime import AnySandbox, Ticker
from sandboxkit.notebook._widget import WidgetBase
from sandboxkit.notebook.panel_pump import DeltaPump
from sandboxkit.notebook.panel_state import (
    DEFAULT_RATE_CAP,
    DEFAULT_SCROLLBACK,
    DEFAULT_TAIL_BYTES,
    PanelSnapshot,
    PanelState,
)
from sandboxkit.providers.base import UnknownGap
from sandboxkit.vocab import PANEL_ROLE

__all__ = ["DeltaPump", "PanelSnapshot", "PanelState", "ProcessPanel", "TerminalWidget"]

_POLL_INTERVAL = 1.0
_RESTART_LINK_WAIT = 2.0


class TerminalWidget(VendoredWidget):
    """xterm.js in the browser (``panel.js``); fed by :class:`ProcessPanel`'s messages."""

    _esm = esm("panel.js")
    _css = HERE / "panel.css"
    rows = traitlets.Int(20).tag(sync=True)
    scrollback = traitlets.Int(DEFAULT_SCROLLBACK).tag(sync=True)


class _Follower:
    """Callbacks of one attach: feed the state with the stream's cursor, until retired."""

    def __init__(self, state: PanelState) -> None:
        self.state = state
        self.handle: AsyncCommandHandle | None = None
        self.active = True
        self.retiring = False  # being disconnected on purpose: its end is no error
        self.seen: tuple[str | None, str | None, int | None] = (None, None, None)

    def _cursor(self) -> int | None:
        return None if self.handle is None else self.handle.cursor

    def stdout(self, data: bytes) -> None:
        if self.active:
            self.state.feed_bytes("stdout", data, self._cursor())

    def stderr(self, data: bytes) -> None:
        if self.active:
            self.state.feed_bytes("stderr", data, self._cursor())

    def gap(self, gap: GapInfo | UnknownGap) -> None:
        """Output the daemon evicted before the panel read it: say so in the terminal.
        A provider that cannot replay (E2B) cannot count it either: "amount unknown"."""
        if isinstance(gap, UnknownGap):
            if self.active:
                self.state.note(f"… output may be missing here, amount unknown: {gap.reason}")
            return
        if self.active:
            why = (
                "evicted by the daemon before the panel read them"
                if gap.reason == "evicted"
                else gap.why
            )
            self.state.note(
                f"… {gap.bytes_lost} bytes lost: {why} (cursor {gap.cursor}–{gap.first_available})"
            )

    def stream_states(self) -> tuple[str | None, str | None, int | None]:
        """Process state, sandbox state and the sandbox's transition count, as the stream
        last heard them (the count is ``None`` from a provider that has none)."""
        if self.handle is None:
            return (None, None, None)
        stream = self.handle.stream
        seq = getattr(stream, "state_seq", None)
        return (stream.process_state, stream.sandbox_state, seq)


class ProcessPanel(WidgetBase):
    """A live terminal of process ``pid`` of ``sbx`` (a sync ``Sandbox`` or an
    ``AsyncSandbox``) with Reattach / Kill-restart / Pause-Resume / Detach buttons and a
    stdin box. ``flush_hz``, ``rate_cap``, ``tail_bytes`` and ``scrollback`` bound what
    reaches the browser, ``stall_after`` is the STALLED badge's silence (the module
    docstring says how); ``cursor`` where to start, ``rows`` the terminal's height."""

    role = PANEL_ROLE
    """The consumer role this panel's stream announces to the daemon."""

    def __init__(
        self,
        sbx: AnySandbox,
        pid: int,
        *,
        cursor: int | None = None,
        stall_after: float = 5.0,
        flush_hz: float = 10.0,
        rate_cap: int = DEFAULT_RATE_CAP,
        scrollback: int = DEFAULT_SCROLLBACK,
        rows: int = 20,
        tail_bytes: int = DEFAULT_TAIL_BYTES,
    ) -> None:
        super().__init__(sbx)
        assert self._rt.sandbox is not None
        self._sbx = self._rt.sandbox
        if flush_hz <= 0 or rate_cap <= 0:
            raise ValueError("flush_hz and rate_cap must be positive")
        self.state = PanelState(
            pid,
            tail_bytes=tail_bytes,
            max_pending=max(1024, int(rate_cap / flush_hz)),
            stall_after=stall_after,
        )
        self.pump = DeltaPump(self.state)
        self.flush_hz = flush_hz
        self.rate_cap = rate_cap
        self.poll_interval = _POLL_INTERVAL
        self.flushes = 0
        """Messages sent to the front end."""
        self.bytes_sent = 0
        """Output bytes sent to the front end (deltas and snapshots)."""
        self._follower: _Follower | None = None
        self._acted_seq: int | None = None
        """The sandbox's transition count after this panel's last pause or resume."""
        self._action_lock = asyncio.Lock()  # used on the sandbox loop only
        self._build_widgets(rows, scrollback)
        self.state.update_process(sandbox_state=self._sbx.info.state)
        self._rt.start_background(self._poll_loop(), name=f"sandboxkit-panel-poll-{pid}")
        self._ticker: Ticker | None = None
        self._starting = self._action(self._attach(cursor))
        self._ticker = self._rt.ticker(self.flush, flush_hz)
        if self._ticker is not None:  # live: at most flush_hz messages a second, all told
            self.pump.min_interval = 1.0 / flush_hz

    # -- widgets ---------------------------------------------------------------------

    def _build_widgets(self, rows: int, scrollback: int) -> None:
        self.terminal = TerminalWidget(rows=rows, scrollback=scrollback)
        self.terminal.on_msg(self._on_frontend_message)
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
        button_row = widgets.HBox(list(self.buttons.values())[:4])
        stdin_row = widgets.HBox([self.stdin_box, self.send_button])
        self.widget = widgets.VBox([self.terminal, button_row, stdin_row])
        self.widget.add_class("sandboxkit-panel")
        self.own(
            *self.buttons.values(),
            self.stdin_box,
            self.terminal,
            button_row,
            stdin_row,
            self.widget,
        )

    def _send(self, message: tuple[dict[str, Any], list[bytes]]) -> None:
        content, buffers = message
        self.terminal.send(content, buffers)
        self.flushes += 1
        self.bytes_sent += sum(len(b) for b in buffers)

    def _on_frontend_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
        """A view rendered (first display, a second display, a page reload): deltas up to
        now go to the views that have them, then this view gets its snapshot."""
        if self._closed or not isinstance(content, dict) or content.get("type") != "hello":
            return
        self._flush(force=True)  # the snapshot holds these bytes: other views need them
        self._send(self.pump.snapshot(str(content.get("view", ""))))

    def flush(self) -> bool:
        """Send the front end what changed since the last flush, as one message at most;
        True if one was sent. Call on the kernel thread (the ticker does, ``flush_hz``
        times a second); with no running loop, call it yourself. Live (a ticker runs),
        the panel sends at most ``flush_hz`` comm messages a second in all — the Pause
        button's label counts — and a flush too soon after the last leaves the output
        pending for the next (``DeltaPump.min_interval``); only what a person asked for
        (a button's result, a view rendering) goes out at once beyond that."""
        return self._flush()

    def _flush(self, force: bool = False) -> bool:
        if self._closed:
            return False
        self._follow_states()
        label = "Resume" if self.state.sandbox_state == "paused" else "Pause"
        if self.pause_button.description != label and (force or self.pump.ready()):
            self.pause_button.description = label  # a comm message of the button's
            self.pump.spend()
        message = self.pump.next(force=force)
        if message is None:
            return False
        self._send(message)
        return True

    def _follow_states(self, epoch: int | None = None) -> None:
        """Take the states the stream last heard from the daemon, if they are news. The
        daemon sends a state frame the moment the sandbox pauses, resumes or is killed,
        whoever did it (this panel, the dashboard, code, the CLI), so reading them at each
        flush shows the change within a flush period, output flowing or not. Only news,
        and never news older than this panel's own last action (the sandbox's transition
        count orders them): a frame the daemon sent before the action does not undo it,
        and one sent after always wins."""
        follower = self._follower
        if follower is None or follower.handle is None or not follower.active:
            return
        seen = follower.stream_states()
        if seen == follower.seen or seen[0] is None:
            return
        acted = self._acted_seq
        if seen[2] is not None and acted is not None and seen[2] < acted:
            return  # said before this panel's action took effect
        follower.seen = seen
        self.state.update_process(state=seen[0], sandbox_state=seen[1], epoch=epoch)

    # -- public attributes -------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The process followed now (a Kill-restart switches it to the new one)."""
        return self.state.pid

    @property
    def lines(self) -> list[str]:
        """Complete lines of the kept byte tail (as the terminal shows them), newest last."""
        return self.state.lines

    @property
    def line_count(self) -> int:
        """Complete lines received in total since the panel (re)started the process."""
        return self.state.line_count

    # -- handlers ----------------------------------------------------------------------

    def _action(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        if self._closed:
            coro.close()
            raise RuntimeError("this panel is closed")

        # A click's result shows at once, whatever the budget: a person asked for it
        # (it spends the budget: the ticks make room for it).
        def done(_: None) -> None:
            self._flush(force=True)

        def failed(exc: BaseException) -> None:
            self.state.set_error(f"{type(exc).__name__}: {exc}")
            self._flush(force=True)

        return self._rt.dispatch(self._locked(coro), done, failed)

    async def _locked(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            async with self._action_lock:
                self.state.begin_action()
                self.state.set_error(None)
                await coro
                self.state.begin_action()  # a poll that overlapped the action is stale too
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

    async def _connect(
        self, pid: int, cursor: int | None, follower: _Follower
    ) -> AsyncCommandHandle:
        # The raw chunks' bytes, "\r" and partial lines included — a terminal needs
        # the bytes as written, and xterm.js decodes UTF-8 itself: the client decodes
        # nothing. The state keeps what the panel shows; the handle keeps nothing.
        return await self._sbx.commands.connect(
            pid,
            cursor,
            on_stdout_bytes=follower.stdout,
            on_stderr_bytes=follower.stderr,
            on_gap=follower.gap,
            lines=False,
            role=self.role,
            keep_output=False,
        )

    async def _attach(self, cursor: int | None) -> None:
        if self._closed:
            return
        follower = _Follower(self.state)
        handle = await self._connect(self.state.pid, cursor, follower)
        follower.handle = handle
        self._follower = follower
        self._follow_states()  # known already: show it now, not at the next flush
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
            if follower.active and not follower.retiring:
                self.state.set_error(f"{type(exc).__name__}: {exc}")
        if follower.active and not follower.retiring and follower.handle.exit_code is not None:
            self.state.update_process(
                state="exited",
                exit_code=follower.handle.exit_code,
                exit_reason=follower.handle.result().reason,
                cursor=follower.handle.cursor,
            )
            await self._follow_restart(follower)

    async def _follow_restart(self, follower: _Follower) -> None:
        """The followed process ended: if someone else restarted it (code, another
        notebook, the CLI), follow the new pid as after this panel's own Kill-restart.
        One ``commands.get`` at the end of a process; the daemon links old → new just
        after the kill, so a process killed for a restart is asked again, briefly."""
        old = self.state.pid
        deadline = time.monotonic() + _RESTART_LINK_WAIT
        while True:
            try:
                info = await self._sbx.commands.get(old)
            except SandboxkitError:
                return
            new = info.restarted_to
            if new is not None:
                break
            if info.kill_reason != "restart" or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.02)  # sleep-ok: the link is recorded right after the kill
        async with self._action_lock:
            if self._closed or self._follower is not follower or self.state.pid != old:
                return  # an action of this panel came first
            self.state.begin_action()
            await self._detach_stream()
            self.state.reset(new)
            self.state.note(f"── restarted elsewhere: pid {old} killed, now following pid {new} ──")
            self.state.update_process(state="running", sandbox_state=self._sbx.info.state)
            await self._attach(0)
            self.state.begin_action()

    async def _detach_stream(self) -> int | None:
        """Disconnect the current stream; the cursor it reached (``None`` if none)."""
        follower, self._follower = self._follower, None
        if follower is None or follower.handle is None:
            return None
        follower.retiring = True
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
        old = self.state.pid
        info = await self._sbx.commands.restart(old)
        self.state.reset(info.pid)
        self.state.note(f"── Kill-restart: pid {old} killed, now following pid {info.pid} ──")
        self.state.update_process(state=info.state, sandbox_state=self._sbx.info.state)
        await self._attach(0)

    async def _pause_resume(self) -> None:
        if self.state.sandbox_state == "paused":
            await self._sbx.resume()
            shown = "running"
        else:
            await self._sbx.pause()
            shown = "paused"
        current = self.state.process_state
        alive = current in (None, "running", "paused")
        self._acted_seq = self._sbx.info.raw.get("state_seq")
        self.state.update_process(
            sandbox_state=self._sbx.info.state, state=shown if alive else None
        )
        follower = self._follower
        if follower is not None:  # what the stream said before the action is no news
            follower.seen = follower.stream_states()

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
        daemon's head from the consumer metrics. Runs on the sandbox loop. Results are
        dropped if an action began meanwhile (``state.epoch``)."""
        epoch = self.state.epoch
        pid = self.state.pid
        follower = self._follower
        if follower is not None and follower.handle is not None and follower.active:
            self._follow_states(epoch)
            self.state.update_process(cursor=follower.handle.cursor, epoch=epoch, pid=pid)
        rows = await self._sbx.raw_consumers()
        heads = [r["head"] for r in rows if r.get("pid") == pid and r.get("head") is not None]
        if heads:
            self.state.update_process(head=int(max(heads)), epoch=epoch, pid=pid)

    # -- teardown ----------------------------------------------------------------------

    async def _teardown(self) -> None:
        async with self._action_lock:
            await self._detach_stream()

    def _final(self) -> Coroutine[Any, Any, Any]:
        return self._teardown()

    def __repr__(self) -> str:
        return f"<ProcessPanel pid={self.pid} lines={self.line_count}>"
