"""Spawn a process with CPython's ``subprocess`` and join it to the running event loop:
its pipes become loop transports, its exit is seen through a pidfd.

Why not ``loop.subprocess_exec``: on uvloop (the daemon's loop when it is installed)
libuv *forks* the daemon, and a fork copies the page tables of everything the daemon
holds, so a spawn costs more the more memory the daemon has — a spawn + wait of ``true``
took 2.5, 4.6 and 9.0 ms from a process of 0, 100 and 400 MiB. CPython's ``subprocess``
uses ``vfork`` (the child borrows the parent's memory until it execs): 1.2 ms at every
size (docs/performance.md, "Where a command's time goes"). The same code runs on either
loop, so both behave alike.

Why a pidfd: asyncio's own child watcher (3.11) keeps a thread per running child, and
libuv reaps from a ``SIGCHLD`` handler. A pidfd (Linux 5.3) is one descriptor that turns
readable when the child exits, watched like a socket; the child is then reaped with
``waitpid`` on its pid alone, so nothing of anyone else's is ever reaped. Where the kernel
or a seccomp profile refuses ``pidfd_open``, a thread per child waits instead, as
asyncio's watcher does.

Why the pipes are made here rather than by ``Popen``: a loop's pipe transport must be
the one thing that closes each descriptor. asyncio's closes its file object; uvloop's
closes the descriptor itself and *then* the file object it was given, which closed the
same number again (``close`` → ``EBADF``, seen with strace on every spawn). Between the
two, another of the daemon's threads may have opened a file under that number, and the
second close would have taken it. :func:`loop_file` gives each loop the file object it
needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from sandboxkit.daemon.freezer.proc import ProcStat
from sandboxkit.daemon.process_io import Output, Owner, StdinFlow

__all__ = ["Child", "Pipes", "Process", "loop_file", "spawn", "start"]

_PIPE_SIZE = 1024 * 1024
"""Pipe buffers asked for: a chatty process then blocks, and the daemon wakes, a
sixteenth as often as with the default 64 KiB (best effort: capped by the system)."""


class Process(Protocol):
    """What a :class:`Child` needs of its process: a ``subprocess.Popen``, or a command
    a sandbox's launcher started (:class:`~sandboxkit.daemon.launcher.Remote`)."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...

    def kill(self) -> None: ...


