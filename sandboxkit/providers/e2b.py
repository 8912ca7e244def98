"""The E2B provider: sandboxkit's client — and so its notebook widgets — on E2B sandboxes,
through the official ``e2b`` SDK.

``AsyncSandbox.create(provider="e2b", ...)`` (or the sync ``Sandbox.create``) returns an
:class:`E2BSandbox`: an :class:`~sandboxkit.client.sandbox.AsyncSandbox` whose commands,
files, pause/resume and journal go through ``e2b.AsyncSandbox``. ``ProcessPanel``,
``BackpressureChart``, ``LifecycleTimeline`` and ``SandboxDashboard`` take it as they take a
local sandbox.

Which E2B: ``url=`` names an envd, and the SDK runs in its debug mode against it (no API
calls, so no pause, resume, sandbox list or sandbox kill there; see below); so does
``E2B_DEBUG=1``, or having no API key at all (envd at ``http://localhost:49983``).
Otherwise an API key — ``token=`` or ``E2B_API_KEY`` — selects E2B's cloud.
``provider_options={"debug": ...}`` decides outright; the other ``provider_options`` go
to ``e2b.AsyncSandbox.create`` (``template``, ``api_url``, ``domain``...). The tests
point it at sandboxkit's own envd endpoint, under ``/live`` so that a reattach behaves as
E2B's envd does.

How sandboxkit's model maps onto E2B's:

* **One tap per process.** The provider keeps one SDK stream (the *tap*) open to every
  process it started or was asked to follow, and records what arrives in a bounded
  client-side log (:class:`_ProcessLog`, 8 MiB by default). Readers — a panel, a handle —
  follow that log from a cursor (bytes of output, stdout and stderr together), so a
  Reattach replays exactly, and a reader that falls behind the log's retention gets a
  :class:`~sandboxkit.client.stream.GapInfo` with the true count of bytes this client saw
  and dropped.
* **No replay after nobody was attached.** E2B's envd sends a reconnecting stream only
  output produced after it reconnected. So where the tap was not attached — a process
  started elsewhere and followed from now, a stream cut by a pause or the network and
  reopened — the readers get an :class:`~sandboxkit.providers.base.UnknownGap`: "output
  may be missing here, amount unknown", never a made-up number.
* **Metrics are client-side only.** E2B reports no per-consumer metrics: ``consumers()``
  lists this client's readers and taps, with lag measured against what the tap received
  (not against the process), and :attr:`E2BSandbox.metrics_scope` is ``"client"`` so the
  widgets say so.
* **The journal is this client's.** ``events()``/``raw_events()`` hold what this client did
  and saw (pause, resume, starts, exits, restarts, attaches, gaps), each marked
  ``"source": "client"``; E2B keeps no event journal to read.
* **Kill-restart** is a kill (SIGKILL, E2B's only signal) and a new start of the same
  command, envs and cwd; the new pid is followed from its first byte.
* **Pause/resume** are the SDK's ``pause()`` and ``connect()`` (which resumes): they need
  a control plane — E2B's cloud, or a sandboxkit daemon's (``sandboxkit serve --envd``
  serves one under ``/api``; pass ``provider_options={"api_url": ..., "sandbox_url": ...}``
  or set ``E2B_API_URL``/``E2B_SANDBOX_URL``, and the daemon's token as the API key).
  Taps cut by the pause reopen after the resume, behind an unknown-size gap.
* Text goes through the SDK's UTF-8 decoder, which replaces bytes that are not UTF-8
  (U+FFFD): E2B's SDK gives no raw bytes of a command's stdout/stderr. A ``pty=True``
  process runs through the SDK's pty API, whose output is raw bytes (kept as stdout).
"""

from __future__ import annotations

import asyncio
import bisect
import builtins
import contextlib
import inspect
import itertools
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import e2b
import msgspec
import pandas as pd
from e2b import CommandExitException, NotFoundException

from sandboxkit.client.commands import AsyncCommands, FollowOptions
from sandboxkit.client.files import AsyncFiles, EntryInfo, WriteInfo
from sandboxkit.client.local import Connection
from sandboxkit.client.results import CommandResult, ProcessInfo, SandboxInfo
from sandboxkit.client.sandbox import AsyncSandbox, consumers_frame, events_frame, note_sandbox
from sandboxkit.client.stdin import StdinSession
from sandboxkit.client.stream import GapInfo, OnGap, ProcessStream
from sandboxkit.client.tasks import TaskOwner
from sandboxkit.errors import (
    FileNotFound,
    InvalidArgument,
    OutputGap,
    OutputIncomplete,
    ProcessNotFound,
    ResultUnavailable,
    SandboxNotFound,
)
from sandboxkit.providers.base import ProviderUnsupported, UnknownGap
from sandboxkit.vocab import (
    DEFAULT_ROLE,
    ENVD_PORT,
    ProcessSpecInfo,
    ProcessState,
    SandboxState,
)

__all__ = [
    "DEFAULT_ENVD_URL",
    "DEFAULT_LOG_BYTES",
    "E2BCommands",
    "E2BFiles",
    "E2BSandbox",
    "connect",
    "create",
    "list_sandboxes",
]

log = logging.getLogger("sandboxkit.providers.e2b")

DEFAULT_ENVD_URL = f"http://localhost:{ENVD_PORT}"
"""Where the SDK's debug mode finds envd unless told otherwise."""

DEFAULT_LOG_BYTES = 8 * 1024 * 1024
"""Output kept per process in this client (the replay window of a Reattach)."""

_USER = "user"
"""The user commands run as: E2B's default."""

_RECONNECT_DELAYS = (0.05, 0.2, 0.5, 1.0, 2.0)
"""Pacing of a tap's reopen attempts after its stream broke (then it gives up)."""

_END_WAIT = 2.0
"""Seconds a restart waits for the old process's end before starting the new one."""

_NO_REPLAY = "E2B replays nothing printed while its stream was cut"

