"""The tap: the one SDK stream this client keeps open to an E2B process, writing what
arrives into the process's client-side log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from e2b import CommandExitException, NotFoundException

from sandboxkit.providers.e2b.log import ProcessLog
from sandboxkit.providers.e2b.target import signal_code

if TYPE_CHECKING:
    from sandboxkit.providers.e2b.session import E2BSession

__all__ = ["NO_REPLAY", "Tap"]

log = logging.getLogger("sandboxkit.providers.e2b")

_RECONNECT_DELAYS = (0.05, 0.2, 0.5, 1.0, 2.0)
"""Pacing of a tap's reopen attempts after its stream broke (then it gives up)."""

NO_REPLAY = "E2B replays nothing printed while its stream was cut"


class Tap:
    """Keeps an SDK stream open to one process and writes what arrives into its log;
    reopens it (behind an unknown-size gap) when it breaks, until the process ended."""

    def __init__(self, session: E2BSession, plog: ProcessLog) -> None:
        self.session = session
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

    async def open(self) -> Any:
        """A new SDK stream to the process (NotFoundException if E2B knows none)."""
        if self.log.pty:
            return await self.session.sdk.pty.connect(self.log.pid, on_data=self._pty, timeout=0)
        return await self.session.sdk.commands.connect(
            self.log.pid, timeout=0, on_stdout=self._out, on_stderr=self._err, retain_output=False
        )

    async def run(self, first: Any | None) -> None:
        handle = first
        delays = iter(_RECONNECT_DELAYS)
        try:
            while not self.log.ended:
                if handle is None:
                    if self.session.info.state == "paused":
                        await self.session.resumed.wait()
                    try:
                        handle = await self.open()
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
                    self.log.unknown_gap(NO_REPLAY)
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
        exit_code = signal_code(exit_code, error)
        if not self.log.ended:
            self.log.end(exit_code, error or None)
            self.session.journal.record(
                "process.exited", self.log.pid, data={"exit_code": exit_code}
            )

    def row(self) -> dict[str, Any]:
        return {
            "consumer_id": f"e2b-tap-{self.log.pid}",
            "name": f"tap {self.log.pid}",
            "role": "e2b tap",
            "sandbox_id": self.session.sandbox_id,
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
