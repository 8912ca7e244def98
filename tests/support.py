"""Helpers shared by the test modules (imported as ``support``; tests/conftest.py holds
only fixtures and hooks): the suite's one poll helper, in a sync and an async form, the
daemon settings the suite runs with, and a child process's environment."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import inspect
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.freezer.cgroupfs import cgroup2_mount, cgroup_pids, rmdir_tree
from sandboxkit.daemon.isolation import ISOLATION_ENV
from sandboxkit.daemon.process import ManagedProcess
from sandboxkit.daemon.recovery import LOCK_FILE
from sandboxkit.wire import FrameDecoder, FrameKind

# The one poll interval: short, since every poll has a deadline and most end at once.
INTERVAL = 0.01


def _timed_out(timeout: float, what: object, info: Callable[[], Any] | None) -> AssertionError:
    detail = f": {info()}" if info is not None else ""
    return AssertionError(f"timed out after {timeout:g}s waiting for {what}{detail}")


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "",
    *,
    interval: float = INTERVAL,
    info: Callable[[], Any] | None = None,
) -> Any:
    """Poll ``predicate()`` until it returns something truthy, and return it; fail after
    ``timeout`` seconds naming ``what`` (and ``info()``, if given). A poll with a deadline,
    not a synchronisation point."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what or predicate, info)
        time.sleep(interval)  # sleep-ok: poll interval