_PTY_ROWS, _PTY_COLS = 24, 80
"""The terminal size of a ``pty=True`` process (the classic 80×24)."""
_PTY_MARK = b"\x1e\x1fsandboxkit\x1f\x1e"
"""Printed just before a ``pty=True`` command runs: the shell's noise before it is dropped."""
_PTY_MARK_TYPED = "\\036\\037sandboxkit\\037\\036"
"""The same, as ``printf`` octal escapes, so that the echo of the typed line is not it."""

_ids = itertools.count(1)
_registry: dict[str, tuple[str, dict[str, Any]]] = {}
"""Debug-mode sandboxes made in this process: local id → (envd url, SDK options)."""


_SIGNALS = {"killed": signal.SIGKILL, "terminated": signal.SIGTERM}


def _signal_code(exit_code: int | None, error: str | None) -> int | None:
    """envd reports a process ended by a signal as exit code -1 with ``signal: killed``
    in its error; sandboxkit's convention is the negative signal number (-9)."""
    if exit_code != -1 or not error or not error.startswith("signal: "):
        return exit_code
    name = error.removeprefix("signal: ").strip()
    sig = _SIGNALS.get(name)
    if sig is None:
        try:
            sig = signal.Signals["SIG" + name.upper()]
        except KeyError:
            return exit_code
    return -int(sig)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class _Target:
    """Cloud or debug, and the SDK options that say so."""

    debug: bool
    options: dict[str, Any]
    url: str | None

    @classmethod
    def resolve(cls, url: str | None, token: str | None, options: dict[str, Any]) -> _Target:
        opts = dict(options)
        debug = opts.pop("debug", None)
        if debug is None:  # an envd URL, E2B_DEBUG, or no API key at all: debug mode
            debug = (
                bool(url)
                or _truthy(os.environ.get("E2B_DEBUG"))
                or not (token or opts.get("api_key") or os.environ.get("E2B_API_KEY"))
            )
        if debug:
            sandbox_url = url or opts.pop("sandbox_url", None) or DEFAULT_ENVD_URL
            opts.update(debug=True, sandbox_url=sandbox_url)
            return cls(True, opts, sandbox_url)
        if token:
            opts["api_key"] = token
        if url:
            opts["api_url"] = url
        return cls(False, opts, url)


# -- the client-side log of one process ------------------------------------------------


@dataclass
class _Entry:
    offset: int
    stream: str  # "stdout" | "stderr" | "gap"
    data: bytes = b""
    reason: str = ""


class _ProcessLog:
    """What this client's tap received from one process, bounded in bytes: readers follow
    it from a cursor (a byte offset), as the daemon's consumers follow its output log."""

    def __init__(self, pid: int, spec: dict[str, Any], keep_bytes: int) -> None:
        self.pid = pid
        self.spec = spec
        self.keep_bytes = keep_bytes
        # Entries by sequence number: entry ``seq`` is ``entries[seq - base]``; the first
        # ``skip`` of the list are evicted (dropped in bulk now and then, so that evicting
        # and finding an entry both stay O(1)).
        self.entries: list[_Entry] = []
        self.base = 0
        self.skip = 0
        self.size = 0
        self.head = 0
        """Output bytes received in total (the offset the next byte gets)."""
        self.first = 0
        """Offset of the oldest byte still kept."""
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.exit_code: int | None = None
        self.error: str | None = None
        self.ended = False
        self.readers: set[_Reader] = set()
        self.tap: _Tap | None = None
        self.restarted_from: int | None = None
        self.restarted_to: int | None = None
        self.passed: dict[int, int] = {}
        """Cursor → the entry after the gaps a reader detached there had delivered: a
        gap marks a position, not bytes, so a cursor alone cannot say whether the gaps at
        it were read; a reattach at that cursor starts after them (no marker twice)."""
        self.pty = bool(spec.get("pty"))
        """Started through E2B's pty API: its output is raw bytes, read through
        ``pty.connect``, and its stdin is the terminal's."""
        self._changed = asyncio.Event()

    def waiter(self) -> asyncio.Event:
        """An event set at the next change (take it before reading the state)."""
        return self._changed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def first_seq(self) -> int:
        """Sequence number of the oldest entry kept."""
        return self.base + self.skip

    @property
    def next_seq(self) -> int:
        """Sequence number the next entry gets."""
        return self.base + len(self.entries)

    def entry(self, seq: int) -> _Entry:
        return self.entries[seq - self.base]

    def seek(self, cursor: int) -> int:
        """The first entry a reader at byte ``cursor`` has not read: data ending after
        it, or a gap at or after it."""

        def key(e: _Entry) -> int:
            return e.offset if e.stream == "gap" else e.offset + len(e.data) - 1

        return self.base + bisect.bisect_left(self.entries, cursor, lo=self.skip, key=key)

    def append(self, stream: str, data: bytes) -> None:
        if not data:
            return
        self.entries.append(_Entry(self.head, stream, data))
        self.head += len(data)
        self.size += len(data)
        # The newest entry stays whole, however large: a reader following live gets
        # every chunk the tap received (only what it fell behind on is evicted).
        while self.size > self.keep_bytes and len(self.entries) - self.skip > 1:
            self.size -= len(self.entries[self.skip].data)
            self.skip += 1
            self.first = self.entries[self.skip].offset
        if self.skip > 1024 and self.skip * 2 > len(self.entries):
            del self.entries[: self.skip]
            self.base += self.skip
            self.skip = 0
        self._notify()

    def unknown_gap(self, reason: str) -> None:
        self.entries.append(_Entry(self.head, "gap", reason=reason))
        self._notify()

    def end(self, exit_code: int | None, error: str | None = None) -> None:
        if self.ended:
            return
        self.ended, self.exit_code, self.error = True, exit_code, error
        self.ended_at = time.time()
        self._notify()

    def state(self) -> ProcessState:
        return "exited" if self.ended else "running"


# -- readers: what a handle or a panel follows ----------------------------------------


@dataclass
class _Stats:
    bytes_lost: int = 0
    unknown_gaps: int = 0


