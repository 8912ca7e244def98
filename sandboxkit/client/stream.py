"""Following a process's output from a cursor, through kicks, gaps and dead connections."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from sandboxkit._compat import within
from sandboxkit.client.api import ApiClient
from sandboxkit.errors import (
    ConsumerKicked,
    DaemonUnavailable,
    MalformedFrame,
    OutputGap,
    StreamStalled,
)
from sandboxkit.wire import Frame, FrameKind

__all__ = ["GapInfo", "OnGap", "OutputCallback", "ProcessStream", "StreamStats"]

OutputCallback = Callable[[str], Any]
"""Called with decoded text as it arrives; may be sync or async."""


@dataclass(frozen=True)
class GapInfo:
    """Output the daemon evicted before this stream read it."""

    cursor: int
    first_available: int
    bytes_lost: int


OnGap = Callable[[GapInfo], Any] | Literal["raise"] | None

_OPEN_TIMEOUT = 10.0
_BACKOFF_START = 0.05
_BACKOFF_MAX = 2.0


class _Silent(Exception):
    """No frame arrived within the watchdog bound."""


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

    Every interruption that is not definitive — a kick, a dropped connection, a stream that
    went silent for ``watchdog_multiple`` keepalive intervals — is answered by reattaching
    from the cursor, with backoff, for up to ``reattach_timeout`` seconds of failure. A
    definitive answer (the result is unavailable, the sandbox is gone) is raised as its
    typed error.
    """

    def __init__(
        self,
        api: ApiClient,
        sandbox_id: str,
        pid: int,
        cursor: int | None = None,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        on_gap: OnGap = None,
        name: str | None = None,
        watchdog_multiple: float = 3.0,
        reattach_timeout: float = 60.0,
        keep_output: bool = True,
    ) -> None:
        self.api = api
        self.sandbox_id = sandbox_id
        self.pid = pid
        self.cursor = cursor
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.on_gap = on_gap
        self.name = name
        self.watchdog_multiple = watchdog_multiple
        self.reattach_timeout = reattach_timeout
        self.keep_output = keep_output
        self.stats = StreamStats()
        self.exit_code: int | None = None
        self.ended = False
        self.process_state: str | None = None
        self.sandbox_state: str | None = None
        self.last_frame_at: float | None = None
        self.gaps: list[GapInfo] = []
        self._keepalive: float | None = None
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._decoders = {
            name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")
        }

    @property
    def stdout(self) -> str:
        """Everything received on stdout (and a PTY) so far, decoded."""
        return "".join(self._stdout)

    @property
    def stderr(self) -> str:
        """Everything received on stderr so far, decoded."""
        return "".join(self._stderr)

    @property
    def watchdog_bound(self) -> float:
        """Silence after which the stream is declared dead."""
        if self._keepalive is None:
            return _OPEN_TIMEOUT
        return self._keepalive * self.watchdog_multiple

    async def run(self) -> int | None:
        """Stream until the process's exit; returns its exit code."""
        backoff = _BACKOFF_START
        failing_since: float | None = None
        while not self.ended:
            frames_before = self.stats.frames
            try:
                await self._attach_once()
            except ConsumerKicked:
                self.stats.kicks += 1
            except _Silent:
                self.stats.watchdog_expiries += 1
            except (DaemonUnavailable, MalformedFrame):
                self.stats.disconnects += 1
            if self.ended:
                break
            now = time.monotonic()
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
        self._flush_decoders()
        return self.exit_code

    async def _attach_once(self) -> None:
        path = f"/sandboxes/{self.sandbox_id}/processes/{self.pid}/stream"
        async with contextlib.AsyncExitStack() as stack:
            opened = stack.enter_async_context(
                self.api.stream(path, cursor=self.cursor, name=self.name)
            )
            try:
                # Not asyncio.wait_for: before 3.12 it swallows a cancellation that arrives
                # as the awaited frame completes, so disconnect() could hang forever.
                # Bounded like any silence once the keepalive interval is known: a frozen
                # daemon's kernel still accepts the connection, and nobody answers.
                frames: AsyncIterator[Frame] = await within(opened, self.watchdog_bound)
            except TimeoutError:
                raise _Silent() from None
            self.stats.attaches += 1
            iterator = frames.__aiter__()
            while True:
                try:
                    frame = await within(iterator.__anext__(), self.watchdog_bound)
                except StopAsyncIteration:
                    raise DaemonUnavailable("stream closed before its end frame") from None
                except TimeoutError:
                    raise _Silent() from None
                if await self._handle(frame):
                    return

    async def _handle(self, frame: Frame) -> bool:
        self.last_frame_at = time.monotonic()
        self.stats.frames += 1
        meta = frame.meta
        kind = frame.kind
        if kind is FrameKind.DATA:
            seq = int(meta["seq"])
            if self.cursor is not None and seq < self.cursor:
                return False  # already delivered before a reattach
            self.cursor = seq + 1
            self.stats.bytes += len(frame.payload)
            await self._deliver(str(meta.get("stream", "stdout")), frame.payload)
        elif kind is FrameKind.START:
            self.cursor = int(meta["cursor"])
            self._keepalive = float(meta.get("keepalive_interval") or _OPEN_TIMEOUT)
            self._states(meta)
        elif kind is FrameKind.KEEPALIVE:
            self._states(meta)
        elif kind is FrameKind.GAP:
            await self._gap(
                GapInfo(int(meta["cursor"]), int(meta["first_available"]), int(meta["bytes_lost"]))
            )
        elif kind is FrameKind.END:
            code = meta.get("exit_code")
            self.exit_code = int(code) if code is not None else None
            self.cursor = int(meta.get("cursor", self.cursor or 0))
            self.process_state = "exited"
            self.ended = True
            return True
        elif kind is FrameKind.ERROR:
            raise frame.error()
        return False

    def _states(self, meta: dict[str, Any]) -> None:
        self.process_state = meta.get("process_state", self.process_state)
        self.sandbox_state = meta.get("sandbox_state", self.sandbox_state)

    async def _gap(self, gap: GapInfo) -> None:
        self.gaps.append(gap)
        self.stats.gaps += 1
        self.stats.bytes_lost += gap.bytes_lost
        self.cursor = gap.first_available
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

    async def _deliver(self, stream: str, data: bytes) -> None:
        target = "stderr" if stream == "stderr" else "stdout"
        text = self._decoders[target].decode(data)
        if text:
            await self._emit(target, text)

    async def _emit(self, target: str, text: str) -> None:
        if self.keep_output:
            (self._stderr if target == "stderr" else self._stdout).append(text)
        callback = self.on_stderr if target == "stderr" else self.on_stdout
        if callback is not None:
            await _call(callback, text)

    def _flush_decoders(self) -> None:
        for target, decoder in self._decoders.items():
            tail = decoder.decode(b"", final=True)
            if tail and self.keep_output:
                (self._stderr if target == "stderr" else self._stdout).append(tail)


async def _call(callback: Callable[..., Any], *args: Any) -> None:
    result = callback(*args)
    if inspect.isawaitable(result):
        await result
