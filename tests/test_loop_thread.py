"""Tests for the background event-loop thread behind the sync facade."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from sandboxkit.client import loop_thread
from sandboxkit.client.loop_thread import LoopThread, shared_loop_thread

WAIT = 5.0  # upper bound for waiting on events; never used as synchronisation by itself


class Boom(Exception):
    pass


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    loop_thread = LoopThread(name="sandboxkit-loop-test")
    yield loop_thread
    loop_thread.close()


async def _block_forever(started: threading.Event, cancelled: threading.Event) -> None:
    started.set()
    try:
        await asyncio.get_running_loop().create_future()
    except asyncio.CancelledError:
        cancelled.set()
        raise


async def _loop_thread_of() -> threading.Thread:
    return threading.current_thread()


@pytest.mark.timeout(20)
def test_run_returns_value(lt: LoopThread) -> None:
    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a + b

    assert lt.run(add(2, 3)) == 5
    assert lt.run(add(1, 1), timeout=WAIT) == 2


@pytest.mark.timeout(20)
def test_run_executes_on_the_loop_thread(lt: LoopThread) -> None:
    thread = lt.run(_loop_thread_of())
    assert thread is not threading.current_thread()
    assert thread.daemon
    assert thread.name == "sandboxkit-loop-test"
    assert lt.loop.is_running()


@pytest.mark.timeout(20)
def test_run_propagates_exception_type(lt: LoopThread) -> None:
    async def fail() -> None:
        raise Boom("kaput")

    with pytest.raises(Boom, match="kaput"):
        lt.run(fail())
    # The loop survives a failing coroutine.
    assert lt.run(_loop_thread_of()).is_alive()


@pytest.mark.timeout(20)
@pytest.mark.asyncio
async def test_run_from_inside_a_running_loop(lt: LoopThread) -> None:
    # Exactly the Jupyter situation: a loop is running in this thread and sync code calls run().
    main_loop = asyncio.get_running_loop()

    async def which_loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    result = lt.run(which_loop())
    assert result is lt.loop
    assert result is not main_loop
    assert asyncio.get_running_loop() is main_loop


@pytest.mark.timeout(20)
def test_submit_returns_future(lt: LoopThread) -> None:
    async def value() -> str:
        return "ok"

    future = lt.submit(value())
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(WAIT) == "ok"


@pytest.mark.timeout(20)
def test_timeout_cancels_coroutine(lt: LoopThread) -> None:
    started, cancelled = threading.Event(), threading.Event()
    with pytest.raises(TimeoutError):
        lt.run(_block_forever(started, cancelled), timeout=0.05)
    assert started.is_set()
    assert cancelled.wait(WAIT)


@pytest.mark.timeout(20)
def test_keyboard_interrupt_cancels_coroutine(
    lt: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, cancelled = threading.Event(), threading.Event()

    def interrupted_wait(self: Any, timeout: Any = None) -> Any:
        assert started.wait(WAIT)
        raise KeyboardInterrupt

    # The wait run() blocks in (Ctrl-C lands there).
    monkeypatch.setattr(loop_thread._Call, "wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        lt.run(_block_forever(started, cancelled))
    monkeypatch.undo()
    assert cancelled.wait(WAIT)


@pytest.mark.timeout(20)
def test_run_from_loop_thread_raises(lt: LoopThread) -> None:
    async def inner() -> int:
        return 1

    async def outer() -> str:
        with pytest.raises(RuntimeError, match="deadlock") as info:
            lt.run(inner())
        return str(info.value)

    message = lt.run(outer(), timeout=WAIT)
    assert "loop's own thread" in message


@pytest.mark.timeout(20)
def test_close_cancels_pending_task_and_joins_thread() -> None:
    lt = LoopThread(name="sandboxkit-loop-close")
    thread = lt.run(_loop_thread_of())
    started, cancelled = threading.Event(), threading.Event()
    future = lt.submit(_block_forever(started, cancelled))
    assert started.wait(WAIT)

    lt.close()

    assert cancelled.is_set()
    assert future.cancelled()
    assert not thread.is_alive()
    assert lt.closed
    assert lt.loop.is_closed()


@pytest.mark.timeout(20)
def test_close_is_idempotent() -> None:
    lt = LoopThread()
    assert not lt.closed
    lt.close()
    lt.close()
    assert lt.closed


@pytest.mark.timeout(20)
def test_run_and_submit_after_close_raise() -> None:
    lt = LoopThread()
    lt.close()

    async def never_run() -> None:
        raise AssertionError("must not run")

    with pytest.raises(RuntimeError, match="closed"):
        lt.run(never_run())
    with pytest.raises(RuntimeError, match="closed"):
        lt.submit(never_run())


@pytest.mark.timeout(20)
def test_close_while_run_is_blocked_raises_runtime_error() -> None:
    lt = LoopThread()
    started, cancelled = threading.Event(), threading.Event()
    outcome: concurrent.futures.Future[BaseException | None] = concurrent.futures.Future()

    def caller() -> None:
        try:
            lt.run(_block_forever(started, cancelled))
        except BaseException as exc:
            outcome.set_result(exc)
        else:
            outcome.set_result(None)

    worker = threading.Thread(target=caller, daemon=True)
    worker.start()
    assert started.wait(WAIT)
    lt.close()
    exc = outcome.result(WAIT)
    assert isinstance(exc, RuntimeError)
    assert cancelled.is_set()
    worker.join(WAIT)


@pytest.mark.timeout(20)
def test_shared_loop_thread_singleton() -> None:
    first = shared_loop_thread()
    assert shared_loop_thread() is first
    assert not first.closed

    first.close()
    second = shared_loop_thread()
    assert second is not first
    assert not second.closed
    assert shared_loop_thread() is second
    assert second.run(_loop_thread_of()).is_alive()


@pytest.mark.timeout(20)
def test_shared_loop_thread_concurrent_creation() -> None:
    shared_loop_thread().close()
    barrier = threading.Barrier(8)

    def get() -> LoopThread:
        barrier.wait(WAIT)
        return shared_loop_thread()

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda _: get(), range(8)))
    assert all(r is results[0] for r in results)
