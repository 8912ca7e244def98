"""A sandbox's launcher: one small process inside the sandbox that forks its commands.

A command started the usual way pays a chain of execs before its first instruction: the
``/bin/sh`` wrapper that joins the sandbox's cgroups and sets its rlimits
(:mod:`~sandboxkit.daemon.launch`), and in namespaces bubblewrap, which makes five of them
(about 0.75 ms and 3 ms on the 2-core test machine). The cgroup join itself waits for an
RCU grace period when no migration happened lately. The standby
(:mod:`~sandboxkit.daemon.standby`) hides all of it from a command that comes after a
pause, but not from commands back to back, and each standby serves one command.

The launcher (``launcher.c`` beside this module, compiled at install by ``hatch_build.py``)
is started once, the usual way, so it sits in the sandbox's cgroups, under its rlimits,
in its namespaces. Then a command is one message on a socket pair: its argv, environment
and working directory, with its three pipes passed as descriptors (``SCM_RIGHTS``). The
launcher forks (a small process: a fork costs little), the child execs the command, and
the launcher answers with the command's pidfd; when the command ends, with its wait
status. The command is born inside everything its sandbox is: no exec, migration or
namespace is on its way. It is the launcher's child, not the daemon's: the daemon sees it
end through its pidfd, learns its code from the launcher (or reads it off its zombie when
the launcher does not say: :class:`Remote`), and signals it through the pidfd.

What takes it: a command on pipes (not a pty), as the sandbox's default user, whose
request is at most :data:`MAX_REQUEST` bytes; and only while the sandbox runs (a paused
sandbox's launcher is frozen with it). Everything else starts the usual way.

When it starts, and until when: :mod:`~sandboxkit.daemon.launcher_slot`.

What the daemon believes of it: nothing beyond its own sandbox. The launcher runs the
sandbox's code's account, in its namespaces, so the sandbox's code can ptrace it and make
it say anything. So every reply is checked: a fixed size, a known request, a descriptor
that is a pidfd (a FIFO or a socket would be closed), the pid read from the pidfd itself
(``/proc/self/fdinfo``), not from the message. In namespaces the only pidfds it can make
are of the sandbox's own processes. A lie about a command's exit is a lie about its own
sandbox; a launcher that breaks the protocol, or does not answer, is dropped, and the
sandbox's next command starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import logging
import os
import select
import signal
import socket
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from sandboxkit.daemon.freezer.proc import ProcStat, exit_status, pidfd_pid, read_stat
from sandboxkit.daemon.process_io import Owner
from sandboxkit.daemon.spawn import Child, Pipes
from sandboxkit.errors import ResourceExhausted

__all__ = [
    "ANSWER_WITHIN",
    "MAX_REQUEST",
    "PROGRAM",
    "Launcher",
    "LauncherGone",
    "program_fd",
]

logger = logging.getLogger(__name__)

PROGRAM: Final = Path(__file__).with_name("sandboxkit-launcher")
"""The compiled launcher (absent where no C compiler built it at install)."""

VERSION: Final = 1
"""The protocol's version, which the launcher says first (``launcher.c``): a program left
over from an older install is not used."""

MAX_REQUEST: Final = 256 * 1024
"""The longest request a launcher takes (its buffer); a longer command starts the usual
way."""

_HEAD: Final = struct.Struct("=4I")
_MFD_EXEC: Final = 0x0010  # memfd_create's MFD_EXEC (Linux 6.3); refused as EINVAL before
_READS_PER_WAKE: Final = 64
_TICK: Final = 0.5

REPORT_WITHIN: Final = 0.5
"""Seconds a launcher has to say that a command ended once it did (it says so at once)
before the daemon reads the command's code off its zombie itself."""

ANSWER_WITHIN: Final = 5.0
"""Seconds a launcher has to answer a request, not counting while its sandbox is paused
(it answers in well under a millisecond)."""


class LauncherGone(Exception):
    """The launcher died or broke its protocol before it answered: start anew."""


@functools.cache
def program_fd() -> int | None:
    """The launcher's program, copied into a sealed memfd that launches exec as
    ``/proc/self/fd/N``: nothing of it is on a filesystem a sandbox could write to or
    that could be mounted ``noexec``, and an isolated sandbox sees no path of the
    daemon's. ``None`` where it was not built (or the kernel refuses)."""
    try:
        data = PROGRAM.read_bytes()
    except OSError:
        return None
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        try:
            fd = os.memfd_create("sandboxkit-launcher", flags | _MFD_EXEC)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            fd = os.memfd_create("sandboxkit-launcher", flags)
    except (AttributeError, OSError):
        return None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except OSError:
        os.close(fd)
        return None
    return fd