class _Reader:
    """One follower of a :class:`_ProcessLog` from a cursor. It offers what the widgets
    and :class:`~sandboxkit.client.commands.AsyncCommandHandle` read of a
    :class:`~sandboxkit.client.stream.ProcessStream` (cursor, output, states, ``run()``)."""

    _ids = itertools.count(1)

    def __init__(
        self,
        sandbox: E2BSandbox,
        plog: _ProcessLog,
        cursor: int | None,
        options: FollowOptions,
    ) -> None:
        self.sandbox = sandbox
        self.log = plog
        self.pid = plog.pid
        self.consumer_id = f"e2b-reader-{next(self._ids)}"
        self.role = options.role or DEFAULT_ROLE
        self._cursor = plog.first if cursor is None else max(0, int(cursor))
        self._reattach = cursor is not None
        self.on_stdout, self.on_stderr = options.on_stdout, options.on_stderr
        self.on_gap, self.lines = options.on_gap, options.lines
        self.on_stdout_bytes = options.on_stdout_bytes
        self.on_stderr_bytes = options.on_stderr_bytes
        keep_output = options.keep_output
        self.keep: int | None = (
            None if keep_output is True else 0 if keep_output is False else int(keep_output)
        )
        self._out = bytearray()
        self._err = bytearray()
        self._partial = {"stdout": "", "stderr": ""}
        self.bytes_dropped = 0
        self.end_reason: str | None = None
        """E2B says only the exit code, not what ended a process."""
        self.stats = _Stats()
        self.bytes_sent = 0
        self.frames_sent = 0
        self.attached_at = time.time()
        self.last_send: float | None = None
        self.closed_at: float | None = None
        self.close_reason: str | None = None
        self._seq: int | None = None
        """The next log entry to read (found from the cursor at the first read)."""

    # -- what ProcessStream offers -----------------------------------------------------

    @property
    def cursor(self) -> int:
        return self._cursor

    @property
    def stdout_bytes(self) -> bytes:
        return bytes(self._out)

    @property
    def stderr_bytes(self) -> bytes:
        return bytes(self._err)

    @property
    def stdout(self) -> str:
        return self._out.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self._err.decode("utf-8", "replace")

    @property
    def exit_code(self) -> int | None:
        return self.log.exit_code if self.log.ended and self._cursor >= self.log.head else None

    @property
    def process_state(self) -> str | None:
        """The process's state as this client's tap knows it — known from the moment the
        reader exists (the tap was attached first), so a panel never shows "connecting"
        until its next poll."""
        return self.log.state()

    @property
    def sandbox_state(self) -> str:
        return self.sandbox.info.state

    async def flush_lines(self) -> None:
        for stream, text in list(self._partial.items()):
            if text:
                self._partial[stream] = ""
                await self._emit_text(stream, text)

    # -- following ---------------------------------------------------------------------

    async def run(self) -> int | None:
        """Deliver the log from the cursor until the process ended and all was read."""
        self.sandbox._journal.record("consumer.attached", self.pid, data={"role": self.role})
        try:
            while True:
                changed = self.log.waiter()
                await self._deliver_available()
                if self.log.ended and self._cursor >= self.log.head:
                    await self.flush_lines()
                    self.close_reason = "ended"
                    return self.log.exit_code
                await changed.wait()
        except asyncio.CancelledError:
            self.close_reason = self.close_reason or "detached"
            raise
        finally:
            self.closed_at = time.time()
            self.log.readers.discard(self)
            self._note_passed_gaps()
            self.sandbox._journal.record(
                "consumer.detached", self.pid, reason=self.close_reason or "error"
            )

    def _note_passed_gaps(self) -> None:
        """Leaving right after gaps at the cursor (no output since): remember it, so a
        reattach from this cursor does not show them again."""
        plog, seq = self.log, self._seq
        if seq is None or seq <= plog.first_seq:
            return
        last = plog.entry(seq - 1)
        if last.stream == "gap" and last.offset == self._cursor:
            plog.passed[self._cursor] = seq
            while len(plog.passed) > 64:
                del plog.passed[next(iter(plog.passed))]

    async def _deliver_available(self) -> None:
        plog = self.log
        if self._seq is None:
            self._seq = plog.seek(self._cursor)
            passed = plog.passed.get(self._cursor) if self._reattach else None
            if passed is not None and passed > self._seq:
                self._seq = passed
        while self._seq < plog.next_seq:
            if self._seq < plog.first_seq or self._cursor < plog.first:
                # Evicted before this reader got to it: counted, so the count is exact.
                gap = GapInfo(self._cursor, plog.first, max(0, plog.first - self._cursor))
                self._seq = plog.seek(plog.first)
                self._cursor = max(self._cursor, plog.first)
                await self._gap(gap)
                continue
            entry = plog.entry(self._seq)
            self._seq += 1
            if entry.stream == "gap":
                await self._gap(UnknownGap(entry.offset, entry.reason))
                continue
            end = entry.offset + len(entry.data)
            if end <= self._cursor:
                continue
            data = entry.data[max(0, self._cursor - entry.offset) :]
            self._cursor = end
            await self._deliver(entry.stream, data)

    async def _gap(self, gap: GapInfo | UnknownGap) -> None:
        if gap.bytes_lost is None:
            self.stats.unknown_gaps += 1
        else:
            self.stats.bytes_lost += gap.bytes_lost
        self.sandbox._journal.record(
            "consumer.gap",
            self.pid,
            reason=gap.reason if isinstance(gap, UnknownGap) else "evicted",
            data={"bytes_lost": gap.bytes_lost, "cursor": gap.cursor},
        )
        if self.on_gap == "raise":
            if gap.bytes_lost is None:
                raise OutputGap(
                    f"output may be missing here, amount unknown: {gap.reason}",
                    pid=self.pid,
                    cursor=gap.cursor,
                )
            raise OutputGap(
                f"{gap.bytes_lost} bytes of output were evicted from this client's log",
                pid=self.pid,
                cursor=gap.cursor,
            )
        if callable(self.on_gap):
            await _call(self.on_gap, gap)
            return
        amount = "an unknown amount of" if gap.bytes_lost is None else f"{gap.bytes_lost} bytes of"
        self._keep("stdout", f"\n[sandboxkit: {amount} output missing here]\n".encode())

    def _keep(self, stream: str, data: bytes) -> None:
        buf = self._err if stream == "stderr" else self._out
        buf += data
        if self.keep is not None and len(buf) > self.keep:
            excess = len(buf) - self.keep
            del buf[:excess]
            self.bytes_dropped += excess

    async def _deliver(self, stream: str, data: bytes) -> None:
        self.bytes_sent += len(data)
        self.frames_sent += 1
        self.last_send = time.time()
        self._keep(stream, data)
        raw = self.on_stderr_bytes if stream == "stderr" else self.on_stdout_bytes
        if raw is not None:
            await _call(raw, data)
        text = data.decode("utf-8", "replace")
        if not self.lines:
            await self._emit_text(stream, text)
            return
        pending = self._partial[stream] + text
        *whole, rest = pending.split("\n")
        self._partial[stream] = rest
        for line in whole:
            await self._emit_text(stream, line)

    async def _emit_text(self, stream: str, text: str) -> None:
        callback = self.on_stderr if stream == "stderr" else self.on_stdout
        if callback is not None:
            await _call(callback, text)

    def row(self) -> dict[str, Any]:
        closed = self.closed_at is not None
        return {
            "consumer_id": self.consumer_id,
            "name": self.consumer_id,
            "role": self.role,
            "sandbox_id": self.sandbox.sandbox_id,
            "pid": self.pid,
            "state": "closed" if closed else "streaming",
            "cursor": self._cursor,
            "head": self.log.head,
            "lag_bytes": max(0, self.log.head - self._cursor),
            "bytes_sent": self.bytes_sent,
            "frames_sent": self.frames_sent,
            "blocked_since": None,
            "last_send": self.last_send,
            "attached_at": self.attached_at,
            "closed_at": self.closed_at,
            "close_reason": self.close_reason,
            "peer": "client",
            "ghost": False,
        }


