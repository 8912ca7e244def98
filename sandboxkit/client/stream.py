"""Following a process's output from a cursor, through kicks, gaps and dead connections."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import time
import warnings
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import httpx

from sandboxkit._compat import within
from sandboxkit.client.api import ApiClient
from sandboxkit.client.frames import KeepaliveMeta, StartMeta, parse_meta
from sandboxkit.client.lines import split_lines
from sandboxkit.client.options import (
    CONNECT_KEYWORDS,
    ConnectOptions,
    FollowOptions,
    check_keywords,
    follow_options,
)
from sandboxkit.client.output import DEFAULT_KEEP_OUTPUT, Cursor, StreamOutput
from sandboxkit.client.results import CommandResult
from sandboxkit.client.transport import FrameStream
from sandboxkit.errors import (
    ConsumerKicked,
    DaemonUnavailable,
    MalformedFrame,
    OutputGap,
    OutputGapWarning,
    OutputIncomplete,
    StreamInterrupted,
    StreamStalled,
    error_from_wire,
)
from sandboxkit.wire import Frame, FrameKind

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from sandboxkit.client.start_stream import Opened

__all__ = [
    "BytesCallback",
    "Gap",
    "GapInfo",
    "OnGap",
    "OutputCallback",
    "ProcessStream",
    "StreamStats",
    "UnknownGap",
    "gap_marker",
]

OutputCallback = Callable[[str], Any]
"""Called with decoded text; may be sync or async. With ``lines=True`` (the default of
``commands.run``/``connect``) each call gets one whole line without its newline, so
``on_stdout=print`` prints what the process printed; with ``lines=False`` each call gets a
raw chunk as it arrived (possibly part of a line, or several)."""

BytesCallback = Callable[[bytes], Any]
"""Called with each chunk's bytes exactly as the process wrote them; sync or async."""


@dataclass(frozen=True)
class GapInfo:
    """Output the daemon evicted before this stream read it."""

    cursor: int
    first_available: int
    bytes_lost: int
    reason: str = "evicted"
    """Why: ``evicted`` (the daemon's retention passed the cursor) or ``not_replayed``
    (the sandbox's lab fan-out delivers new output only and did not honour the cursor)."""

    @property
    def why(self) -> str:
        """The reason in words, for a marker or a warning."""
        if self.reason == "not_replayed":
            return "not replayed: the sandbox's lab fan-out delivers new output only"
        return "evicted by the daemon before this reader read them"


@dataclass(frozen=True)
class UnknownGap:
    """Output may have been produced here while nobody was attached, and the backend can
    neither replay it nor say how much (E2B's envd replays nothing after a reattach):
    ``bytes_lost`` is ``None`` on purpose, never a made-up number."""

    cursor: int
    """Where in the stream (bytes this client received before the gap) it sits."""
    reason: str
    """Why, in words a person reads (e.g. "E2B replays nothing ...")."""
    bytes_lost: None = None


Gap = GapInfo | UnknownGap
"""What an ``on_gap`` callable receives: a :class:`GapInfo` (a sandboxkit daemon's
gaps always have a size) or an :class:`UnknownGap` (a provider's, of unknown size)."""

OnGap = Callable[[Gap], Any] | Literal["raise"] | None
"""What a stream does when output was lost before it read it. ``None`` (the default):
an :class:`~sandboxkit.errors.OutputGapWarning` and a marker in ``stdout`` (see
:func:`gap_marker`); a callable: called with the :class:`Gap` instead; ``"raise"``:
the stream ends with :class:`~sandboxkit.errors.OutputGap`."""


def gap_marker(gap: GapInfo) -> str:
    """The line that stands in a handle's ``stdout`` where output was lost."""
    return f"\n[sandboxkit: {gap.bytes_lost} bytes of output lost here]\n"


_OPEN_TIMEOUT = 10.0
_DEAD_AFTER = 1.0
"""Seconds of refused connections after which the daemon is taken for dead."""
_BACKOFF_START = 0.05
_BACKOFF_MAX = 2.0


class _Silent(Exception):
    """No frame arrived within the watchdog bound."""