class Remote:
    """A command the launcher started, as :class:`~sandboxkit.daemon.spawn.Child` sees a
    process: its pid (in the daemon's namespace), its exit code, and a kill through its
    pidfd.

    Its end is seen through its pidfd (readable once it ended, while the launcher has not
    reaped it yet); its code is what the launcher says ('X'), or, if the launcher says
    nothing within :data:`REPORT_WITHIN` (stopped, or gone, by the sandbox's own code),
    its wait status read off the zombie (``/proc/<pid>/stat``), else -1 (unknown)."""

    def __init__(self, stat: ProcStat, pidfd: int) -> None:
        self.pid = stat.pid
        self.stat = stat
        """What ``/proc`` said of it when the launcher reported it started."""
        self.returncode: int | None = None
        self._ident = stat.ident
        self._pidfd: int | None = pidfd
        self._on_exit: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self._watching = False
        self._orphaned = False

    def poll(self) -> int | None:
        return self.returncode

    def wait(self) -> int:
        """Block until it ends (in a thread); its code, -1 if it is not known yet."""
        if self._pidfd is not None and self.returncode is None:
            select.select([self._pidfd], [], [])
        return self.returncode if self.returncode is not None else -1

    def kill(self) -> None:
        if self._pidfd is not None and self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def watch(self, on_exit: Callable[[], None]) -> None:
        """Call ``on_exit`` once it ended (its code set)."""
        self._on_exit = on_exit
        if self.returncode is not None:
            on_exit()
        elif self._pidfd is not None:
            self._watching = True
            self._loop.add_reader(self._pidfd, self._ended_unsaid)

    def ended(self, code: int) -> None:
        """It ended with ``code`` (as the launcher said, or as read off its zombie)."""
        if self.returncode is not None:
            return
        self.returncode = code
        self._close()
        if self._on_exit is not None:
            self._on_exit()

    def orphaned(self) -> None:
        """The launcher is gone: nothing more will be said of it."""
        self._orphaned = True
        if self._timer is not None:  # it ended already: no need to wait for the word
            self._timer.cancel()
            self._read_off()

    def _ended_unsaid(self) -> None:
        """Its pidfd turned readable: it ended, and the launcher is about to say so."""
        assert self._pidfd is not None
        self._loop.remove_reader(self._pidfd)
        self._watching = False
        if self._orphaned:
            self._read_off()
        else:
            self._timer = self._loop.call_later(REPORT_WITHIN, self._read_off)

    def _read_off(self) -> None:
        status = exit_status(self._ident)
        code = -1
        if status is not None:
            with contextlib.suppress(ValueError):
                code = os.waitstatus_to_exitcode(status)
        self.ended(code)

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pidfd is not None:
            if self._watching:
                self._loop.remove_reader(self._pidfd)
                self._watching = False
            os.close(self._pidfd)
            self._pidfd = None


