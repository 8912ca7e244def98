"""sandboxkit.daemon.spawn: a child started with CPython's subprocess and joined to the
running loop (asyncio's and uvloop's alike) — its output, its exit code, what holds its
pipes after it exits, and whom it reaps (its own child, never anyone else's)."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from support import fast_config

from sandboxkit import Sandbox
from sandboxkit.daemon import spawn as spawn_module
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.daemon.spawn import Child, spawn

T = TypeVar("T")
WAIT = 10.0  # an upper bound on each wait; never the synchronisation itself


def _loops() -> list[Any]:
    loops: list[Any] = [pytest.param(asyncio.run, id="asyncio")]
    try:
        import uvloop
    except ImportError:
        return loops
    return [*loops, pytest.param(uvloop.run, id="uvloop")]


class Owner:
    def __init__(self) -> None:
        self.stdin_drained = asyncio.Event()
        self.stdin_drained.set()
        self.output: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}

    def capture(self, stream: str, data: bytes) -> None:
        self.output[stream] += data


async def _run(argv: list[str], stdin: bytes = b"") -> tuple[Child, Owner]:
    owner = Owner()
    child = await spawn(argv, cwd="/", env={"PATH": os.environ["PATH"]}, owner=owner)
    if stdin:
        assert child.stdin is not None
        child.stdin.write(stdin)
        child.stdin.close()
    await asyncio.wait_for(child.exited, WAIT)
    await asyncio.wait_for(child.pipes_closed, WAIT)
    child.close()
    return child, owner


@pytest.fixture(params=_loops())
def run_loop(request: pytest.FixtureRequest) -> Callable[[Awaitable[T]], T]:
    return request.param  # type: ignore[no-any-return]


def test_output_and_exit_code(run_loop: Any) -> None:
    child, owner = run_loop(_run(["sh", "-c", "cat; echo oops >&2; exit 3"], stdin=b"hello\n"))
    assert child.returncode == 3
    assert bytes(owner.output["stdout"]) == b"hello\n"
    assert bytes(owner.output["stderr"]) == b"oops\n"


def test_a_signal_is_minus_its_number(run_loop: Any) -> None:
    child, _ = run_loop(_run(["sh", "-c", "kill -TERM $$"]))
    assert child.returncode == -15


def test_a_grandchild_holds_the_pipes_after_the_exit(run_loop: Any) -> None:
    async def scenario() -> tuple[bool, bytes]:
        owner = Owner()
        child = await spawn(
            # (fd 3: a background job's own stdin is /dev/null in a non-interactive sh)
            ["sh", "-c", "exec 3<&0; (read line <&3; echo late) & exit 0"],
            cwd="/",
            env={"PATH": os.environ["PATH"]},
            owner=owner,
        )
        await asyncio.wait_for(child.exited, WAIT)
        # The leader is gone; its background child still has stdout open.
        held = not child.pipes_closed.done()
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        await asyncio.wait_for(child.pipes_closed, WAIT)
        child.close()
        return held, bytes(owner.output["stdout"])

    held, out = run_loop(scenario())
    assert held
    assert out == b"late\n"


def test_reaps_its_own_child_only(run_loop: Any) -> None:
    """Someone else's child of this process keeps its exit status for its own waiter
    (a reaper that took any child would leave it 0, from ECHILD)."""

    other = subprocess.Popen(["sh", "-c", "exit 7"])
    child, _ = run_loop(_run(["sh", "-c", "exit 5"]))
    assert (child.returncode, other.wait(WAIT)) == (5, 7)


def test_without_a_pidfd_a_thread_waits(run_loop: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open is not available")

    monkeypatch.setattr(spawn_module.os, "pidfd_open", refused)
    child, owner = run_loop(_run(["sh", "-c", "echo done; exit 4"]))
    assert child.returncode == 4
    assert bytes(owner.output["stdout"]) == b"done\n"


def test_cannot_execute_raises_and_leaves_nothing(run_loop: Any) -> None:
    async def scenario() -> None:
        await spawn(["/nonexistent/program"], cwd="/", env={}, owner=Owner())

    before = _children()
    with pytest.raises(FileNotFoundError):
        run_loop(scenario())
    assert _children() == before  # no child is left, not even a zombie


def _children() -> set[str]:
    """This process's children (of every thread), zombies included."""
    found: set[str] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            found.update(f.read().split())
    return found


def test_close_kills_a_running_child_and_reaps_it(run_loop: Any) -> None:
    async def scenario() -> int | None:
        child = await spawn(["sleep", "60"], cwd="/", env=dict(os.environ), owner=Owner())
        child.close()
        await asyncio.wait_for(child.exited, WAIT)
        return child.returncode

    assert run_loop(scenario()) == -9


@pytest.mark.parametrize("event_loop", [p.id for p in _loops()])
def test_a_process_writes_to_pipes_on_either_loop(event_loop: str) -> None:
    """Its stdout and stderr are pipes, as with envd (Go's ``exec``): reopening
    ``/dev/stdout`` works. (uvloop's spawn gave it sockets, where that open fails with
    "No such device or address".)"""
    server = DaemonServer(fast_config(event_loop=event_loop)).start()
    try:
        with Sandbox.create(url=server.url, token=server.token) as sbx:
            result = sbx.commands.run(
                "echo out > /dev/stdout; echo err > /dev/stderr; stat -L -c %F /dev/stdout"
            )
        assert (result.stdout, result.stderr) == ("out\nfifo\n", "err\n")
    finally:
        server.stop()


class _TakesTheNumberFirst:
    """A pipe's file object that, when the loop closes it, first opens another file. That
    gets the lowest free number: the pipe's own, if its descriptor was closed already (as
    uvloop's transports do before they close the file object)."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.other: int | None = None
        self.closed = asyncio.Event()

    def fileno(self) -> int:
        return int(self._file.fileno())

    def close(self) -> None:
        self.other = os.open("/dev/null", os.O_RDONLY)
        self._file.close()
        self.closed.set()


def test_each_pipe_is_closed_once(run_loop: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's transport is the one thing that closes a child's pipe. uvloop's closes
    the descriptor, then the file object it was given, which closed the number again: by
    then another thread of the daemon may have opened a file under it."""
    handed: list[_TakesTheNumberFirst] = []
    real = spawn_module.loop_file

    def watched(fd: int, mode: str) -> Any:
        handed.append(_TakesTheNumberFirst(real(fd, mode)))
        return handed[-1]

    monkeypatch.setattr(spawn_module, "loop_file", watched)

    async def scenario() -> None:
        child, _ = await _run(["sh", "-c", "cat"], stdin=b"x")
        await asyncio.wait_for(asyncio.gather(*(f.closed.wait() for f in handed)), WAIT)
        del child

    run_loop(scenario())
    null = os.stat("/dev/null")
    kept = []
    for file in handed:
        assert file.other is not None
        try:
            kept.append(os.path.samestat(os.fstat(file.other), null))
            os.close(file.other)
        except OSError:
            kept.append(False)
    assert kept == [True, True, True]
