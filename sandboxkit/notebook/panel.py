"""``ProcessPanel``: a live terminal of one process, with its repair buttons.

A button's handler is a named method (``on_reattach``, ``on_kill_restart``,
``on_pause_resume``, ``on_detach``, ``on_send_stdin``) that a test or a cell can call; the
widgets are ``panel.widget``, ``panel.terminal`` and ``panel.buttons[label]``.

What goes to the browser (the front end is ``panel.js``, xterm.js inside an anywidget): only
new bytes, as binary buffers of anywidget custom messages, at most ``flush_hz`` messages a
second *including* the status line, which rides along only when something a person reads
changed (:class:`DeltaPump`). Beyond ``rate_cap`` bytes a second the newest output is
shown after a marker ``… N bytes skipped (cursor a–b)`` (bytes, and the chunks a to b-1
in the status line's cursor unit): the kernel keeps at most one
flush's worth pending, so it never builds a backlog. A (re)rendered view asks for a
snapshot (the kernel's byte tail, bounded by ``tail_bytes``) and then applies deltas. The
browser keeps ``scrollback`` lines. Every buffer here is bounded in bytes.

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
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets  # type: ignore[import-untyped, unused-ignore]
import traitlets

from sandboxkit.client.commands import AsyncCommandHandle
from sandboxkit.client.stream import GapInfo
from sandboxkit.errors import CommandExitError, SandboxkitError
from sandboxkit.notebook._frontend import HERE, VendoredWidget, esm
from sandboxkit.notebook._runtime import AnySandbox
from sandboxkit.notebook._widget import WidgetBase
from sandboxkit.providers.base import UnknownGap
from sandboxkit.vocab import PANEL_ROLE

__all__ = ["DeltaPump", "PanelSnapshot", "PanelState", "ProcessPanel", "TerminalWidget"]

STREAMS = ("stdout", "stderr")
_RATE_WINDOW = 2.0
_POLL_INTERVAL = 1.0
_RESTART_LINK_WAIT = 2.0
_STDERR_ON = b"\x1b[31m"
_SGR_OFF = b"\x1b[0m"
_NOTE_ON = b"\x1b[2;3m"  # dim italic: the panel's own lines, never a process's output
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

DEFAULT_RATE_CAP = 256 * 1024
DEFAULT_TAIL_BYTES = 256 * 1024
DEFAULT_SCROLLBACK = 5000


def _display_line(line: str) -> str:
    """A carriage return rewrites the line in a terminal: show what remains visible."""
    line = _ANSI.sub("", line)
    if "\r" in line:
        line = line.rstrip("\r").rsplit("\r", 1)[-1]
    return line


def _from_line_start(data: bytes | bytearray) -> bytes:
    """``data`` from just after its first newline (a cut in the middle of a line, an
    escape sequence or a UTF-8 character would garble the first row), or all of it when it
    holds no newline."""
    nl = data.find(b"\n")
    return bytes(data[nl + 1 :]) if nl >= 0 else bytes(data)


@dataclass(frozen=True)
class PanelSnapshot:
    """One consistent view of a :class:`PanelState`: what the status line shows."""

    pid: int
    version: int
    generation: int
    """Bumped by :meth:`PanelState.reset` (a Kill-restart)."""
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
    skipped: int
    """Bytes not sent to the browser (rate cap) since the panel started."""
    exit_reason: str | None = None
    """What ended the process, when not itself: ``oom``, ``timeout``, ``user`` …"""

    @property
    def shown_state(self) -> str:
        """The process state a person should read (a paused sandbox pauses its processes)."""
        if self.process_state in (None, "running") and self.sandbox_state == "paused":
            return "paused"
        return self.process_state or "connecting"

    @property
    def status_line(self) -> str:
        """The status line without the age and the badge (what the kernel sends)."""
        parts = [f"pid {self.pid}", self.shown_state]
        if self.exit_code is not None:
            why = "" if self.exit_reason in (None, "exit") else f" ({self.exit_reason})"
            parts.append(f"exit {self.exit_code}{why}")
        parts.append(f"cursor {'-' if self.cursor is None else self.cursor}")
        if self.head is not None:
            parts.append(f"head {self.head}")
        parts.append(f"lines {self.line_count}")
        parts.append(_format_rate(self.rate))
        if not self.attached:
            parts.append("detached")
        if self.error:
            parts.append(f"error: {self.error}")
        return " · ".join(parts)

    @property
    def status(self) -> str:
        """The whole status line as plain text (``STALLED`` at the end when stalled)."""
        age = "no output yet" if self.age is None else f"last byte {self.age:.0f}s ago"
        return f"{self.status_line} · {age}" + (" · STALLED" if self.stalled else "")


def _format_rate(rate: float) -> str:
    if rate >= 1024 * 1024:
        return f"{rate / (1024 * 1024):.1f} MB/s"
    if rate >= 1024:
        return f"{rate / 1024:.0f} kB/s"
    return f"{rate:.0f} B/s"


class PanelState:
    """What a :class:`ProcessPanel` shows, as plain thread-safe Python.

    Stream callbacks feed it from the sandbox's loop (:meth:`feed_stdout`,
    :meth:`feed_stderr`); the panel's poll updates the process facts
    (:meth:`update_process`); the kernel side takes what to send (:meth:`take_output`,
    :meth:`tail`, :meth:`snapshot`). Output is kept twice, both bounded in bytes: a tail
    of ``tail_bytes`` for views that (re)render, and the bytes not yet sent, at most
    ``max_pending`` — older pending bytes are dropped and counted, so a flood costs the
    kernel no backlog. ``clock`` (monotonic seconds) is injectable for tests.
    """

    def __init__(
        self,
        pid: int,
        *,
        tail_bytes: int = DEFAULT_TAIL_BYTES,
        max_pending: int = DEFAULT_RATE_CAP // 10,
        stall_after: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tail_bytes < 1024 or max_pending < 1024:
            raise ValueError("tail_bytes and max_pending must be at least 1024")
        self.tail_bytes = tail_bytes
        self.max_pending = max_pending
        self.stall_after = stall_after
        self.clock = clock
        self._lock = threading.Lock()
        self.version = 0
        self.generation = 0
        self.epoch = 0
        """Bumped when an action starts: polls begun before it are discarded."""
        self.skipped_total = 0
        self._reset(pid)

    def _reset(self, pid: int) -> None:
        self.pid = pid
        self._tail = bytearray()
        self._tail_cut = False
        self._pending = bytearray()
        # Display bytes are counted from the start (``_shown``); the first pending one
        # is at ``_pending_at``. ``_marks`` maps pending output to the stream's cursors:
        # (display offset where a chunk ends, the cursor after it), so a skip marker can
        # say which chunks it skipped in the status line's unit.
        self._shown = 0
        self._pending_at = 0
        self._marks: deque[tuple[int, int]] = deque()
        self._pending_cursor: int | None = None  # the cursor of the first pending chunk
        self._skipped = 0
        self._skip_from: int | None = None  # the cursor of the first skipped chunk
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
        self.exit_reason: str | None = None
        self.error: str | None = None

    def _set_cursor(self, cursor: int) -> None:
        self.cursor = cursor
        if self.head is not None and cursor > self.head:
            self.head = cursor  # we received it, so the daemon's head is at least here

    def _bump(self) -> None:
        self.version += 1

    # -- writers ---------------------------------------------------------------------

    def reset(self, pid: int) -> None:
        """Forget everything: a new process (after a restart) starts from scratch. Bytes
        not yet sent stay pending (the browser still shows the old process's output)."""
        with self._lock:
            kept = (self._pending, self._pending_at, self._shown, self._marks)
            self._reset(pid)
            self._pending, self._pending_at, self._shown, self._marks = kept
            self.generation += 1
            self._bump()

    def begin_action(self) -> int:
        """A new epoch: results of polls started before now are dropped."""
        with self._lock:
            self.epoch += 1
            return self.epoch

    def _append(self, data: bytes, cursors: tuple[int, int] | None = None) -> None:
        """Add display bytes to the tail and to the pending bytes (both bounded);
        ``cursors``: the stream's cursor before and after them, if they are output."""
        self._tail += data
        excess = len(self._tail) - self.tail_bytes
        if excess > 0:
            del self._tail[:excess]
            self._tail_cut = True
        if not self._pending:
            self._pending_at = self._shown
            self._marks.clear()
            self._pending_cursor = None
        self._shown += len(data)
        if cursors is not None:
            if self._pending_cursor is None:
                self._pending_cursor = cursors[0]
            self._marks.append((self._shown, cursors[1]))
        self._pending += data
        excess = len(self._pending) - self.max_pending
        if excess > 0:
            if not self._skipped:
                self._skip_from = self._pending_cursor
            del self._pending[:excess]
            self._skipped += excess
            self._pending_at += excess
            self._forget_marks(self._pending_at)

    def _forget_marks(self, upto: int) -> None:
        """Drop the marks of chunks wholly before display offset ``upto``."""
        marks = self._marks
        while marks and marks[0][0] <= upto:
            self._pending_cursor = marks.popleft()[1]

    def _cursor_after(self, offset: int) -> int | None:
        """The cursor after the chunk that holds display offset ``offset - 1``: the first
        chunk not cut at all when ``offset`` is where bytes were cut."""
        for end, cursor in self._marks:
            if end >= offset:
                return cursor
        return self._marks[-1][1] if self._marks else self._pending_cursor

    def feed(self, stream: str, text: str, cursor: int | None = None) -> None:
        """Add decoded output of ``stream``; ``cursor`` is the stream's cursor after it."""
        stream = "stderr" if stream == "stderr" else "stdout"
        now = self.clock()
        with self._lock:
            before = self.cursor
            if cursor is not None:
                self._set_cursor(cursor)
            if not text:
                self._bump()
                return
            data = text.encode("utf-8", "surrogateescape")
            size = len(data)
            self.bytes_received += size
            self.chunks += 1
            self.line_count += data.count(b"\n")
            self.last_byte_at = now
            self._recent.append((now, size))
            self._trim_recent(now)
            if stream == "stderr":
                data = _STDERR_ON + data + _SGR_OFF
            cursors = None
            if cursor is not None:
                # Unknown before the first chunk of a stream attached without a cursor.
                start = before if before is not None and before <= cursor else max(0, cursor - 1)
                cursors = (start, cursor)
            self._append(data, cursors)
            self._bump()

    def feed_stdout(self, text: str, cursor: int | None = None) -> None:
        """:meth:`feed` for stdout (usable as an ``on_stdout`` callback)."""
        self.feed("stdout", text, cursor)

    def feed_stderr(self, text: str, cursor: int | None = None) -> None:
        """:meth:`feed` for stderr (usable as an ``on_stderr`` callback)."""
        self.feed("stderr", text, cursor)

    def note(self, text: str) -> None:
        """Show a line of the panel's own (a restart or gap marker) in the terminal,
        dimmed. It is kept in the tail too, so a view that renders later (or reloads)
        still shows it; :attr:`lines` leaves it out (it is not process output)."""
        with self._lock:
            # Each line it makes starts with _NOTE_ON (the first ends a partial line, or
            # is empty), so `lines` can leave them out.
            line = _NOTE_ON + text.encode() + _SGR_OFF + b"\r\n"
            self._append(_NOTE_ON + b"\r\n" + line)
            self._bump()

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
        exit_reason: str | None = None,
        epoch: int | None = None,
        pid: int | None = None,
    ) -> bool:
        """Record polled facts; only the given ones change. ``head`` never goes back
        (the daemon's head is monotonic per process). With ``epoch`` (or ``pid``) the
        facts are dropped — False returned — if an action began since (or the panel
        follows another process now): a stale poll never overwrites an action's result."""
        with self._lock:
            if (epoch is not None and epoch != self.epoch) or (pid is not None and pid != self.pid):
                return False
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
                self.exit_reason = exit_reason
            after = (self.process_state, self.sandbox_state, self.head, self.cursor)
            if after != before or self.exit_code != before_exit:
                self._bump()
            return True

    def set_error(self, error: str | None) -> None:
        """Show (or clear, with ``None``) an error in the status line."""
        with self._lock:
            if error != self.error:
                self.error = error
                self._bump()

    # -- what to send ------------------------------------------------------------------

    def take_output(self) -> bytes:
        """The pending display bytes (emptied): a skip marker first when the rate cap
        dropped some, then the newest output from a line start."""
        with self._lock:
            data, self._pending = bytes(self._pending), bytearray()
            skipped, self._skipped = self._skipped, 0
            if not skipped:
                self._marks.clear()
                return data
            kept = _from_line_start(data)
            cut = len(data) - len(kept)
            skipped += cut
            # Cursors as the status line counts them (chunks): a is the first chunk not
            # shown (wholly or in part), b the first shown whole after the marker.
            a, b = self._skip_from, self._cursor_after(self._pending_at + cut)
            self._marks.clear()
            self.skipped_total += skipped
            where = "" if a is None or b is None else f" (cursor {a}–{b})"
            marker = f"\r\n\x1b[33m… {skipped} bytes skipped{where}\x1b[0m\r\n"
            return marker.encode() + kept

    def tail(self) -> bytes:
        """The kept byte tail (at most ``tail_bytes``), from a line start if it was cut."""
        with self._lock:
            return _from_line_start(self._tail) if self._tail_cut else bytes(self._tail)

    # -- readers ---------------------------------------------------------------------

    @property
    def lines(self) -> list[str]:
        """Complete lines of the byte tail, as a terminal shows them (ANSI stripped)."""
        text = self.tail().decode("utf-8", "replace")
        note = _NOTE_ON.decode()
        return [_display_line(line) for line in text.split("\n")[:-1] if not line.startswith(note)]

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

    def _pending_output(self) -> bool:
        return self.head is not None and self.head > (self.cursor or 0)

    def _stalled(self, now: float) -> bool:
        if not self.attached or self.process_state not in ("running", "paused"):
            return False
        if not self._pending_output():
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
        """A consistent copy of everything the status line shows."""
        with self._lock:
            now = self.clock() if now is None else now
            return PanelSnapshot(
                pid=self.pid,
                version=self.version,
                generation=self.generation,
                line_count=self.line_count,
                bytes_received=self.bytes_received,
                rate=self._rate(now),
                age=None if self.last_byte_at is None else max(0.0, now - self.last_byte_at),
                cursor=self.cursor,
                head=self.head,
                process_state=self.process_state,
                sandbox_state=self.sandbox_state,
                exit_code=self.exit_code,
                exit_reason=self.exit_reason,
                attached=self.attached,
                error=self.error,
                stalled=self._stalled(now),
                skipped=self.skipped_total,
            )