async def _call(callback: Callable[..., Any], *args: Any) -> None:
    result = callback(*args)
    if inspect.isawaitable(result):
        await result


# -- the tap: one SDK stream per process ------------------------------------------------


class _Tap:
    """Keeps an SDK stream open to one process and writes what arrives into its log;
    reopens it (behind an unknown-size gap) when it breaks, until the process ended."""

    def __init__(self, sandbox: E2BSandbox, plog: _ProcessLog) -> None:
        self.sandbox = sandbox
        self.log = plog
        self.handle: Any = None
        self.attached_at = time.time()
        self.reopened = 0

    def _out(self, text: str) -> None:
        self.log.append("stdout", text.encode("utf-8", "surrogateescape"))

    def _err(self, text: str) -> None:
        self.log.append("stderr", text.encode("utf-8", "surrogateescape"))

    def _pty(self, data: bytes) -> None:
        self.log.append("stdout", bytes(data))

    async def _open(self) -> Any:
        if self.log.pty:
            return await self.sandbox._e2b.pty.connect(self.log.pid, on_data=self._pty, timeout=0)
        return await self.sandbox._e2b.commands.connect(
            self.log.pid, timeout=0, on_stdout=self._out, on_stderr=self._err, retain_output=False
        )

    async def run(self, first: Any | None) -> None:
        handle = first
        delays = iter(_RECONNECT_DELAYS)
        try:
            while not self.log.ended:
                if handle is None:
                    if self.sandbox.info.state == "paused":
                        await self.sandbox._resumed.wait()
                    try:
                        handle = await self._open()
                    except NotFoundException:
                        self.log.end(None, "E2B no longer knows this process")
                        break
                    except Exception as exc:
                        delay = next(delays, None)
                        if delay is None:
                            self.log.end(None, f"lost the process's stream: {exc}")
                            break
                        await asyncio.sleep(delay)  # sleep-ok: paced reopen attempts
                        continue
                    self.reopened += 1
                    self.log.unknown_gap(_NO_REPLAY)
                self.handle = handle
                try:
                    result = await handle.wait()
                    self._ended(result.exit_code, result.error)
                except CommandExitException as exc:
                    self._ended(exc.exit_code, exc.error)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the stream broke: the process may run on
                    log.info("e2b stream of pid %s broke: %s", self.log.pid, exc)
                    handle = None
        finally:
            if self.handle is not None and not self.log.ended:
                with contextlib.suppress(Exception):
                    await self.handle.disconnect()

    def _ended(self, exit_code: int | None, error: str | None) -> None:
        exit_code = _signal_code(exit_code, error)
        if not self.log.ended:
            self.log.end(exit_code, error or None)
            self.sandbox._journal.record(
                "process.exited", self.log.pid, data={"exit_code": exit_code}
            )

    def row(self) -> dict[str, Any]:
        return {
            "consumer_id": f"e2b-tap-{self.log.pid}",
            "name": f"tap {self.log.pid}",
            "role": "e2b tap",
            "sandbox_id": self.sandbox.sandbox_id,
            "pid": self.log.pid,
            "state": "closed" if self.log.ended else "streaming",
            "cursor": self.log.head,
            "head": self.log.head,
            "lag_bytes": 0,
            "bytes_sent": self.log.head,
            "frames_sent": self.log.next_seq,
            "blocked_since": None,
            "last_send": None,
            "attached_at": self.attached_at,
            "closed_at": self.log.ended_at,
            "close_reason": "ended" if self.log.ended else None,
            "peer": "e2b",
            "ghost": False,
        }


# -- the journal ---------------------------------------------------------------------