if sys.version_info >= (3, 11):

    class _Watchdog:
        """Cancels the reading task once the stream made no progress for its watchdog
        bound. One timer per attach that, when it fires, looks at when the last read
        completed and sleeps on if it is recent, so a read costs two attribute stores
        instead of a timer rescheduled (cancelled and made anew) twice per read."""

        def __init__(self, stream: ProcessStream) -> None:
            self._stream = stream
            self._loop = asyncio.get_running_loop()
            task = asyncio.current_task()
            assert task is not None
            self._task = task
            self._cancelling = task.cancelling()
            self._fired = False
            self.progress = self._loop.time()
            """Loop time of the last progress: a read completed and its frames handled."""
            self.busy = False
            """True while frames are handled: the bound does not run (a slow callback)."""
            self.bound = stream.watchdog_bound
            self._timer = self._loop.call_at(self.progress + self.bound, self._check)

        def rearm(self) -> None:
            """Take the stream's bound anew (the start frame gave the keepalive interval)."""
            self._timer.cancel()
            self.bound = self._stream.watchdog_bound
            self._timer = self._loop.call_at(self.progress + self.bound, self._check)

        def _check(self) -> None:
            now = self._loop.time()
            self.bound = self._stream.watchdog_bound
            due = (now if self.busy else self.progress) + self.bound
            if due > now:
                self._timer = self._loop.call_at(due, self._check)
                return
            self._fired = True
            self._task.cancel()

        def expired(self) -> bool:
            """True if the task was cancelled by this watchdog (and by nobody else)."""
            return self._fired and self._task.uncancel() <= self._cancelling

        def close(self) -> None:
            self._timer.cancel()


@dataclass
class StreamStats:
    """What happened to one stream so far."""

    attaches: int = 0
    kicks: int = 0
    watchdog_expiries: int = 0
    disconnects: int = 0
    gaps: int = 0
    bytes_lost: int = 0
    frames: int = 0
    bytes: int = 0


