"""Shared plumbing of the notebook widgets: where their work runs, and how it stops.

A widget deals with two event loops:

* the **kernel loop**: the loop running in the calling thread when the widget is built
  (inside Jupyter, the kernel's own loop; ``None`` in a plain script or a sync test).
  Widget values are only ever set there (or, with no kernel loop, by explicit calls on the
  calling thread). Tasks the widget owns there (the flush ticker, scheduled actions) are
  *UI tasks*.
* the **sandbox loop**: the loop the client lives on. For a sync
  :class:`~sandboxkit.client.sync.Sandbox` (or no sandbox at all) that is the background
  :class:`~sandboxkit.client.loop_thread.LoopThread`; for an
  :class:`~sandboxkit.client.sandbox.AsyncSandbox` it is the kernel loop itself. Client
  calls, stream callbacks and the widget's *background tasks* (polls, stream watchers)
  run there; they only touch plain-Python state under a lock, never a widget.

:class:`Runtime` bundles both, with :meth:`Runtime.dispatch` (run an action on the
sandbox loop; block when there is no kernel loop, otherwise return an owned UI task),
:meth:`Runtime.ticker` (a periodic callback on the kernel loop) and an idempotent
:meth:`Runtime.close` / :meth:`Runtime.aclose` that cancel and release everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from sandboxkit._compat import within
from sandboxkit.client.loop_thread import LoopThread, shared_loop_thread
from sandboxkit.client.sandbox import AsyncSandbox
from sandboxkit.client.sync import Sandbox

__all__ = [
    "AnySandbox",
    "Runtime",
    "Ticker",
    "async_sandbox",
    "running_loop",
]

T = TypeVar("T")
R = TypeVar("R")

AnySandbox = Sandbox | AsyncSandbox
"""What a widget accepts: the sync facade or the async client."""

log = logging.getLogger("sandboxkit.notebook")

_CLOSE_TIMEOUT = 5.0

# Teardown tasks scheduled by a sync close() on a running kernel loop: strongly
# referenced until they finish, so none is garbage-collected half-way (F9).
_closing: set[asyncio.Task[Any]] = set()


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread (the kernel's, in Jupyter), or ``None``."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def async_sandbox(sbx: AnySandbox) -> AsyncSandbox:
    """The :class:`AsyncSandbox` behind ``sbx`` (itself, for an async one)."""
    return sbx.async_sandbox if isinstance(sbx, Sandbox) else sbx


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a task's exception as retrieved (it was reported through ``on_error``)."""
    if not task.cancelled():
        task.exception()


class Ticker:
    """Calls ``callback`` every ``period`` seconds on the kernel loop, as an owned task.

    So a callback that sets widget values runs at most ``1 / period`` times a second,
    always on the kernel's thread. Exceptions are logged, not fatal.
    """

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task

    @staticmethod
    async def run(callback: Callable[[], Any], period: float) -> None:
        """The ticker's loop (the body of :attr:`task`)."""
        while True:
            try:
                result = callback()
                if asyncio.iscoroutine(result):
                    await result
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("sandboxkit widget tick failed")
            await asyncio.sleep(period)

    def stop(self) -> None:
        """Cancel the ticker (it ends on the loop's next iteration)."""
        self.task.cancel()