class _Journal:
    """This client's own event journal, in the daemon's event format, marked
    ``"source": "client"`` (E2B keeps none to read)."""

    def __init__(self, sandbox_id: str, limit: int = 10_000) -> None:
        self.sandbox_id = sandbox_id
        self.events: deque[dict[str, Any]] = deque(maxlen=limit)
        self._seq = itertools.count()

    def record(
        self,
        kind: str,
        pid: int | None = None,
        *,
        reason: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        self.events.append(
            {
                "seq": next(self._seq),
                "ts": time.time(),
                "kind": kind,
                "sandbox_id": self.sandbox_id,
                "pid": pid,
                "reason": reason,
                "data": {**(data or {}), "source": "client"},
            }
        )

    def since(self, seq: int) -> builtins.list[dict[str, Any]]:
        return [e for e in self.events if e["seq"] >= seq]


# -- commands --------------------------------------------------------------------------


def _spec_of(info: Any) -> dict[str, Any]:
    """A running process's command as the SDK lists it (``/bin/bash -l -c <cmd>``)."""
    args = list(info.args)
    cmd = (
        args[2] if info.cmd == "/bin/bash" and args[:2] == ["-l", "-c"] and len(args) > 2 else None
    )
    return {
        "cmd": cmd,
        "argv": None if cmd is not None else [info.cmd, *args],
        "envs": dict(info.envs),
        "cwd": info.cwd,
    }


class E2BCommands(AsyncCommands):
    """``sbx.commands`` of an :class:`E2BSandbox`: the SDK's commands behind sandboxkit's
    interface (see the module docstring for what differs). ``start``, ``run``,
    ``connect`` and the handles are :class:`AsyncCommands`'s own; this class supplies its
    hooks (how a process starts, how a pid is tapped and read, how a foreground result
    with a gap of unknown size is reported) and the calls that go straight to the SDK."""

    def __init__(self, sandbox: E2BSandbox, owner: TaskOwner) -> None:
        # Not AsyncCommands.__init__: there is no daemon API behind these commands.
        self._sandbox = sandbox
        self._sandbox_id = sandbox.sandbox_id
        self._owner = owner

    @property
    def _sdk(self) -> Any:
        return self._sandbox._e2b.commands

    # -- the hooks of AsyncCommands ----------------------------------------------------

    async def _start_process(self, spec: dict[str, Any]) -> ProcessInfo:
        """Start a process through the SDK (the hook of :meth:`AsyncCommands.start`) and
        tap its output from its first byte. An ``argv`` runs as the shell command that
        quotes it; ``tag`` is not offered by E2B. ``pty=True`` goes through the SDK's pty
        API (:meth:`_start_pty`): the output is the terminal's raw bytes, as stdout."""
        cmd = _shell_join(spec["argv"]) if "argv" in spec else spec["cmd"]
        return await self._start_spec(
            {
                "cmd": cmd,
                "argv": None,
                "envs": dict(spec["envs"]),
                "cwd": spec["cwd"],
                "timeout": spec["timeout"],
                "pty": spec["pty"],
            }
        )

    async def _prepare_follow(self, pid: int) -> None:
        """A process this client does not tap yet is tapped from now: what it printed
        before is an unknown-size gap. An unknown pid raises ResultUnavailable."""
        await self._sandbox._ensure_tap(pid)

    def _open_stream(self, pid: int, cursor: int | None, options: FollowOptions) -> ProcessStream:
        """A :class:`_Reader` of the process's client-side log from ``cursor`` (bytes of
        output this client received; ``None``: the oldest it keeps)."""
        plog = self._sandbox._logs[pid]
        reader = _Reader(self._sandbox, plog, cursor, options)
        plog.readers.add(reader)
        # The handle reads of its stream exactly what _Reader offers (cursor, output,
        # stats, states, run, flush_lines): the same handle class serves both.
        return cast(ProcessStream, reader)

    def _incomplete_error(
        self, result: CommandResult, stream: ProcessStream, on_gap: OnGap
    ) -> OutputIncomplete | None:
        """A foreground result is complete or the run raises OutputIncomplete — also when
        output went missing in an amount E2B cannot tell (``bytes_lost`` is then
        ``None``)."""
        reader = cast(_Reader, stream)
        unknown = reader.stats.unknown_gaps if on_gap is None else 0
        lost = reader.bytes_dropped + (reader.stats.bytes_lost if on_gap is None else 0)
        if not (lost or unknown):
            return None
        amount = "an unknown amount" if unknown else f"{lost} bytes"
        return OutputIncomplete(
            f"process {result.pid} exited 0 but {amount} of its output is missing "
            "from the result; error.result has the rest",
            pid=result.pid,
            exit_code=result.exit_code,
            bytes_lost=None if unknown else lost,
            result=result,
        )

    # -- starting through the SDK ------------------------------------------------------

    async def _start_spec(self, spec: dict[str, Any]) -> ProcessInfo:
        """Start ``spec`` as :attr:`_ProcessLog.spec` keeps it (a restart starts it again)."""
        if spec.get("pty"):
            return await self._start_pty(spec)
        plog_holder: list[_ProcessLog] = []
        early: list[tuple[str, str]] = []

        def out(stream: str) -> Callable[[str], None]:
            def feed(text: str) -> None:
                data = text.encode("utf-8", "surrogateescape")
                if plog_holder:
                    plog_holder[0].append(stream, data)
                else:  # output before the start event's pid reached us: keep it in order
                    early.append((stream, text))

            return feed

        timeout = spec.get("timeout")
        handle = await self._sdk.run(
            spec["cmd"],
            background=True,
            envs=spec["envs"] or None,
            cwd=spec["cwd"],
            user=_USER,
            stdin=True,
            timeout=0 if timeout is None else timeout,
            on_stdout=out("stdout"),
            on_stderr=out("stderr"),
            retain_output=False,
        )
        plog = self._sandbox._new_log(handle.pid, spec)
        plog_holder.append(plog)
        for stream, text in early:
            plog.append(stream, text.encode("utf-8", "surrogateescape"))
        self._sandbox._tap(plog, handle)
        self._sandbox._journal.record("process.started", plog.pid, data={"cmd": spec["cmd"]})
        return self._sandbox._process_info(plog)

    async def _start_pty(self, spec: dict[str, Any]) -> ProcessInfo:
        """E2B's ``pty.create`` starts an interactive login shell, not a command: the
        command is typed into it (``exec``, so the command's exit is the process's), and
        what the shell prints before it — its prompt, the echo of the typed line — is
        dropped up to a marker the typed line prints (typed as octal escapes, so its echo
        does not contain it)."""
        plog_holder: list[_ProcessLog] = []
        pending = bytearray()
        started = False

        def feed(data: bytes) -> None:
            nonlocal started
            if not started:
                pending.extend(data)
                at = pending.find(_PTY_MARK)
                if at < 0:
                    return
                started = True
                data = bytes(pending[at + len(_PTY_MARK) :])
                pending.clear()
            if plog_holder:
                plog_holder[0].append("stdout", bytes(data))
            else:
                pending.extend(data)

        timeout = spec.get("timeout")
        handle = await self._sandbox._e2b.pty.create(
            e2b.PtySize(rows=_PTY_ROWS, cols=_PTY_COLS),
            on_data=feed,
            user=_USER,
            cwd=spec["cwd"],
            envs=spec["envs"] or None,
            timeout=0 if timeout is None else timeout,
        )
        plog = self._sandbox._new_log(handle.pid, spec)
        plog.pty = True
        plog_holder.append(plog)
        if started and pending:
            plog.append("stdout", bytes(pending))
            pending.clear()
        typed = f"printf '{_PTY_MARK_TYPED}'; exec /bin/bash -c {_quote(spec['cmd'])}\n"
        await self._sandbox._e2b.pty.send_stdin(handle.pid, typed.encode())
        self._sandbox._tap(plog, handle)
        self._sandbox._journal.record(
            "process.started", plog.pid, data={"cmd": spec["cmd"], "pty": True}
        )
        return self._sandbox._process_info(plog)

    async def list(self) -> builtins.list[ProcessInfo]:
        """Processes E2B lists as running, and those this client saw end."""
        self._owner.check()
        running = {p.pid: p for p in await self._sdk.list()}
        for pid, proc in running.items():
            if pid not in self._sandbox._logs:
                self._sandbox._new_log(pid, _spec_of(proc))
        infos = []
        for pid, plog in self._sandbox._logs.items():
            if pid in running or plog.ended:
                infos.append(self._sandbox._process_info(plog))
        return infos

    async def get(self, pid: int) -> ProcessInfo:
        for info in await self.list():
            if info.pid == pid:
                return info
        raise ProcessNotFound(f"no process {pid} in sandbox {self._sandbox_id}", pid=pid)

    async def kill(self, pid: int) -> bool:
        """Kill a process (SIGKILL: E2B sends no other signal); False if it was not
        running."""
        self._owner.check()
        killed = bool(await self._sdk.kill(pid))
        if killed:
            self._sandbox._journal.record("process.killed", pid)
        return killed

    async def restart(self, pid: int) -> ProcessInfo:
        """Kill ``pid`` and start its command again (same envs and cwd); the new process
        is tapped from its first byte."""
        self._owner.check()
        old = self._sandbox._logs.get(pid)
        if old is None:
            await self.list()
            old = self._sandbox._logs.get(pid)
        if old is None:
            raise ProcessNotFound(f"no process {pid} in sandbox {self._sandbox_id}", pid=pid)
        if old.spec.get("cmd") is None:
            raise ProviderUnsupported(
                f"process {pid} was not started as a shell command; restart it by hand",
                provider="e2b",
                operation="restart",
            )
        await self._sdk.kill(pid)
        if not old.ended:
            changed = old.waiter()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), _END_WAIT)
        info = await self._start_spec(dict(old.spec))
        new = self._sandbox._logs[info.pid]
        old.restarted_to, new.restarted_from = info.pid, pid
        self._sandbox._journal.record("process.restarted", info.pid, data={"old_pid": pid})
        return self._sandbox._process_info(new)

    def stdin_session(self, pid: int, **options: Any) -> StdinSession:
        raise ProviderUnsupported(
            "E2B has no exactly-once stdin sessions; use send_stdin",
            provider="e2b",
            operation="stdin_session",
        )

    async def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Write to the process's stdin (at most once: E2B does not deduplicate a retry,
        so none is made)."""
        self._owner.check()
        plog = self._sandbox._logs.get(pid)
        try:
            if plog is not None and plog.pty:
                raw = data.encode() if isinstance(data, str) else data
                await self._sandbox._e2b.pty.send_stdin(pid, raw)
            else:
                await self._sdk.send_stdin(pid, data)
        except NotFoundException as exc:
            raise ProcessNotFound(str(exc), pid=pid) from exc

    async def close_stdin(self, pid: int) -> None:
        self._owner.check()
        try:
            await self._sdk.close_stdin(pid)
        except NotFoundException as exc:
            raise ProcessNotFound(str(exc), pid=pid) from exc


def _shell_join(argv: builtins.list[str]) -> str:
    import shlex

    return shlex.join(argv)


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


# -- files ---------------------------------------------------------------------------


class E2BFiles(AsyncFiles):
    """``sbx.files`` through the SDK's ``files`` (paths relative to the user's home)."""

    def __init__(self, sandbox: E2BSandbox) -> None:
        # Not AsyncFiles.__init__: there is no daemon API behind these files.
        self._sandbox = sandbox

    async def write(self, path: str, data: str | bytes) -> WriteInfo:
        info = await self._sandbox._e2b.files.write(path, data, user=_USER)
        return WriteInfo(
            name=info.name, type=str(getattr(info.type, "value", "file")), path=info.path
        )

    async def read(  # type: ignore[override]
        self, path: str, format: Literal["text", "bytes"] = "text"
    ) -> str | bytes:
        try:
            if format == "bytes":
                return bytes(await self._sandbox._e2b.files.read(path, format="bytes", user=_USER))
            return str(await self._sandbox._e2b.files.read(path, user=_USER))
        except NotFoundException as exc:
            raise FileNotFound(str(exc), path=path) from exc

    async def list(self, path: str = ".") -> builtins.list[EntryInfo]:
        try:
            entries = await self._sandbox._e2b.files.list(path, user=_USER)
        except NotFoundException as exc:
            raise FileNotFound(str(exc), path=path) from exc
        return sorted(
            (
                EntryInfo(
                    name=e.name,
                    type=str(getattr(e.type, "value", "file")),
                    path=e.path,
                    size=e.size,
                )
                for e in entries
            ),
            key=lambda e: e.name,
        )


# -- the sandbox ---------------------------------------------------------------------


class E2BSandbox(AsyncSandbox):
    """An E2B sandbox behind sandboxkit's :class:`AsyncSandbox` interface (see the module
    docstring). Make one with ``AsyncSandbox.create(provider="e2b", ...)``."""

    provider: ClassVar[str] = "e2b"
    metrics_scope: ClassVar[str] = "client"
    """Consumer metrics are this client's own readers: E2B reports none."""

    def __init__(
        self,
        sdk: Any,
        sandbox_id: str,
        target: _Target,
        *,
        timeout: float | None,
        metadata: dict[str, str] | None,
        keep_bytes: int = DEFAULT_LOG_BYTES,
    ) -> None:
        # Not AsyncSandbox.__init__: there is no sandboxkit daemon behind this sandbox.
        self._e2b = sdk
        self._target = target
        self._owner = TaskOwner(sandbox_id)
        self._keep_bytes = keep_bytes
        self.sandbox_id = sandbox_id
        note_sandbox(sandbox_id)
        self.debug = target.debug
        self.info = SandboxInfo(
            sandbox_id=sandbox_id,
            state="running",
            timeout=timeout,
            on_timeout="kill",
            created_at=time.time(),
            metadata=dict(metadata or {}),
            fanout="e2b",
        )
        self._logs: dict[int, _ProcessLog] = {}
        self._journal = _Journal(sandbox_id)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.commands = E2BCommands(self, self._owner)
        self.files = E2BFiles(self)

    # -- construction ----------------------------------------------------------------

    @classmethod
    async def _open(
        cls,
        *,
        timeout: float | None,
        envs: dict[str, str] | None,
        metadata: dict[str, str] | None,
        url: str | None,
        token: str | None,
        options: dict[str, Any],
    ) -> E2BSandbox:
        opts = dict(options)
        keep_bytes = int(opts.pop("keep_bytes", DEFAULT_LOG_BYTES))
        target = _Target.resolve(url, token, opts)
        sdk_timeout = None if timeout is None else max(1, int(timeout))
        sdk = await e2b.AsyncSandbox.create(
            timeout=sdk_timeout, envs=envs, metadata=metadata, **target.options
        )
        if target.debug:
            sandbox_id = f"e2b-debug-{next(_ids)}"
            _registry[sandbox_id] = (target.url or DEFAULT_ENVD_URL, dict(target.options))
        else:
            sandbox_id = sdk.sandbox_id
        sbx = cls(
            sdk, sandbox_id, target, timeout=timeout, metadata=metadata, keep_bytes=keep_bytes
        )
        sbx._journal.record("sandbox.created", data={"debug": target.debug})
        return sbx

    @property
    def connection(self) -> Connection:
        """Where the SDK talks to: the envd URL (debug) or E2B's API URL (cloud)."""
        config = self._e2b.connection_config
        url = self._target.url if self.debug else config.api_url
        return Connection(str(url), None)

    # -- processes -------------------------------------------------------------------

    def _new_log(self, pid: int, spec: dict[str, Any]) -> _ProcessLog:
        plog = self._logs.get(pid)
        if plog is None:
            plog = self._logs[pid] = _ProcessLog(pid, spec, self._keep_bytes)
        return plog

    def _tap(self, plog: _ProcessLog, handle: Any | None) -> None:
        tap = plog.tap = _Tap(self, plog)
        self._owner.spawn(tap.run(handle), name=f"sandboxkit-e2b-tap-{plog.pid}")

    async def _ensure_tap(self, pid: int) -> None:
        plog = self._logs.get(pid)
        if plog is not None and (plog.tap is not None or plog.ended):
            return
        tap_log = plog or _ProcessLog(pid, {"cmd": None, "argv": None, "envs": {}, "cwd": None}, 0)
        tap_log.keep_bytes = self._keep_bytes
        probe = _Tap(self, tap_log)
        try:
            handle = await probe._open()
        except NotFoundException as exc:
            raise ResultUnavailable(
                f"E2B knows no running process {pid} in sandbox {self.sandbox_id}",
                pid=pid,
                reason="unknown_pid",
            ) from exc
        if plog is None:
            self._logs[pid] = tap_log
            with contextlib.suppress(Exception):
                for proc in await self._e2b.commands.list():
                    if proc.pid == pid:
                        tap_log.spec = _spec_of(proc)
        # Followed from now: what it printed before this client attached is unknown.
        tap_log.unknown_gap("E2B replays nothing printed before this attach")
        tap_log.tap = probe
        self._owner.spawn(probe.run(handle), name=f"sandboxkit-e2b-tap-{pid}")

    def _process_info(self, plog: _ProcessLog) -> ProcessInfo:
        spec = plog.spec
        readers = sum(1 for r in plog.readers if r.closed_at is None)
        return ProcessInfo(
            pid=plog.pid,
            sandbox_id=self.sandbox_id,
            spec=ProcessSpecInfo(cmd=spec.get("cmd"), argv=spec.get("argv")),
            state=plog.state(),
            exit_code=plog.exit_code,
            started_at=plog.started_at,
            ended_at=plog.ended_at,
            head=plog.head,
            total_bytes=plog.head,
            consumers=readers,
            restarted_from=plog.restarted_from,
            restarted_to=plog.restarted_to,
        )

    # -- lifecycle -------------------------------------------------------------------

    def _set_state(self, state: SandboxState) -> None:
        alive = sum(1 for p in self._logs.values() if not p.ended)
        self.info = SandboxInfo(
            sandbox_id=self.sandbox_id,
            state=state,
            timeout=self.info.timeout,
            on_timeout=self.info.on_timeout,
            auto_resume=self.info.auto_resume,
            created_at=self.info.created_at,
            processes=alive,
            metadata=self.info.metadata,
            fanout="e2b",
        )

    def _cloud_only(self, operation: str) -> None:
        if self.debug:
            raise ProviderUnsupported(
                f"E2B's debug mode has no control plane, so no {operation}: it needs E2B's "
                "cloud (set E2B_API_KEY) or a sandboxkit daemon's control plane "
                "(sandboxkit serve --envd; see docs/e2b.md)",
                provider="e2b",
                operation=operation,
            )

    async def get_info(self) -> SandboxInfo:
        """The state as this client knows it; in the cloud, E2B's state (running or
        paused)."""
        self._owner.check()
        if not self.debug:
            info = await self._e2b.get_info()
            state = str(getattr(info.state, "value", info.state))
            self._set_state("paused" if state == "paused" else "running")
        else:
            self._set_state(self.info.state)
        return self.info

    async def pause(self) -> None:
        """Pause the sandbox (the SDK's ``pause()``; needs a control plane)."""
        self._owner.check()
        self._cloud_only("pause")
        self._resumed.clear()
        await self._e2b.pause()
        self._set_state("paused")
        self._journal.record("sandbox.paused", reason="user")

    async def resume(self) -> None:
        """Resume the sandbox (the SDK's ``connect()``; needs a control plane); taps the
        pause cut reopen, behind an unknown-size gap."""
        self._owner.check()
        self._cloud_only("resume")
        await self._e2b.connect()
        self._set_state("running")
        self._resumed.set()
        self._journal.record("sandbox.resumed", reason="user")

    async def set_timeout(self, timeout: float | None) -> None:
        """E2B's ``set_timeout`` (cloud): the sandbox ends ``timeout`` seconds from now,
        whether or not anyone uses it (E2B's clock; sandboxkit's counts idle time)."""
        self._owner.check()
        if timeout is None:
            raise InvalidArgument("E2B sandboxes always have a timeout", field="timeout")
        if not self.debug:
            await self._e2b.set_timeout(max(1, int(timeout)))
        self.info = msgspec.structs.replace(self.info, timeout=timeout)

    async def kill(self) -> None:
        """Kill the sandbox (cloud). In debug mode, where the SDK cannot kill a sandbox,
        every process this client knows is killed. Then this client closes."""
        self._owner.check()
        try:
            if self.debug:
                with contextlib.suppress(Exception):
                    for proc in await self._e2b.commands.list():
                        await self._e2b.commands.kill(proc.pid)
            else:
                await self._e2b.kill()
            self._set_state("killed")
            self._journal.record("sandbox.killed", reason="user")
            _registry.pop(self.sandbox_id, None)
        finally:
            await self._after_kill()

    async def close(self) -> None:
        """Stop every tap and reader of this client; the sandbox runs on."""
        await self._owner.aclose()

    async def __aexit__(self, *exc: object) -> None:
        if self._owner.closed:
            return
        await self.kill()

    # -- observability ---------------------------------------------------------------

    async def consumers(self) -> pd.DataFrame:
        """This client's taps and readers (client-side only: E2B reports no consumer
        metrics). ``frame.attrs["scope"] == "client"``."""
        rows = []
        for plog in self._logs.values():
            if plog.tap is not None:
                rows.append(plog.tap.row())
            rows.extend(r.row() for r in plog.readers)
        frame = consumers_frame(rows)
        frame.attrs["scope"] = "client"
        return frame

    async def raw_events(
        self, since: int = 0, *, wait: float | None = None
    ) -> builtins.list[dict[str, Any]]:
        """This client's journal (each event's ``data`` says ``"source": "client"``);
        ``wait`` is not supported (E2B has no journal to wait on): answered at once."""
        return self._journal.since(since)

    async def events(self, since: int = 0) -> pd.DataFrame:
        return events_frame(await self.raw_events(since))

    def __repr__(self) -> str:
        mode = "debug" if self.debug else "cloud"
        return f"<E2BSandbox {self.sandbox_id} {self.info.state} ({mode})>"