def _status_message(snap: PanelSnapshot) -> dict[str, Any]:
    age = None if snap.age is None else round(snap.age, 1)
    return {"text": snap.status_line, "stalled": snap.stalled, "age": age}


class DeltaPump:
    """Decides what one flush sends: pending bytes and, only when a person would read
    something new, the status — as one message (plain Python; tests drive it).

    The status goes out at once when the state, pid, exit code, attachment, error or
    STALLED badge changed, and for the counters (cursor, head, lines, rate) at most every
    ``status_period`` seconds along with output, or every second on its own. The browser
    ticks "last byte Ns ago" by itself.
    """

    def __init__(
        self,
        state: PanelState,
        *,
        status_period: float = 0.5,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.state = state
        self.status_period = status_period
        self.clock = clock or state.clock
        self._key: tuple[Any, ...] | None = None
        self._counters: tuple[Any, ...] | None = None
        self._status_at = float("-inf")

    def _status(self, snap: PanelSnapshot, now: float, with_data: bool) -> dict[str, Any] | None:
        key = (
            snap.pid,
            snap.shown_state,
            snap.exit_code,
            snap.exit_reason,
            snap.attached,
            snap.error,
            snap.stalled,
            snap.age is None,
        )
        counters = (snap.cursor, snap.head, snap.line_count, _format_rate(snap.rate))
        urgent = key != self._key
        # Counters ride along with output at most every status_period; alone (no output
        # to carry them), at most every second: a message of its own costs an envelope.
        period = self.status_period if with_data else max(1.0, self.status_period)
        due = counters != self._counters and now - self._status_at >= period
        if not (urgent or due):
            return None
        self._key, self._counters, self._status_at = key, counters, now
        return _status_message(snap)

    def next(self) -> tuple[dict[str, Any], list[bytes]] | None:
        """The message to send now (``None``: nothing a person would see changed)."""
        now = self.clock()
        data = self.state.take_output()
        status = self._status(self.state.snapshot(now), now, bool(data))
        if not data and status is None:
            return None
        message: dict[str, Any] = {"type": "delta"}
        if status is not None:
            message["status"] = status
        return message, [data] if data else []

    def snapshot(self, view: str) -> tuple[dict[str, Any], list[bytes]]:
        """What a (re)rendered view starts from: the byte tail and the whole status."""
        snap = self.state.snapshot()
        return {"type": "snapshot", "view": view, "status": _status_message(snap)}, [
            self.state.tail()
        ]


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

    def stdout(self, text: str) -> None:
        if self.active:
            self.state.feed("stdout", text, self._cursor())

    def stderr(self, text: str) -> None:
        if self.active:
            self.state.feed("stderr", text, self._cursor())

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
        self._starting = self._action(self._attach(cursor))
        self._ticker = self._rt.ticker(self.flush, flush_hz)

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
        self.flush()
        self._send(self.pump.snapshot(str(content.get("view", ""))))

    def flush(self) -> bool:
        """Send the front end what changed since the last flush, as one message at most;
        True if one was sent. Call on the kernel thread (the ticker does, ``flush_hz``
        times a second at most); with no running loop, call it yourself."""
        if self._closed:
            return False
        self._follow_states()
        label = "Resume" if self.state.sandbox_state == "paused" else "Pause"
        if self.pause_button.description != label:
            self.pause_button.description = label
        message = self.pump.next()
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

        def done(_: None) -> None:
            self.flush()

        def failed(exc: BaseException) -> None:
            self.state.set_error(f"{type(exc).__name__}: {exc}")
            self.flush()

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
        # lines=False: the raw chunks, "\r" and partial lines included — a terminal
        # needs the bytes as written, not lines re-cut by the client.
        return await self._sbx.commands.connect(
            pid,
            cursor,
            on_stdout=follower.stdout,
            on_stderr=follower.stderr,
            on_gap=follower.gap,
            lines=False,
            role=self.role,
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
        frame = await self._sbx.consumers()
        rows = frame[frame["pid"] == pid] if len(frame) else frame
        if len(rows):
            self.state.update_process(head=int(rows["head"].max()), epoch=epoch, pid=pid)

    # -- teardown ----------------------------------------------------------------------

    async def _teardown(self) -> None:
        async with self._action_lock:
            await self._detach_stream()

    def _final(self) -> Coroutine[Any, Any, Any]:
        return self._teardown()

    def __repr__(self) -> str:
        return f"<ProcessPanel pid={self.pid} lines={self.line_count}>"