class Child:
    """A spawned process: its pid, its exit code once reaped, and its pipes on the loop.

    ``exited`` resolves when the process has been reaped; ``pipes_closed`` when its
    stdout and stderr reached their end (a grandchild may hold them open after the
    process itself exited). ``stdin`` is its stdin pipe's transport (``None`` on a pty:
    the caller owns the terminal). ``watch``: how its exit is seen where it is not the
    daemon's child (called with the callback), instead of a pidfd and ``waitpid``.
    ``born``: what ``/proc`` said of it at its start, where the spawner read that (a
    sandbox's launcher, which forks it inside the sandbox)."""

    def __init__(
        self,
        popen: Process,
        pipes: Pipes | None,
        *,
        watch: Callable[[Callable[[], None]], None] | None = None,
        born: ProcStat | None = None,
    ) -> None:
        self._popen = popen
        self.born = born
        self._pipes = pipes
        self._watch = watch
        self._loop = asyncio.get_running_loop()
        self.pid = popen.pid
        self.exited: asyncio.Future[None] = self._loop.create_future()
        self.pipes_closed: asyncio.Future[None] = self._loop.create_future()
        self.stdin: asyncio.WriteTransport | None = None
        self._outputs: list[asyncio.BaseTransport] = []
        self._open_outputs = 0
        self._pidfd: int | None = None

    @property
    def returncode(self) -> int | None:
        """The exit code once reaped: minus the signal for a process a signal ended."""
        return self._popen.returncode

    async def join(self, owner: Owner | None) -> None:
        """Put its pipes on the loop, its output going to ``owner`` (which a child
        without pipes needs not), and watch for its exit. If that fails, the process is
        killed (and reaped in the background)."""
        try:
            await self._join(owner)
        except BaseException:
            self.close()
            if self._pidfd is None and self.returncode is None:
                self._watch_exit()  # reaped in the background once the kill lands
            raise

    async def _join(self, owner: Owner | None) -> None:
        pipes = self._pipes
        if pipes is None:
            self.pipes_closed.set_result(None)
            self._watch_exit()
            return
        assert owner is not None, "a child on pipes needs an owner for its output"
        # Each descriptor handed to the loop is its transport's to close from then on,
        # even if the connect fails (both loops close what they took); what was not
        # handed over yet, :meth:`close` closes.
        for name in ("stdout", "stderr"):
            self._open_outputs += 1
            transport, _ = await self._loop.connect_read_pipe(
                lambda name=name: Output(owner, name, self._output_closed),  # type: ignore[misc]
                loop_file(pipes.ours.pop(name), "rb"),
            )
            self._outputs.append(transport)
        stdin, _ = await self._loop.connect_write_pipe(
            lambda: StdinFlow(owner), loop_file(pipes.ours.pop("stdin"), "wb")
        )
        self.stdin = stdin
        self._watch_exit()

    def poll(self) -> int | None:
        """Its exit code if it has exited (reaping it), else ``None``: for a child whose
        exit is not watched yet (not joined)."""
        return self._popen.poll()

    def wait(self) -> int:
        """Block until it exits and reap it: for a child never joined (in a thread)."""
        return self._popen.wait()

    def _output_closed(self) -> None:
        self._open_outputs -= 1
        if self._open_outputs == 0 and not self.pipes_closed.done():
            self.pipes_closed.set_result(None)

    def _watch_exit(self) -> None:
        if self._watch is not None:
            self._watch(self._reap)
            return
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            # No pidfd here (an old kernel, a seccomp profile that refuses it): a thread
            # that waits for this child alone.
            threading.Thread(target=self._wait_in_thread, name=f"wait-{self.pid}").start()
            return
        self._loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        if self._popen.poll() is None:
            return  # not yet (a pidfd is readable only once the child exited)
        self._stop_watching()
        if not self.exited.done():
            self.exited.set_result(None)

    def _wait_in_thread(self) -> None:
        self._popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._reap)

    def _stop_watching(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def close(self) -> None:
        """Close its pipes; a process still running is killed (SIGKILL, the leader only)
        and reaped when it exits, as asyncio's subprocess transport does."""
        for transport in self._outputs:
            transport.close()
        if self.stdin is not None:
            self.stdin.close()
        if self._pipes is not None:
            self._pipes.close()  # what no transport took (a join that failed part-way)
        if self._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._popen.kill()


async def spawn(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    owner: Owner,
    terminal: int | None = None,
    pass_fds: Sequence[int] = (),
) -> Child:
    """Start ``argv`` in a session of its own, its output going to ``owner``: on pipes,
    or on the pty slave ``terminal`` (then the caller reads the master). ``OSError`` if
    it cannot be executed (nothing is left running then)."""
    # On the loop, as asyncio's subprocess_exec does: vfork + exec takes well under a
    # millisecond, and the parent is suspended until the child execs anyway.
    child = Child(*start(argv, cwd=cwd, env=env, terminal=terminal, pass_fds=pass_fds))
    await child.join(owner)
    return child


def start(
    argv: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    terminal: int | None = None,
    pass_fds: Sequence[int] = (),
) -> tuple[subprocess.Popen[bytes], Pipes | None]:
    """:func:`spawn`'s first half, which any thread may run: the process, started in a
    session of its own, and its pipes (``None`` on a ``terminal``), not yet on a loop
    (make a :class:`Child` of both on the loop, then :meth:`Child.join` its owner)."""
    pipes = Pipes() if terminal is None else None
    theirs: dict[str, Any] = pipes.theirs if pipes is not None else dict.fromkeys(_NAMES, terminal)
    try:
        popen = subprocess.Popen(
            argv,
            stdin=theirs["stdin"],
            stdout=theirs["stdout"],
            stderr=theirs["stderr"],
            cwd=cwd,
            env=env,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    except BaseException:
        if pipes is not None:
            pipes.close()
        raise
    finally:
        if pipes is not None:
            pipes.close_theirs()  # the child has its copies (or never will)
    return popen, pipes


_NAMES = ("stdin", "stdout", "stderr")


class Pipes:
    """A child's three pipes: the ends it gets (``theirs``, closed here once it has
    them) and the ends the daemon keeps (``ours``, until a transport takes each)."""

    def __init__(self) -> None:
        self.theirs: dict[str, int] = {}
        self.ours: dict[str, int] = {}
        try:
            for name in _NAMES:
                read, write = os.pipe2(os.O_CLOEXEC)
                child_end, our_end = (read, write) if name == "stdin" else (write, read)
                self.theirs[name], self.ours[name] = child_end, our_end
                if name != "stdin":
                    _widen(our_end)
        except BaseException:
            self.close()
            raise

    def close_theirs(self) -> None:
        for fd in self.theirs.values():
            os.close(fd)
        self.theirs.clear()

    def close(self) -> None:
        self.close_theirs()
        for fd in self.ours.values():
            os.close(fd)
        self.ours.clear()


def loop_file(fd: int, mode: str) -> io.FileIO:
    """``fd`` as the file object the running loop's pipe transports take, so that the
    descriptor is closed exactly once, by the transport: asyncio's transports close the
    file object; uvloop's close the descriptor and then the file object, which must then
    not close it again (see the module's docstring)."""
    loop = asyncio.get_running_loop()
    return io.FileIO(fd, mode, closefd=isinstance(loop, asyncio.BaseEventLoop))


def _widen(fd: int) -> None:
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, set_size, _PIPE_SIZE)