# -- the provider's entry points -----------------------------------------------------


async def create(
    *,
    timeout: float | None,
    envs: dict[str, str] | None,
    metadata: dict[str, str] | None,
    url: str | None,
    token: str | None,
    options: dict[str, Any],
) -> E2BSandbox:
    """A new E2B sandbox (see the module docstring for cloud vs debug)."""
    return await E2BSandbox._open(
        timeout=timeout, envs=envs, metadata=metadata, url=url, token=token, options=options
    )


async def connect(
    sandbox_id: str, *, url: str | None, token: str | None, options: dict[str, Any]
) -> E2BSandbox:
    """A client of an existing E2B sandbox (cloud: any of yours; debug: one made in this
    process). Its processes are tapped from now on."""
    if sandbox_id in _registry:
        envd_url, opts = _registry[sandbox_id]
        sdk = await e2b.AsyncSandbox.connect("debug_sandbox_id", **opts)
        target = _Target(True, opts, envd_url)
    else:
        target = _Target.resolve(url, token, options)
        if target.debug:
            raise SandboxNotFound(
                f"no E2B debug sandbox {sandbox_id} in this process", sandbox_id=sandbox_id
            )
        sdk = await e2b.AsyncSandbox.connect(sandbox_id, **target.options)
    return E2BSandbox(sdk, sandbox_id, target, timeout=None, metadata=None)


async def list_sandboxes(
    *, url: str | None, token: str | None, options: dict[str, Any]
) -> builtins.list[SandboxInfo]:
    """Your E2B sandboxes (cloud), or the debug sandboxes made in this process."""
    target = _Target.resolve(url, token, options)
    if target.debug:
        return [
            SandboxInfo(
                sandbox_id=sid,
                state="running",
                timeout=None,
                on_timeout="kill",
                created_at=0.0,
                fanout="e2b",
            )
            for sid in _registry
        ]
    paginator = e2b.AsyncSandbox.list(**target.options)
    infos: builtins.list[SandboxInfo] = []
    while paginator.has_next:
        for item in await paginator.next_items():
            state = str(getattr(item.state, "value", item.state))
            infos.append(
                SandboxInfo(
                    sandbox_id=item.sandbox_id,
                    state="paused" if state == "paused" else "running",
                    timeout=None,
                    on_timeout="kill",
                    auto_resume=False,
                    created_at=item.started_at.timestamp(),
                    processes=0,
                    metadata=dict(item.metadata or {}),
                    fanout="e2b",
                )
            )
    return infos