class ProcessStream:
    """Reads one process's output from ``cursor`` until its ``end`` frame.

    ``cursor`` may be a :class:`~sandboxkit.client.output.Cursor` from a previous stream
    (``handle.cursor``, ``disconnect()``): a character it split is then decoded whole. The
    newest ``keep_output`` bytes of each stream are kept (``stdout``, ``stdout_bytes``).

    Every interruption that is not definitive — a kick, a dropped connection, a stream that
    went silent for ``watchdog_multiple`` keepalive intervals — is answered by reattaching
    from the cursor, with backoff, for up to ``reattach_timeout`` seconds of failure. A
    definitive answer (the result is unavailable, the sandbox is gone) is raised as its
    typed error. A silent stream first asks the daemon's ``/health``: no answer within
    :attr:`probe_timeout` means the daemon is hung (stopped, its loop blocked), reported
    at once as :class:`~sandboxkit.errors.DaemonUnavailable` (reconnect from ``cursor``
    once it answers again), not waited out for ``reattach_timeout``. With the daemon's
    default 2 s keepalive that is at most 4 s of silence and a 1 s probe.
    """

    def __init__(
        self,
        api: ApiClient,
        sandbox_id: str,
        pid: int,
        cursor: int | None = None,
        options: FollowOptions | None = None,
        *,
        name: str | None = None,
        watchdog_multiple: float = 2.0,
        reattach_timeout: float = 60.0,
        opened: Opened | None = None,
        **follow: Unpack[ConnectOptions],
    ) -> None:
        # What to deliver and how: ``options`` whole (as commands.connect resolved it), or
        # the keywords of connect, with connect's defaults.
        check_keywords(CONNECT_KEYWORDS, "ProcessStream", follow)
        if options is None:
            options = follow_options(follow, DEFAULT_KEEP_OUTPUT)
        elif follow:
            raise TypeError("ProcessStream() takes options= or its keywords, not both")
        self.options = options
        self.api = api
        self.sandbox_id = sandbox_id
        self.pid = pid
        self._seq = None if cursor is None else int(cursor)
        self.on_stdout = options.on_stdout
        self.on_stderr = options.on_stderr
        self.on_stdout_bytes = options.on_stdout_bytes
        self.on_stderr_bytes = options.on_stderr_bytes
        self.on_gap = options.on_gap
        self.name = name
        self.role = options.role
        self.watchdog_multiple = watchdog_multiple
        self.reattach_timeout = reattach_timeout
        self._opened = opened
        keep_output = self.keep_output = options.keep_output
        self.lines = options.lines
        self._partial = {"stdout": "", "stderr": ""}
        self.stats = StreamStats()
        self.exit_code: int | None = None
        self.end_reason: str | None = None
        """Why the process ended, from its ``end`` frame (``exit``, ``oom`` …)."""
        self.ended = False
        self.process_state: str | None = None
        self.sandbox_state: str | None = None
        self.state_seq: int | None = None
        """The sandbox's count of lifecycle transitions when the daemon last told this
        stream its states (it does at once on every change): orders them against an
        action's result (``SandboxInfo.raw["state_seq"]``)."""
        self.last_frame_at: float | None = None
        self.gaps: list[GapInfo] = []
        self._keepalive: float | None = None
        tails = (cursor.stdout_tail, cursor.stderr_tail) if isinstance(cursor, Cursor) else ()
        if isinstance(cursor, Cursor):  # a line the previous handle saw begin
            self._partial = {"stdout": cursor.stdout_line, "stderr": cursor.stderr_line}
        self.output = {
            target: StreamOutput(keep_output, tail)
            for target, tail in zip(("stdout", "stderr"), tails or (b"", b""), strict=True)
        }

    @property
    def cursor(self) -> Cursor | None:
        """Where this stream is: the next chunk's sequence number, with the bytes of any
        character split there (see :class:`~sandboxkit.client.output.Cursor`)."""
        if self._seq is None:
            return None
        return Cursor(
            self._seq,
            self.output["stdout"].tail,
            self.output["stderr"].tail,
            stdout_line=self._partial["stdout"],
            stderr_line=self._partial["stderr"],
        )

    @property
    def stdout(self) -> str:
        """The stdout (and PTY) output kept so far, decoded; a marker where output was
        lost to a gap (unless ``on_gap`` handles gaps)."""
        return self.output["stdout"].text(final=self.ended)

    @property
    def stderr(self) -> str:
        """The stderr output kept so far, decoded."""
        return self.output["stderr"].text(final=self.ended)

    @property
    def stdout_bytes(self) -> bytes:
        """The stdout (and PTY) bytes kept so far, exactly as written."""
        return self.output["stdout"].data

    @property
    def stderr_bytes(self) -> bytes:
        """The stderr bytes kept so far, exactly as written."""
        return self.output["stderr"].data

    @property
    def bytes_dropped(self) -> int:
        """Bytes received and no longer kept (beyond ``keep_output``), both streams."""
        return sum(out.dropped for out in self.output.values())

    @property
    def watchdog_bound(self) -> float:
        """Silence after which the stream is declared dead."""
        if self._keepalive is None:
            return _OPEN_TIMEOUT
        return self._keepalive * self.watchdog_multiple

    @property
    def probe_timeout(self) -> float:
        """How long a silent stream's health probe waits for the daemon: half a keepalive
        period, between 0.5 and 1 s."""
        if self._keepalive is None:
            return 1.0
        return min(1.0, max(0.5, self._keepalive / 2))

    async def _check_alive(self) -> None:
        if not await self.api.alive(self.probe_timeout):
            raise DaemonUnavailable(
                f"the daemon at {self.api.url} is hung: process {self.pid}'s stream was "
                f"silent for {self.watchdog_bound:g}s and /health got no answer within "
                f"{self.probe_timeout:g}s; its output stopped at cursor {self._seq}",
                url=self.api.url,
            )

    async def run(self) -> int | None:
        """Stream until the process's exit; returns its exit code."""
        backoff = _BACKOFF_START
        failing_since: float | None = None
        refused_since: float | None = None
        while not self.ended:
            frames_before = self.stats.frames
            refused = False
            try:
                await self._attach_once()
            except ConsumerKicked:
                self.stats.kicks += 1
            except _Silent:
                self.stats.watchdog_expiries += 1
                await self._check_alive()
            except StreamInterrupted as exc:  # cut off or garbled: reattach from the cursor
                self.stats.disconnects += 1
                refused = isinstance(exc.__cause__, ConnectionRefusedError | httpx.ConnectError)
            if self.ended:
                break
            now = time.monotonic()
            if not refused:
                refused_since = None
            elif refused_since is None:
                refused_since = now
            elif now - refused_since > _DEAD_AFTER:
                # Nobody listens where the daemon was: it is gone, and with it the process
                # (a new daemon never knows it). Not a stall to wait out for a minute.
                raise DaemonUnavailable(
                    f"the daemon at {self.api.url} is gone (connections refused for "
                    f"{now - refused_since:.1f}s); process {self.pid}'s output stopped at "
                    f"cursor {self._seq}",
                    url=self.api.url,
                )
            if refused:
                backoff = min(backoff, _DEAD_AFTER / 4)
            if self.stats.frames > frames_before + 1:
                failing_since, backoff = None, _BACKOFF_START
            if failing_since is None:
                failing_since = now
            elif now - failing_since > self.reattach_timeout:
                raise StreamStalled(
                    f"no progress on process {self.pid} for {now - failing_since:.1f}s",
                    pid=self.pid,
                    cursor=self.cursor,
                    silence=round(now - failing_since, 3),
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX)
        await self._flush()
        return self.exit_code

    async def _attach_once(self) -> None:
        opened, self._opened = self._opened, None
        if opened is not None:  # the start request's own (see client/start_stream.py)
            async with opened.stack:
                self.stats.attaches += 1
                await self._read(opened.batches)
            return
        path = f"/sandboxes/{self.sandbox_id}/processes/{self.pid}/stream"
        async with contextlib.AsyncExitStack() as stack:
            opening = stack.enter_async_context(
                self.api.stream(path, cursor=self._seq, name=self.name, role=self.role)
            )
            try:
                # Not asyncio.wait_for: before 3.12 it swallows a cancellation that arrives
                # as the awaited frame completes (disconnect() could hang forever). Bounded
                # as any silence: a frozen daemon's kernel still accepts the connection.
                frames: FrameStream = await within(opening, self.watchdog_bound)
            except TimeoutError:
                raise _Silent() from None
            self.stats.attaches += 1
            # Borrowed (payloads are views into the receive buffer until the next batch:
            # _deliver copies only what keeps them); closed before the connection goes.
            stack.push_async_callback((batches := frames.batches(borrow=True)).aclose)
            await self._read(batches)

    async def _read(self, batches: AsyncIterator[list[Frame]]) -> None:
        if sys.version_info >= (3, 11):
            await self._read_watched(batches)
            return
        while True:  # pragma: no cover - Python 3.10: one timeout per read
            try:
                batch = await within(batches.__anext__(), self.watchdog_bound)
            except StopAsyncIteration:
                raise DaemonUnavailable("stream closed before its end frame") from None
            except TimeoutError:
                raise _Silent() from None
            for frame in batch:
                if await self._handle(frame):
                    return

    if sys.version_info >= (3, 11):

        async def _read_watched(self, batches: AsyncIterator[list[Frame]]) -> None:
            """Read to the end frame, declaring the stream silent when no read completes
            within the watchdog bound. The bound is suspended while frames are handled,
            so a slow callback is never mistaken for a dead stream."""
            loop = asyncio.get_running_loop()
            watchdog = _Watchdog(self)
            try:
                while True:
                    try:
                        batch = await batches.__anext__()
                    except StopAsyncIteration:
                        raise DaemonUnavailable("stream closed before its end frame") from None
                    watchdog.busy = True
                    for frame in batch:
                        if await self._handle(frame):
                            return
                    watchdog.progress = loop.time()
                    watchdog.busy = False
                    if watchdog.bound != self.watchdog_bound:
                        watchdog.rearm()
            except asyncio.CancelledError:
                if watchdog.expired():
                    raise _Silent() from None
                raise
            finally:
                watchdog.close()

    async def _handle(self, frame: Frame) -> bool:
        self.last_frame_at = time.monotonic()
        self.stats.frames += 1
        kind = frame.kind
        meta = parse_meta(kind, frame.meta)  # MalformedFrame unless usable
        if kind is FrameKind.DATA:
            if self._seq is not None and meta.seq < self._seq:
                return False  # already delivered before a reattach
            self._seq = meta.seq + 1
            self.stats.bytes += len(frame.payload)
            await self._deliver(meta.stream, frame.payload)
        elif kind is FrameKind.START:
            # A cursor a lab policy did not honour comes as a gap frame right after this
            # one (its exact size), handled like any gap.
            self._seq = meta.cursor
            self._keepalive = meta.keepalive_interval or _OPEN_TIMEOUT
            self._states(meta)
        elif kind is FrameKind.KEEPALIVE:
            self._states(meta)
        elif kind is FrameKind.GAP:
            if meta.first_available < meta.cursor:
                raise MalformedFrame(f"gap frame goes backwards: {frame.meta}"[:300])
            await self._gap(
                GapInfo(meta.cursor, meta.first_available, meta.bytes_lost, meta.reason)
            )
        elif kind is FrameKind.END:
            self.exit_code = meta.exit_code
            self.end_reason = meta.reason
            if meta.cursor is not None:
                self._seq = meta.cursor
            elif self._seq is None:
                self._seq = 0
            self.process_state = "exited"
            self.ended = True
            return True
        elif kind is FrameKind.ERROR:
            raise error_from_wire(frame.meta)
        return False

    def _states(self, meta: StartMeta | KeepaliveMeta) -> None:
        if meta.process_state is not None:
            self.process_state = meta.process_state
        if meta.sandbox_state is not None:
            self.sandbox_state = meta.sandbox_state
        if meta.state_seq is not None:
            self.state_seq = meta.state_seq

    async def _gap(self, gap: GapInfo) -> None:
        self.gaps.append(gap)
        self.stats.gaps += 1
        self.stats.bytes_lost += gap.bytes_lost
        self._seq = gap.first_available
        if self.on_gap == "raise":
            raise OutputGap(
                f"{gap.bytes_lost} bytes of process {self.pid} were evicted before being read",
                pid=self.pid,
                cursor=gap.cursor,
                first_available=gap.first_available,
                bytes_lost=gap.bytes_lost,
            )
        if self.on_gap is not None:
            await _call(self.on_gap, gap)
            return
        # Nobody asked to handle gaps: never lose output silently.
        warnings.warn(
            OutputGapWarning(
                f"{gap.bytes_lost} bytes of process {self.pid}'s output lost, {gap.why} "
                f"(cursor {gap.cursor} -> {gap.first_available}); pass on_gap= to handle "
                "gaps yourself"
            ),
            stacklevel=2,
        )
        for target in ("stdout", "stderr"):
            marker = gap_marker(gap) if target == "stdout" else ""
            broken = self.output[target].mark(marker)
            if broken:
                await self._emit(target, broken)

    async def _deliver(self, stream: str, data: bytes | memoryview) -> None:
        target = "stderr" if stream == "stderr" else "stdout"
        raw = self.on_stderr_bytes if target == "stderr" else self.on_stdout_bytes
        callback = self.on_stderr if target == "stderr" else self.on_stdout
        output = self.output[target]
        if raw is not None and type(data) is memoryview:
            data = bytes(data)  # handed to a caller: bytes of its own (kept as they are)
        text = output.add(data, decode=callback is not None)
        if raw is not None:
            await _call(raw, data)
        if text:
            await self._emit(target, text)

    async def _emit(self, target: str, text: str) -> None:
        callback = self.on_stderr if target == "stderr" else self.on_stdout
        if callback is None:
            return
        partial = self._partial[target]
        if not self.lines:
            if partial:  # carried over by the cursor from a line-by-line handle
                text, self._partial[target] = partial + text, ""
            await _call(callback, text)
            return
        complete, self._partial[target] = split_lines(partial, text)
        for line in complete:
            await _call(callback, line.removesuffix("\r"))

    async def _flush(self) -> None:
        """At the end of the output: a character the output ended inside of (as U+FFFD),
        then any last line that had no newline."""
        for target in ("stdout", "stderr"):
            tail = self.output[target].tail
            if tail:
                await self._emit(target, tail.decode("utf-8", "replace"))
        await self.flush_lines()

    async def flush_lines(self) -> None:
        """Hand the callbacks any line received without its newline yet, at the end of the
        output (a handle that disconnects passes it on in its :attr:`cursor` instead)."""
        for target in ("stdout", "stderr"):
            rest, self._partial[target] = self._partial[target], ""
            callback = self.on_stderr if target == "stderr" else self.on_stdout
            if rest and callback is not None:
                await _call(callback, rest.removesuffix("\r"))

    def incomplete_error(self, result: CommandResult) -> OutputIncomplete | None:
        """The error a foreground ``run`` raises because ``result`` (exit 0) misses output
        — evicted before it was read, unless ``on_gap`` took it, or beyond
        ``keep_output`` — or ``None`` when it is complete. Every gap here has a size."""
        lost = self.bytes_dropped + (self.stats.bytes_lost if self.on_gap is None else 0)
        if not lost:
            return None
        return OutputIncomplete(
            f"process {result.pid} exited 0 but {lost} bytes of its output are missing "
            f"from the result ({self.stats.bytes_lost} evicted by the daemon before "
            f"they were read, {self.bytes_dropped} beyond keep_output); "
            "error.result has the rest",
            pid=result.pid,
            exit_code=result.exit_code,
            bytes_lost=lost,
            result=result,
        )


async def _call(callback: Callable[..., Any], *args: Any) -> None:
    result = callback(*args)
    if result is not None and inspect.isawaitable(result):  # None: the usual, asked first
        await result
