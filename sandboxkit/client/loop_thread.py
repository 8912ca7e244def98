"""A private asyncio event loop in a daemon thread, used by the sync facade.

The sync :class:`~sandboxkit.client.Sandbox` must work where an event loop is already
running in the calling thread (a Jupyter kernel), so it can neither ``asyncio.run`` nor
nest loops. Instead it hands each coroutine to one loop running in a background thread
and blocks on a :class:`concurrent.futures.Future` for the result.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "shared_loop_thread"]

T = TypeVar("T")

_STARTUP_TIMEOUT = 10.0


class LoopThread:
    """An asyncio event loop running in a daemon thread, for the sync facade."""

    def __init__(self, name: str = "sandboxkit-loop") -> None:
        """Create the loop, start its thread and wait until the loop is running."""
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._closed = False
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run_forever, args=(started,), name=name, daemon=True
        )
        self._thread.start()
        if not started.wait(_STARTUP_TIMEOUT):  # pragma: no cover - defensive
            self._closed = True
            raise RuntimeError(f"event loop thread {name!r} did not start")

    def _run_forever(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(started.set)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop owned by the background thread."""
        return self._loop

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def _in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop without blocking; return its future.

        Raises :class:`RuntimeError` if the loop thread is closed.
        """
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError("LoopThread is closed; cannot submit a coroutine")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block until it finishes; return its result.

        Exceptions raised by ``coro`` propagate unchanged. If ``timeout`` seconds pass
        the coroutine is cancelled and :class:`TimeoutError` is raised; a
        :class:`KeyboardInterrupt` while waiting also cancels it. :class:`RuntimeError` is
        raised if the loop thread is (or gets) closed, or if this is called from the loop
        thread itself, since that would deadlock.
        """
        if self._in_loop_thread():
            coro.close()
            raise RuntimeError(
                "LoopThread.run() was called from the loop's own thread, which would "
                "deadlock; await the coroutine instead (or use submit())"
            )
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            # On 3.10 this is not the builtin TimeoutError; always raise the builtin.
            future.cancel()
            raise TimeoutError(f"coroutine did not finish within {timeout} s") from None
        except concurrent.futures.CancelledError:
            if self._closed:
                raise RuntimeError(
                    "LoopThread was closed while the coroutine was running"
                ) from None
            raise
        except KeyboardInterrupt:
            future.cancel()
            raise

    def close(self, timeout: float = 5.0) -> None:
        """Cancel pending tasks, stop the loop, join the thread and close the loop.

        Idempotent. Each step is bounded so that the whole call takes at most about
        ``timeout`` seconds; if the thread cannot be joined the loop is left unclosed.
        After this, :meth:`run` and :meth:`submit` raise :class:`RuntimeError`.
        """
        if self._in_loop_thread():
            raise RuntimeError("LoopThread.close() cannot be called from the loop's own thread")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout

        def remaining() -> float:
            return max(0.0, deadline - time.monotonic())

        if self._loop.is_running():
            shutdown = asyncio.run_coroutine_threadsafe(self._shutdown(remaining()), self._loop)
            try:
                shutdown.result(remaining())
            except Exception:  # timed out, or the shutdown itself failed: stop anyway
                shutdown.cancel()
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(remaining())
        if not self._thread.is_alive():
            self._loop.close()

    async def _shutdown(self, timeout: float) -> None:
        """Cancel every other task, wait for them (bounded), then finalise async gens."""
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        await self._loop.shutdown_asyncgens()


_shared: LoopThread | None = None
_shared_lock = threading.Lock()


def shared_loop_thread() -> LoopThread:
    """Return the process-wide loop thread, creating (or re-creating) it if needed.

    It is closed automatically at interpreter exit.
    """
    global _shared
    with _shared_lock:
        if _shared is None or _shared.closed:
            _shared = LoopThread()
        return _shared


@atexit.register
def _close_shared_loop_thread() -> None:
    with _shared_lock:
        shared = _shared
    if shared is not None:
        shared.close()
