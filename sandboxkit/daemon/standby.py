"""A sandbox's next launch, started ahead of its command.

Every launch pays a chain of execs before its command runs: the ``/bin/sh`` wrapper that
joins the sandbox's cgroups and sets its rlimits (:mod:`~sandboxkit.daemon.launch`), and
for an isolated sandbox bubblewrap, which makes five namespaces. And the join itself, a
write to ``cgroup.procs``, waits for an RCU grace period unless another migration
happened within the last one, which in a notebook (a command, a pause to read, the next)
it has not. Measured on the 2-core test machine, a root daemon's ``run(["true"])`` took
11 ms half a second after the previous command (an isolated sandbox's 19 ms), 3 ms back
to back: most of it before the command's first instruction. With a standby: 3.7 and
4.3 ms (``benchmarks/standby.py``, docs/performance.md).

So a sandbox keeps one launch started ahead (a *standby*): the same wrapper, the same
bubblewrap, the same environment and owner mark, ending in a ``/bin/sh`` that reads one
line from its stdin and evaluates it. A command that fits takes it: its line (a ``cd``
where its cwd is not the sandbox's home, an ``export`` per variable of its own, then
``exec`` of its argv, every word single-quoted) goes down the process's stdin pipe,
ahead of anything written to the command's stdin, and the shell execs the command in its
place: the same pid, the same pipes, already in the sandbox's cgroups and namespaces.
The next standby is started once the daemon has made no sandbox and launched nothing for
:data:`QUIET` seconds (its spawn in a thread, off the event loop): a burst of commands
goes the usual way, each no slower than without a standby, and the command after a pause
finds one.

What takes one: a command on pipes (not a pty), as the sandbox's default user, whose
variables have shell names, whose argv does not start with ``-`` (``exec`` would read it
as an option in some shells) and whose line is at most :data:`MAX_LINE` bytes (the shell
reads a line a byte at a time, so as not to read past it into the command's stdin); and
only where a launch has a wrapper at all: with no cgroup, limits or namespaces a launch
is one exec already. Everything else starts as before. A command the shell cannot exec
ends with 127 (126: not executable) and the shell's message on its stderr, as through
the wrapper.

What it costs: one sleeping process per sandbox (two with namespaces: bubblewrap's PID 1
and the shell; bubblewrap's monitor leaves the cgroup as any launch's does), in the
sandbox's cgroup and under its limits (0.2 MB of its own memory, 0.5 MB with
namespaces), and three pipes in the daemon. It is paused, killed and recovered as the
sandbox's other processes are: it is a launch of the freezer's, carrying its owner mark.

Who can reach its stdin: the pipe's other end is the daemon's. In namespaces the standby
is in a PID namespace of its own, out of every other process's sight, so the daemon alone
writes to it. Without isolation, a process running as the daemon's user could open it
through ``/proc`` and put a line in first, which then runs as the sandbox's next command:
nothing it could not do already (it can signal, ptrace and rewrite anything of that user's,
docs/isolation.md), and never the daemon's own code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import signal
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from subprocess import Popen
from typing import Any, Final, Protocol, TypeVar

from sandboxkit.daemon.freezer import MARK_VAR, Freezer
from sandboxkit.daemon.off_loop import off_loop
from sandboxkit.daemon.process_spec import Launch
from sandboxkit.daemon.spawn import Child, start

__all__ = ["MAX_LINE", "QUIET", "SCRIPT", "Quiet", "Standby", "StandbySlot", "exec_line"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_NL: Final = "_sandboxkit_nl"
"""The standby's variable holding a newline: a word's newlines are spelled ``"$_sandboxkit_nl"``
so that a whole command is one line."""

SCRIPT: Final = f"{_NL}='\n'; IFS= read -r _sandboxkit_line || exit 0; eval \"$_sandboxkit_line\""
"""What the standby's shell runs (``/bin/sh -c``): wait for one line, evaluate it. A
closed stdin (the sandbox is going) ends it quietly."""

MAX_LINE: Final = 4096
"""The longest line a standby is given (read a byte at a time: about a millisecond per
4 KiB); a longer command starts the usual way."""

QUIET: Final = 0.02
"""Seconds without a sandbox made or a launch in the daemon after which a sandbox's next
standby is started."""

_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_OWN: Final = frozenset({_NL, "_sandboxkit_line", MARK_VAR})
"""Names a command's variables may not set here: the standby's own, and its owner mark,
which a launch's environment always ends with (a request cannot claim another's)."""


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''").replace("\n", f"'\"${_NL}\"'") + "'"


def exec_line(argv: Sequence[str], envs: Mapping[str, str], cwd: str | None) -> bytes | None:
    """The line that turns a standby into ``argv``, with ``envs`` exported and in ``cwd``
    (``None``: where it started); ``None`` where no line says it (see the module's
    docstring), and the command starts the usual way."""
    if not argv or argv[0].startswith("-") or "\0" in "".join((*argv, *envs, *envs.values())):
        return None
    steps = [] if cwd is None else [f"cd -- {_quote(cwd)} || exit 126"]
    for key, value in envs.items():
        if not _NAME.match(key) or key in _OWN:
            return None
        steps.append(f"export {key}={_quote(value)}")
    steps.append("exec " + " ".join(_quote(word) for word in argv))
    try:
        line = ("; ".join(steps) + "\n").encode()
    except UnicodeEncodeError:  # a lone surrogate: the usual way reports it
        return None
    return line if len(line) <= MAX_LINE else None


@dataclass
class Standby:
    """A started launch waiting for its command: its process (pipes not yet on the loop)
    and the freezer's name for it, which the process that takes it keeps."""

    launch: str
    child: Child
    env: dict[str, str]
    """Its environment, to which the command's variables are added."""
    registered: asyncio.Future[None]
    """Done once the freezer holds it (:meth:`Freezer.add`, in a thread): a command that
    takes it is started meanwhile, as a launch's command is while its wrapper joins."""

    def alive(self) -> bool:
        """True while its process runs (checked when a command would take it)."""
        return self.child.poll() is None