async def poll(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "",
    *,
    interval: float = INTERVAL,
    info: Callable[[], Any] | None = None,
) -> Any:
    """:func:`wait_until` on the running loop (which keeps running between looks):
    ``predicate()`` may be sync or async."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what or predicate, info)
        await asyncio.sleep(interval)  # sleep-ok: poll interval


def end_process(proc: subprocess.Popen[Any], grace: float = 20.0) -> None:
    """End ``proc`` as ``sandboxkit stop`` would a daemon: SIGTERM (it ends its sandboxes
    and removes its directories on the way out; SIGCONT too, in case a test stopped it),
    SIGKILL if it is not gone in ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    proc.send_signal(signal.SIGCONT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def child_env() -> dict[str, str]:
    """This environment for a child process (a ``sandboxkit serve``, a script): without
    sandboxkit's settings (a daemon URL, a freezer), but with the suite's isolation
    default (tests/conftest.py)."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith("SANDBOXKIT_") or k == ISOLATION_ENV
    }


def is_launcher(pid: int) -> bool:
    """Whether process ``pid`` is a sandbox's launcher (sandboxkit/daemon/launcher.py),
    exec'd from the daemon's memfd."""
    try:
        return os.readlink(f"/proc/{pid}/exe").startswith("/memfd:sandboxkit-launcher")
    except OSError:
        return False


def fast_config(**overrides: object) -> DaemonConfig:
    """Daemon settings with short timers, so tests run in well under a second each."""
    values: dict[str, object] = {
        "keepalive_interval": 0.5,
        "kill_grace": 1.0,
        "exit_drain": 0.5,
        "shutdown_drain": 2.0,
        "stall_timeout": 5.0,
    }
    values.update(overrides)
    return DaemonConfig(**values)  # type: ignore[arg-type]


class LoopHold:
    """Holds ``loop`` up for ``hold`` seconds at every turn, as a loaded machine does,
    until :meth:`stop`. Safe to start from another thread (a daemon's loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, hold: float = 0.006) -> None:
        self.hold = hold
        self.loop = loop
        self.stopped = False
        loop.call_soon_threadsafe(self._turn)

    def _turn(self) -> None:
        if self.stopped:
            return
        time.sleep(self.hold)  # sleep-ok: the loop held up (a loaded machine)
        self.loop.call_soon(self._turn)

    def stop(self) -> None:
        self.stopped = True  # (read by the loop's thread at its next turn)


class ChunkedDecoder:
    """Incremental decoder of an HTTP/1.1 chunked body (for raw-socket consumers)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._left = -1  # bytes left in the current chunk; -1: a size line is next
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """Add raw body bytes; return the payload bytes they complete."""
        self._buf += data
        out = bytearray()
        while self._buf and not self.done:
            if self._left < 0:
                end = self._buf.find(b"\r\n")
                if end < 0:
                    break
                size = int(bytes(self._buf[:end]).split(b";")[0], 16)
                del self._buf[: end + 2]
                if size == 0:
                    self.done = True
                    break
                self._left = size
            elif self._left > 0:
                take = min(self._left, len(self._buf))
                out += self._buf[:take]
                del self._buf[:take]
                self._left -= take
            else:
                if len(self._buf) < 2:
                    break
                assert self._buf[:2] == b"\r\n", bytes(self._buf[:8])
                del self._buf[:2]
                self._left = -1
        return bytes(out)


def printed(process: ManagedProcess, stream: str) -> bytes:
    """All a daemon-side process wrote to ``stream`` (``stdout`` or ``stderr``), from its log."""
    _, chunks = process.log.read(0, 1 << 20)
    return b"".join(bytes(c.data) for c in chunks if c.stream == stream)


def stream_payload(raw: Iterable[bytes], decoder: FrameDecoder | None = None) -> bytes:
    """The output in a stream's raw body (its data frames' payloads), which must hold no
    gap; ``decoder``: one that already read the body's start."""
    decoder, payload = decoder or FrameDecoder(), bytearray()
    for chunk in raw:
        for frame in decoder.feed(chunk):
            assert frame.kind != FrameKind.GAP
            if frame.kind == FrameKind.DATA:
                payload += frame.payload
    return bytes(payload)


async def ended(process: ManagedProcess) -> tuple[int | None, bytes, bytes]:
    """Once a daemon-side process ended: its exit code, stdout and stderr."""
    code = await process.wait(10)
    return code, printed(process, "stdout"), printed(process, "stderr")


class StuckSink:
    """A consumer's transport whose peer stopped reading: every send waits until closed."""

    def __init__(self) -> None:
        self._closed = asyncio.Event()

    async def send(self, data: bytes) -> None:
        await self._closed.wait()

    async def close(self) -> None:
        self._closed.set()


def root_unlocked(root: Path) -> bool:
    """True if ``root`` has a daemon's lock file and nobody holds the lock (the kernel
    lets it go as the daemon dies)."""
    try:
        fd = os.open(root / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def daemon_cgroups(proc_cgroup: str, *, v2: bool = True) -> list[Path]:
    """The cgroups a daemon made that a ``/proc/<pid>/cgroup`` names: its cgroup v2 one
    (unless not ``v2``) and, on a hybrid host, its v1 limit ones (``memory``, ``pids``,
    ``cpu``; sandboxkit/daemon/limits.py)."""
    mount = cgroup2_mount()
    found = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "/sandboxkit-" not in path:
            continue
        if v2 and not controllers and mount is not None:
            found.append(mount / path.lstrip("/"))
        for controller in sorted({"memory", "pids", "cpu"} & set(controllers.split(","))):
            found.append(Path("/sys/fs/cgroup", controller) / path.lstrip("/"))
    return found


@contextlib.contextmanager
def dead_daemons_cgroup(
    base: Path, sandbox: str, command: str = "exec sleep 60"
) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A cgroup named as a daemon's below ``base`` (for a pid past the kernel's pid_max: no
    daemon's, so none alive), with a sandbox's cgroup ``sandbox`` in it and a process that
    joined that and runs ``command`` (a shell command); yields the cgroup and the process,
    which is killed and the cgroups removed afterwards."""
    path = base / f"sandboxkit-{2**22 + 1}-{secrets.token_hex(4)}"
    joined = path / sandbox
    joined.mkdir(parents=True)
    member = subprocess.Popen(["/bin/sh", "-c", f'echo $$ > "{joined}/cgroup.procs" && {command}'])
    try:
        wait_until(lambda: member.pid in cgroup_pids(path), what="the member in the cgroup")
        yield path, member
    finally:
        member.kill()
        member.wait()
        rmdir_tree(path)
