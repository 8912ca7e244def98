"""Readers of an E2B process's client-side log: what a handle or a panel follows."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sandboxkit.client.options import FollowOptions
from sandboxkit.client.output import Cursor
from sandboxkit.client.results import CommandResult
from sandboxkit.client.stream import GapInfo, StreamStats, UnknownGap
from sandboxkit.errors import OutputGap, OutputIncomplete
from sandboxkit.providers.e2b.log import ProcessLog
from sandboxkit.vocab import DEFAULT_ROLE

if TYPE_CHECKING:
    from sandboxkit.providers.e2b.session import E2BSession

__all__ = ["Reader"]


class Reader:
    """One follower of a :class:`ProcessLog` from a cursor: the
    :class:`~sandboxkit.client.backend.OutputReader` an E2B handle runs."""

    _ids = itertools.count(1)

    def __init__(
        self,
        session: E2BSession,
        plog: ProcessLog,
        cursor: int | None,
        options: FollowOptions,
    ) -> None:
        self.session = session
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
        # Continued from a cursor another handle gave: the line it had begun continues
        # here, whole. (No character is split: the e2b SDK hands over text.)
        given = cursor if isinstance(cursor, Cursor) else Cursor(0)
        self._partial = {"stdout": given.stdout_line, "stderr": given.stderr_line}
        self.bytes_dropped = 0
        self.end_reason: str | None = None
        """E2B says only the exit code, not what ended a process."""
        self.stats = StreamStats()
        self.unknown_gaps = 0
        """Gaps of unknown size delivered (``stats.gaps`` counts every gap)."""
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
    def cursor(self) -> Cursor:
        """Where this reader is: the byte after the last it delivered, carrying the line
        it began there (see :class:`~sandboxkit.client.output.Cursor`), as the daemon's
        streams do: a handle continued from it delivers that line once, whole."""
        return Cursor(
            self._cursor,
            stdout_line=self._partial["stdout"],
            stderr_line=self._partial["stderr"],
        )

    @property
    def ended(self) -> bool:
        return self.log.ended and self._cursor >= self.log.head

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
        return self.session.info.state

    async def flush_lines(self) -> None:
        for stream, text in list(self._partial.items()):
            if text:
                self._partial[stream] = ""
                await self._emit_text(stream, text)

    # -- following ---------------------------------------------------------------------

    async def run(self) -> int | None:
        """Deliver the log from the cursor until the process ended and all was read."""
        self.session.journal.record("consumer.attached", self.pid, data={"role": self.role})
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
            self.session.journal.record(
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
        self.stats.gaps += 1
        if gap.bytes_lost is None:
            self.unknown_gaps += 1
        else:
            self.stats.bytes_lost += gap.bytes_lost
        self.session.journal.record(
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

    def incomplete_error(self, result: CommandResult) -> OutputIncomplete | None:
        """A foreground result is complete or the run raises OutputIncomplete — also when
        output went missing in an amount E2B cannot tell (``bytes_lost`` is then
        ``None``)."""
        took_gaps = self.on_gap is not None
        unknown = 0 if took_gaps else self.unknown_gaps
        lost = self.bytes_dropped + (0 if took_gaps else self.stats.bytes_lost)
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

    def row(self) -> dict[str, Any]:
        closed = self.closed_at is not None
        return {
            "consumer_id": self.consumer_id,
            "name": self.consumer_id,
            "role": self.role,
            "sandbox_id": self.session.sandbox_id,
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