class _Busy(Exception):
    """The daemon got busy before a standby's spawn began."""


class Slot(Protocol):
    """What waits for :class:`Quiet`: a sandbox's standby or launcher slot."""

    def _fill(self) -> asyncio.Future[Any] | None:
        """Start now; what is starting (``None``: nothing was to start)."""


class Quiet:
    """When the daemon last made a sandbox or started a launch, and the slots waiting for
    it to be quiet (:data:`QUIET` seconds of neither): one timer for all of them, so
    that a thousand waiting sandboxes cost a busy daemon nothing per sandbox."""

    def __init__(self) -> None:
        self._last = -QUIET
        self._waiting: dict[Slot, None] = {}  # in the order they came
        self._timer: asyncio.Handle | None = None

    def touch(self) -> None:
        """Something happened now."""
        self._last = time.monotonic()

    def left(self) -> float:
        """Seconds until the daemon has been quiet for :data:`QUIET` (0 when it has)."""
        return max(0.0, self._last + QUIET - time.monotonic())

    def wait(self, slot: Slot) -> None:
        """Fill ``slot`` once the daemon is quiet."""
        self._waiting[slot] = None
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.left(), self._check)

    def forget(self, slot: Slot) -> None:
        """``slot`` waits no more (it closed)."""
        self._waiting.pop(slot, None)

    def close(self) -> None:
        """Fill nothing more (the daemon is closing)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._waiting.clear()

    def _check(self) -> None:
        self._timer = None
        if not self._waiting:
            return
        if (left := self.left()) > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self._check)
            return
        # One at a time, the next once this one is started: a thousand at once held the
        # loop for a tenth of a second, then queued for the threads.
        slot = next(iter(self._waiting))
        del self._waiting[slot]
        filling = slot._fill()
        if filling is None:
            self._timer = asyncio.get_running_loop().call_soon(self._check)
        else:
            filling.add_done_callback(lambda _: self._again())

    def _again(self) -> None:
        if self._timer is None and self._waiting:
            self._timer = asyncio.get_running_loop().call_later(self.left(), self._check)


class StandbySlot:
    """One sandbox's standby: started :meth:`soon` after the sandbox is made and after
    each launch, taken by a command with :meth:`take`; :meth:`close` ends whatever is
    left."""

    def __init__(
        self,
        prepare: Callable[[str], Launch],
        freezer: Freezer,
        *,
        contained: bool,
        check_fds: Callable[[], None],
        quiet: Quiet | None = None,
    ) -> None:
        self._quiet = quiet or Quiet()
        self._prepare = prepare
        self._freezer = freezer
        self._contained = contained
        self._check_fds = check_fds
        self._next: asyncio.Task[Standby | None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reaping: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.env: dict[str, str] = {}
        """The environment of the last standby made (for the exec-size check)."""

    @property
    def ready(self) -> bool:
        """True while a standby is started and waiting for a command."""
        return self._next is not None and self._next.done()

    def soon(self) -> None:
        """Start the next standby once the daemon has made no sandbox and started no
        launch for :data:`QUIET` seconds: started while a launch runs (the one that took
        the last, or a sandbox's first command), it competed with it for the CPU, and
        its execs were on that command's way (``create()`` + first command +1.3 ms, a
        command back to back +0.2 ms on 2 cores); started while sandboxes are being made,
        it halved their rate. A notebook's next command comes well after."""
        self._quiet.touch()
        if self._next is None and not self._closed:
            self._quiet.wait(self)

    def _fill(self) -> asyncio.Task[Standby | None] | None:
        """Start the standby now (:class:`Quiet` calls it); the task that starts it."""
        if self._next is None and not self._closed:
            self._next = self._own(self._make())
            return self._next
        return None

    def take(self) -> Standby | None:
        """The standby, if one is started and alive; ``None`` otherwise (then the
        command starts the usual way). One still starting is not waited for: it may be
        queued behind others for the daemon's threads (a sandbox's standby is started
        once the daemon is quiet, all of them alike), and it stays for the next command.
        The next is started :meth:`soon`."""
        task = self._next
        if task is not None and task.done():
            self._next = None
        self.soon()
        if task is None or not task.done():
            return None
        if task.cancelled() or (exc := task.exception()) is not None:
            logger.debug("standby failed: %r", None if task.cancelled() else exc)
            return None
        standby = task.result()
        if standby is None:
            return None
        failed = standby.registered.done() and standby.registered.exception() is not None
        if standby.alive() and not failed:
            return standby
        self._discard(standby)
        return None

    def closing(self) -> None:
        """Start no standby any more (the sandbox is being killed: one started meanwhile
        would only be waited for, and compete with the daemon's next work)."""
        self._closed = True
        self._quiet.forget(self)

    async def close(self) -> None:
        """End the standby (after the sandbox's processes were killed) and every task of
        the slot's."""
        self.closing()
        task, self._next = self._next, None
        if task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                if (standby := await task) is not None:
                    self._discard(standby)
        tasks = list(self._tasks - self._reaping)
        for pending in tasks:
            pending.cancel()
        # The reaping is not cancelled: each waits for a process killed already.
        await asyncio.gather(*tasks, *self._reaping, return_exceptions=True)

    async def _make(self) -> Standby | None:
        """A standby, or ``None`` where the daemon got busy before its spawn began (then
        the slot waits for quiet again)."""
        self._check_fds()  # no standby out of the descriptors a request needs
        launch = secrets.token_hex(6)
        made: asyncio.Future[Standby] = asyncio.get_running_loop().create_future()
        self._own(self._launch(launch, self._prepare(launch), made))
        try:
            standby = await made
        except _Busy:
            self._next = None
            if not self._closed:
                self._quiet.wait(self)
            return None
        self.env = standby.env
        return standby

    async def _launch(self, launch: str, prepared: Launch, made: asyncio.Future[Standby]) -> None:
        """Spawn the standby (``made`` once spawned), have the freezer hold it (its
        ``registered``), then settle it as any isolated launch."""
        loop = asyncio.get_running_loop()
        with self._freezer.launching(launch):
            try:
                with contextlib.closing(prepared):
                    # In a thread: the spawn (vfork + exec) is off the loop, which is
                    # serving the command that took the last standby.
                    popen, pipes = await off_loop(self._spawn_when_quiet, prepared)
            except Exception as exc:  # told to whoever waits for it, no one else
                made.set_exception(exc)
                return
            registered = loop.create_future()
            standby = Standby(launch, Child(popen, pipes), prepared.env, registered)
            made.set_result(standby)
            failed: BaseException = RuntimeError("the sandbox's freezer is closed")
            try:
                await off_loop(self._freezer.add, popen.pid, launch, contained=self._contained)
                registered.set_result(None)
            except Exception as exc:
                failed = exc
            finally:
                if not registered.done():  # failed, or the slot closed meanwhile
                    registered.set_exception(failed)
                    registered.exception()  # retrieved: whoever took it is told
        if registered.exception() is not None:
            return  # nothing to settle
        if self._contained:
            await self._freezer.settle_soon(launch, standby.alive)

    def _spawn_when_quiet(self, prepared: Launch) -> tuple[Popen[bytes], Any]:
        """The spawn (in one of the daemon's threads), unless the daemon got busy while
        this waited for the thread: after many sandboxes were made, their standbys queue
        for the threads, and spawned while commands start they slowed every start."""
        if self._quiet.left() > 0:
            raise _Busy
        return start(prepared.argv, cwd=prepared.cwd, env=prepared.env, pass_fds=prepared.pass_fds)

    def _discard(self, standby: Standby) -> None:
        """Kill an untaken standby, all of it (bubblewrap's PID 1 and the shell too, not
        just the monitor), and reap it in the background."""
        if not self._freezer.closed:
            self._freezer.signal_launch(standby.launch, signal.SIGKILL)
        standby.child.close()
        reaping = self._own(off_loop(standby.child.wait))
        self._reaping.add(reaping)
        reaping.add_done_callback(self._reaping.discard)

    def _own(self, coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