class Launcher:
    """One running launcher: its socket, the requests it has not answered, the commands
    it started that have not ended."""

    def __init__(self, sock: socket.socket, child: Child, launch: str) -> None:
        self.launch = launch
        """The freezer's name for it (its own launch)."""
        self.child = child
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self.hello: asyncio.Future[None] = self._loop.create_future()
        self._pending: dict[int, asyncio.Future[Remote]] = {}
        self._started: dict[int, Remote] = {}
        self._abandoned: set[int] = set()
        """Requests whose caller went away before the answer, then their commands."""
        self._ids = 0
        self.broken = False
        self._loop.add_reader(sock.fileno(), self._read)

    @property
    def usable(self) -> bool:
        """Said hello and nothing went wrong since."""
        return self.hello.done() and not self.broken

    async def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        owner: Owner,
        frozen: Callable[[], bool],
    ) -> Child:
        """Start ``argv`` through the launcher, on pipes whose output goes to ``owner``.
        OSError (with the launcher's errno) if it could not fork; LauncherGone if the
        launcher went first (nothing of it runs then, as far as the daemon knows);
        ResourceExhausted if it did not answer for :data:`ANSWER_WITHIN` seconds while
        the sandbox was not ``frozen`` (its code stopped or traced it: then it is dropped,
        and the command may have started). A request abandoned while it waits (its
        caller cancelled) has its command killed once the launcher answers."""
        request = _request(argv, env, cwd)
        if request is None or self.broken:
            raise LauncherGone
        self._ids += 1
        ident = self._ids
        answer: asyncio.Future[Remote] = self._loop.create_future()
        self._pending[ident] = answer
        pipes = Pipes()
        try:
            try:
                theirs = [pipes.theirs[name] for name in ("stdin", "stdout", "stderr")]
                self._sock.sendmsg(
                    [_HEAD.pack(ord("L"), ident, request[0], request[1]), request[2]],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("3i", *theirs))],
                )
            except OSError:
                self._fail("the launcher's socket refused a request")
                raise LauncherGone from None
            finally:
                pipes.close_theirs()
            remote = await self._answer(answer, frozen)
        except BaseException:
            pipes.close()
            if self._pending.pop(ident, None) is not None and not self.broken:
                self._abandoned.add(ident)  # answered later: killed then
            raise
        child = Child(remote, pipes, watch=remote.watch, born=remote.stat)
        await child.join(owner)
        return child

    async def _answer(self, answer: asyncio.Future[Remote], frozen: Callable[[], bool]) -> Remote:
        """``answer`` awaited directly, a timer counting the time it takes (a future
        between them, as ``wait_for(shield(…))`` made, was two more turns of the loop
        before the command's pipes were joined: 0.06 ms of a ``run(["true"])``). Cancelled,
        the request's answer is cancelled with it: :meth:`_message` then kills what it
        started."""
        waited = 0.0
        timer: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal waited, timer
            if answer.done():
                return
            # A pause may hold the launcher mid-request: that time does not count.
            waited += 0.0 if frozen() else _TICK
            if waited < ANSWER_WITHIN:
                timer = self._loop.call_later(_TICK, tick)
                return
            answer.set_exception(
                ResourceExhausted(
                    f"the sandbox's launcher did not answer in {ANSWER_WITHIN:g} s "
                    "(something in the sandbox stopped or traced it); it was dropped, "
                    "and the next command starts a new one",
                    resource="launcher",
                )
            )
            self._fail(f"no answer in {ANSWER_WITHIN:g} s")

        timer = self._loop.call_later(_TICK, tick)
        try:
            return await answer
        finally:
            timer.cancel()  # (the last one armed)

    def close(self) -> None:
        """Close the socket (the launcher ends on its own); what waits is told it went."""
        self._fail(None)

    def _read(self) -> None:
        for _ in range(_READS_PER_WAKE):
            try:
                data, ancillary, flags, _ = self._sock.recvmsg(
                    _HEAD.size + 1, socket.CMSG_SPACE(4 * 4), socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                return
            except OSError:
                self._fail("the launcher's socket failed")
                return
            fds = _fds(ancillary)
            try:
                if not data:  # it ended (killed with its sandbox, or by its code)
                    logger.debug("sandbox launcher %s ended", self.launch)
                    self._fail(None)
                    return
                if len(data) != _HEAD.size or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    self._fail("the launcher sent a malformed message")
                    return
                kind, ident, value, _ = _HEAD.unpack(data)
                self._message(kind, ident, value, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _message(self, kind: int, ident: int, value: int, fds: list[int]) -> None:
        answer = self._pending.get(ident)
        if answer is not None and answer.cancelled():
            # Its request was cancelled and has not cleaned up yet: abandoned, as it will
            # find (its command killed once it is heard of, its end dropped).
            del self._pending[ident]
            self._abandoned.add(ident)
        if kind == ord("H") and not self.hello.done():
            if ident != VERSION:  # 'H' version 0 0
                self._fail(f"the launcher speaks version {ident}, not {VERSION}")
            else:
                self.hello.set_result(None)
        elif kind == ord("S") and ident in self._pending and len(fds) == 1:
            pid = pidfd_pid(fds[0])
            # Its identity even if it ended already (a zombie: not reaped before the 'A').
            stat = None if pid is None else read_stat(pid)
            if stat is None:
                self._fail("the launcher answered without a pidfd")
                return
            remote = Remote(stat, os.dup(fds[0]))
            self._started[ident] = remote
            # Now it may reap the command: the daemon has its pid.
            self._send(ord("A"), ident)
            self._pending.pop(ident).set_result(remote)
        elif ident in self._abandoned and kind in (ord("S"), ord("F"), ord("X")):
            if kind == ord("S") and len(fds) == 1:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fds[0], signal.SIGKILL)
                self._send(ord("A"), ident)  # to be reaped; its 'X' is dropped here
            else:
                self._abandoned.discard(ident)
        elif kind == ord("F") and ident in self._pending:
            code = value if 0 < value < 4096 else errno.EINVAL
            self._pending.pop(ident).set_exception(OSError(code, os.strerror(code)))
        elif kind == ord("X") and ident in self._started:
            try:
                code = os.waitstatus_to_exitcode(value)
            except ValueError:
                code = -1
            self._started.pop(ident).ended(code)
        else:
            self._fail(f"the launcher sent an unexpected message ({kind})")

    def _send(self, kind: int, ident: int) -> None:
        try:
            self._sock.send(_HEAD.pack(kind, ident, 0, 0))
        except OSError:
            self._fail("the launcher's socket refused a message")

    def _fail(self, why: str | None) -> None:
        if why is not None and not self.broken:
            logger.warning("sandbox launcher %s dropped: %s", self.launch, why)
        self.broken = True
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
        if not self.hello.done():
            self.hello.set_exception(LauncherGone())
            self.hello.exception()
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(LauncherGone())
        self._pending.clear()
        for remote in self._started.values():
            remote.orphaned()
        self._started.clear()


def _request(
    argv: Sequence[str], env: Mapping[str, str], cwd: str
) -> tuple[int, int, bytes] | None:
    """A launch request's counts and strings, or None where it cannot be one (too long,
    or a NUL inside a string: the usual way reports that)."""
    words = [cwd, *argv, *(f"{k}={v}" for k, v in env.items()), ""]
    text = "\0".join(words)  # each string ends in a NUL; one inside one cannot be sent
    if text.count("\0") != len(words) - 1:
        return None
    try:
        body = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None
    if len(body) + _HEAD.size > MAX_REQUEST:
        return None
    return len(argv), len(env), body


def _fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
    return fds