class Runtime:
    """Where one widget's work runs (see the module docstring), and its teardown.

    ``sbx`` may be a sync :class:`Sandbox`, an :class:`AsyncSandbox` (which must live on
    the loop running in this thread) or ``None`` (client work then runs on the shared
    loop thread).
    """

    def __init__(self, sbx: AnySandbox | None = None) -> None:
        self.kernel_loop = running_loop()
        self._thread: LoopThread | None
        if isinstance(sbx, AsyncSandbox):
            if self.kernel_loop is None:
                raise RuntimeError(
                    "a widget given an AsyncSandbox must be created inside the event loop "
                    "that sandbox lives on (e.g. in a Jupyter cell); pass a sync Sandbox "
                    "to use it without a running loop"
                )
            self._thread = None
        elif isinstance(sbx, Sandbox):
            self._thread = sbx.loop_thread
        else:
            self._thread = shared_loop_thread()
        self.sandbox: AsyncSandbox | None = None if sbx is None else async_sandbox(sbx)
        self._ui: set[asyncio.Task[Any]] = set()
        self._background: set[asyncio.Task[Any]] = set()  # touched on the sandbox loop only
        self._teardown: asyncio.Task[None] | None = None
        self.closed = False

    # -- where things run ------------------------------------------------------------

    @property
    def live(self) -> bool:
        """True when a kernel loop runs: actions are tasks, a ticker flushes widgets."""
        return self.kernel_loop is not None

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the sandbox loop, from the kernel loop."""
        if self._thread is None or running_loop() is self._thread.loop:
            return await coro
        return await asyncio.wrap_future(self._thread.submit(coro))

    def call_blocking(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the sandbox loop and block for its result (no kernel loop)."""
        if self._thread is None:
            coro.close()
            raise RuntimeError("an AsyncSandbox's calls must be awaited on its own loop")
        return self._thread.run(coro, timeout=timeout)

    def dispatch(
        self,
        coro: Coroutine[Any, Any, T],
        then: Callable[[T], R],
        on_error: Callable[[BaseException], None] | None = None,
    ) -> R | asyncio.Task[R] | None:
        """Run the action ``coro`` on the sandbox loop, then ``then(result)`` on the
        calling (kernel) thread.

        With no kernel loop this blocks and returns ``then``'s value. With one, it returns
        an owned task at once (await it to wait; a button click just lets it run) — or
        ``None`` when called from a thread other than the kernel loop's, after handing
        the action over to that loop.
        ``on_error`` is called (on the kernel thread) with any exception before it
        propagates — out of this call, or out of the awaited task.
        """
        if self.closed:
            coro.close()
            raise RuntimeError("this widget is closed")
        if not self.live:
            try:
                result = self.call_blocking(coro)
            except BaseException as exc:
                if on_error is not None and isinstance(exc, Exception):
                    on_error(exc)
                raise
            return then(result)

        async def action() -> R:
            try:
                result = await self.call(coro)
            except Exception as exc:
                if on_error is not None:
                    on_error(exc)
                raise
            return then(result)

        loop = self.kernel_loop
        assert loop is not None
        if running_loop() is not loop:
            # Called from another thread (e.g. a frontend message handled off the loop):
            # hop onto the kernel loop; there is no task to hand back then.
            loop.call_soon_threadsafe(self._spawn_action, action())
            return None
        return self._spawn_action(action())

    def _spawn_action(self, coro: Coroutine[Any, Any, R]) -> asyncio.Task[R]:
        task = self.spawn_ui(coro, name="sandboxkit-widget-action")
        task.add_done_callback(_retrieve)
        return task

    def spawn_ui(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Start an owned task on the kernel loop (call from the kernel's thread)."""
        if self.kernel_loop is None or self.closed:
            coro.close()
            raise RuntimeError("no running kernel loop" if not self.closed else "closed")
        task = self.kernel_loop.create_task(coro, name=name)
        self._ui.add(task)
        task.add_done_callback(self._ui.discard)
        return task

    def ticker(self, callback: Callable[[], Any], hz: float) -> Ticker | None:
        """Call ``callback`` at most ``hz`` times a second on the kernel loop; ``None``
        when no kernel loop runs (then the owner flushes by explicit calls)."""
        if not self.live:
            return None
        period = 1.0 / hz if hz > 0 else 1.0
        return Ticker(self.spawn_ui(Ticker.run(callback, period), name="sandboxkit-ticker"))

    def spawn_background(
        self, coro: Coroutine[Any, Any, T], name: str | None = None
    ) -> asyncio.Task[T]:
        """Start an owned task on the sandbox loop; call this *on* the sandbox loop (from
        an action or another background task)."""
        if self.closed:
            coro.close()
            raise RuntimeError("this widget is closed")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def start_background(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> None:
        """Start an owned task on the sandbox loop from the kernel (or calling) thread."""
        if self._thread is None or running_loop() is self._thread.loop:
            self.spawn_background(coro, name)
            return

        async def spawn() -> None:
            self.spawn_background(coro, name)

        self._thread.run(spawn())

    @property
    def tasks(self) -> int:
        """Owned tasks not yet finished (UI and background); 0 after a completed close."""
        return sum(1 for t in self._ui if not t.done()) + sum(
            1 for t in list(self._background) if not t.done()
        )

    # -- teardown --------------------------------------------------------------------

    async def _stop_background(
        self, final: Coroutine[Any, Any, Any] | None, timeout: float
    ) -> None:
        """On the sandbox loop: cancel and await every background task, then ``final``."""
        deadline = time.monotonic() + timeout
        me = asyncio.current_task()
        tasks = [t for t in self._background if t is not me]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        if final is not None:
            try:
                await within(final, max(0.0, deadline - time.monotonic()))
            except Exception:
                log.exception("sandboxkit widget teardown failed")

    def close(
        self, final: Coroutine[Any, Any, Any] | None = None, timeout: float = _CLOSE_TIMEOUT
    ) -> None:
        """Cancel every owned task and run ``final`` (e.g. disconnect a stream) on the
        sandbox loop. Idempotent.

        With a loop thread this blocks (bounded by ``timeout``) until all of it is done.
        With an AsyncSandbox on a running kernel loop it cannot block that loop: the
        teardown becomes a strongly referenced task; :meth:`aclose` awaits it.
        """
        if self.closed:
            if final is not None:
                final.close()
            return
        self.closed = True
        for task in list(self._ui):
            task.cancel()
        if self._thread is not None:
            if running_loop() is self._thread.loop:  # pragma: no cover - defensive
                self._teardown = asyncio.get_running_loop().create_task(
                    self._stop_background(final, timeout)
                )
                _closing.add(self._teardown)
                self._teardown.add_done_callback(_closing.discard)
                return
            try:
                self._thread.run(self._stop_background(final, timeout), timeout=timeout + 1.0)
            except (RuntimeError, TimeoutError):  # loop thread closed or wedged
                log.warning("sandboxkit widget teardown did not finish", exc_info=True)
            return
        loop = self.kernel_loop
        assert loop is not None
        if loop.is_closed():
            if final is not None:
                final.close()
            return
        self._teardown = loop.create_task(self._stop_background(final, timeout))
        _closing.add(self._teardown)
        self._teardown.add_done_callback(_closing.discard)

    async def aclose(
        self, final: Coroutine[Any, Any, Any] | None = None, timeout: float = _CLOSE_TIMEOUT
    ) -> None:
        """:meth:`close`, then wait until every owned task and the teardown finished."""
        ui = [t for t in self._ui if t is not asyncio.current_task()]
        if self._thread is not None and not self.closed:
            # Do not block the running loop on the loop thread: await the teardown.
            self.closed = True
            for task in ui:
                task.cancel()
            with contextlib.suppress(RuntimeError):  # the loop thread is already closed
                await asyncio.wrap_future(
                    self._thread.submit(self._stop_background(final, timeout))
                )
        else:
            self.close(final, timeout)
        if ui:
            await asyncio.wait(ui, timeout=timeout)
        if self._teardown is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._teardown), timeout)
