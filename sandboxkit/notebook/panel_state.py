"""What a :class:`~sandboxkit.notebook.panel.ProcessPanel` shows, as plain thread-safe
Python: :class:`PanelState` (the process's output and facts) and :class:`PanelSnapshot`
(one consistent copy of them, which the status line reads).

Output is kept twice, both bounded in bytes: a tail for views that (re)render, and the
bytes not yet sent to the browser, at most one flush's worth — older pending bytes are
dropped and counted, and the next delta starts with a marker ``… N bytes skipped (cursor
a–b)``, so a flood costs the kernel no backlog. The state also decides the STALLED badge
(alive, attached, output pending at the daemon, and silent for ``stall_after`` seconds).
Tests drive it with an injected clock; nothing here touches a widget or a loop.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sandboxkit.client.output import incomplete_tail

__all__ = [
    "DEFAULT_RATE_CAP",
    "DEFAULT_SCROLLBACK",
    "DEFAULT_TAIL_BYTES",
    "PanelSnapshot",
    "PanelState",
    "count_newlines",
    "format_rate",
]

_RATE_WINDOW = 2.0
_STDERR_ON = b"\x1b[31m"
_SGR_OFF = b"\x1b[0m"
_NOTE_ON = b"\x1b[2;3m"  # dim italic: the panel's own lines, never a process's output
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

DEFAULT_RATE_CAP = 256 * 1024
DEFAULT_TAIL_BYTES = 256 * 1024
DEFAULT_SCROLLBACK = 5000


_NUMPY_FROM = 4096


def count_newlines(data: bytes) -> int:
    """``data.count(b"\\n")``, six times faster on big chunks (numpy compares 32 bytes
    at a time; ``bytes.count`` looks at one): eight 10 MB/s panels count 80 MB a
    second."""
    if len(data) < _NUMPY_FROM:
        return data.count(b"\n")
    return int(np.count_nonzero(np.frombuffer(data, np.uint8) == 10))


class _Chunks:
    """Bytes kept as the chunks they came in, the first ``skip`` bytes dropped: appends
    and drops at the front copy nothing (``join`` copies once, when they are sent)."""

    __slots__ = ("chunks", "size", "skip")

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.skip = 0

    def __len__(self) -> int:
        return self.size

    def append(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)

    def drop(self, n: int) -> None:
        """Forget the oldest ``n`` bytes (``n <= len(self)``)."""
        self.size -= n
        n += self.skip
        chunks = self.chunks
        while chunks and len(chunks[0]) <= n:
            n -= len(chunks.popleft())
        self.skip = n

    def join(self) -> bytes:
        if not self.chunks:
            return b""
        if len(self.chunks) == 1 and not self.skip:
            return self.chunks[0]
        first = memoryview(self.chunks[0])[self.skip :]
        return b"".join([first, *list(self.chunks)[1:]])


def _display_line(line: str) -> str:
    """A carriage return rewrites the line in a terminal: show what remains visible."""
    line = _ANSI.sub("", line)
    if "\r" in line:
        line = line.rstrip("\r").rsplit("\r", 1)[-1]
    return line


def _from_line_start(data: bytes) -> bytes:
    """``data`` from just after its first newline (a cut in the middle of a line, an
    escape sequence or a UTF-8 character would garble the first row), or all of it when it
    holds no newline."""
    nl = data.find(b"\n")
    return data[nl + 1 :] if nl >= 0 else data


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
        parts.append(format_rate(self.rate))
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


def format_rate(rate: float) -> str:
    """A rate in bytes per second as the status line shows it (``12 kB/s``)."""
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
        self._tail = _Chunks()
        self._tail_cut = False
        self._pending = _Chunks()
        self._partial = {"stdout": b"", "stderr": b""}  # an unfinished UTF-8 character
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
        # Chunks are kept as they came, never copied here: at 10 MB/s a bytearray tail
        # that is appended to and cut at the front is copied whole at every chunk.
        self._tail.append(data)
        excess = len(self._tail) - self.tail_bytes
        if excess > 0:
            self._tail.drop(excess)
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
        self._pending.append(data)
        excess = len(self._pending) - self.max_pending
        if excess > 0:
            if not self._skipped:
                self._skip_from = self._pending_cursor
            self._pending.drop(excess)
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
        self.feed_bytes(stream, text.encode("utf-8", "surrogateescape"), cursor)

    def feed_bytes(self, stream: str, data: bytes, cursor: int | None = None) -> None:
        """Add output of ``stream`` as the process wrote it (no decoding: the browser's
        terminal decodes UTF-8); ``cursor`` is the stream's cursor after it."""
        stream = "stderr" if stream == "stderr" else "stdout"
        now = self.clock()
        with self._lock:
            before = self.cursor
            if cursor is not None:
                self._set_cursor(cursor)
            if not data:
                self._bump()
                return
            size = len(data)
            self.bytes_received += size
            self.chunks += 1
            self.line_count += count_newlines(data)
            self.last_byte_at = now
            self._recent.append((now, size))
            self._trim_recent(now)
            # A character cut between two chunks is finished before it is shown: the
            # other stream's bytes (and stderr's colour) must not land inside it.
            held = self._partial[stream]
            if held:
                data = held + data
            cut = incomplete_tail(data) if data[-1] >= 0x80 else 0
            self._partial[stream] = data[len(data) - cut :] if cut else b""
            if cut:
                data = data[: len(data) - cut]
                if not data:
                    self._bump()
                    return
            if stream == "stderr":
                data = _STDERR_ON + data + _SGR_OFF
            cursors = None
            if cursor is not None:
                # Unknown before the first chunk of a stream attached without a cursor.
                start = before if before is not None and before <= cursor else max(0, cursor - 1)
                cursors = (start, cursor)
            self._append(data, cursors)
            self._bump()

    def feed_stdout_bytes(self, data: bytes, cursor: int | None = None) -> None:
        """:meth:`feed_bytes` for stdout (usable as an ``on_stdout_bytes`` callback)."""
        self.feed_bytes("stdout", data, cursor)

    def feed_stderr_bytes(self, data: bytes, cursor: int | None = None) -> None:
        """:meth:`feed_bytes` for stderr (usable as an ``on_stderr_bytes`` callback)."""
        self.feed_bytes("stderr", data, cursor)

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
            data, self._pending = self._pending.join(), _Chunks()
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
            tail = self._tail.join()
            return _from_line_start(tail) if self._tail_cut else tail

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
