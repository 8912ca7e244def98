"""A sandbox's launcher (sandboxkit/daemon/launcher.py, launcher.c): a command it forks
runs exactly as one started anew — its argv, variables, cwd, pipes and exit — already
inside the sandbox; what does not fit starts the usual way; a launcher that dies is
replaced and one that lies is dropped, the daemon believing nothing of it; nothing
outlives the sandbox."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys

import psutil
import pytest
from freezer_support import alive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import ended, fast_config, is_launcher, poll

from sandboxkit.daemon import isolation, launcher, process_spec
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.launcher import (
    PROGRAM,
    Launcher,
    LauncherGone,
    program_fd,
)
from sandboxkit.daemon.launcher_slot import LauncherSlot
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.spawn import Child
from sandboxkit.errors import ResourceExhausted
from sandboxkit.limits import Limits

pytestmark = pytest.mark.skipif(program_fd() is None, reason="no launcher built here (no cc)")

_SHOW = "import json, os, sys; print(json.dumps([sys.argv[1:], dict(os.environ), os.getcwd()]))"


def test_the_launcher_is_built_at_install() -> None:
    """Where a C compiler is, ``pip install`` built it (hatch_build.py): CI notices a
    build that broke, which would otherwise only skip this module."""
    assert shutil.which("cc") is None or PROGRAM.is_file()


def _slot(sandbox: ManagedSandbox) -> LauncherSlot:
    slot = sandbox.standby
    assert isinstance(slot, LauncherSlot), slot
    return slot


async def _launcher(sandbox: ManagedSandbox) -> Launcher:
    running: Launcher = await poll(lambda: _slot(sandbox).running, what="the launcher up")
    return running


@pytest.fixture(params=["none", "namespaces"])
async def sandbox(request: pytest.FixtureRequest) -> ManagedSandbox:
    if request.param == "namespaces" and not isolation.probe().available:
        pytest.skip("no namespaces here")
    async with Host(fast_config()) as host:
        made = await host.create_sandbox(isolation=request.param)
        if made.standby is None:
            pytest.skip("a launch here is one exec: no launcher")
        yield made


# -- a command through it is the command asked for ---------------------------------------

_word = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=30)
_name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,10}", fullmatch=True).filter(
    lambda n: not n.startswith("_sandboxkit")
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(args=st.lists(_word, max_size=5), envs=st.dictionaries(_name, _word, max_size=4))
def test_a_command_gets_exactly_its_argv_variables_and_cwd(
    args: list[str], envs: dict[str, str]
) -> None:
    async def run() -> None:
        async with Host(fast_config()) as host:
            made = await host.create_sandbox(isolation="none")
            if made.standby is None:
                pytest.skip("a launch here is one exec: no launcher")
            (made.workdir / "sub dir").mkdir()
            await _launcher(made)
            process = await made.start_process(
                ProcessSpec(argv=(sys.executable, "-c", _SHOW, *args), envs=envs, cwd="sub dir")
            )
            assert is_launcher(psutil.Process(process.pid).ppid()), "started anew"
            code, out, err = await ended(process)
            assert code == 0, err
            argv, env, cwd = json.loads(out)
            assert argv == args
            assert {k: env.get(k) for k in envs} == envs
            assert cwd == str(made.workdir / "sub dir")

    asyncio.run(run())


async def test_an_unisolated_command_inherits_the_daemons_environment_as_it_is_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The daemon keeps its environment decoded between commands (daemon/process_spec.py,
    # daemon_environ): a variable the daemon's process sets, changes or drops later still
    # reaches the next command as it is then, through the launcher or the usual way.
    async def printed() -> list[str]:
        seen = []
        for user in (None, "root"):  # a fork of the launcher; a start the usual way
            process = await made.start_process(
                ProcessSpec(cmd='echo "${SBX_LATER-unset}"', user=user)
            )
            code, out, err = await ended(process)
            assert code == 0, err
            seen.append(out.decode().strip())
        return seen

    async with Host(fast_config()) as host:
        made = await host.create_sandbox(isolation="none")
        if made.standby is None:
            pytest.skip("a launch here is one exec: no launcher")
        await _launcher(made)
        monkeypatch.delenv("SBX_LATER", raising=False)
        assert await printed() == ["unset", "unset"]
        monkeypatch.setenv("SBX_LATER", "one")
        assert await printed() == ["one", "one"]
        monkeypatch.setenv("SBX_LATER", "two")
        assert await printed() == ["two", "two"]
        monkeypatch.delenv("SBX_LATER")
        assert await printed() == ["unset", "unset"]
    assert process_spec.daemon_environ() is process_spec.daemon_environ()  # kept, unchanged


async def test_a_command_runs_in_the_sandbox_as_the_launchers_child(
    sandbox: ManagedSandbox,
) -> None:
    await _launcher(sandbox)
    process = await sandbox.start_process(
        ProcessSpec(
            cmd='echo "$GREETING" $(pwd); cat; echo err >&2; exit 7', envs={"GREETING": "hi"}
        )
    )
    parent = psutil.Process(process.pid).ppid()
    assert is_launcher(parent), "started anew, not by the launcher"
    assert process.pid in sandbox.tree.pids()  # born in the sandbox's cgroup
    await process.write_stdin("s", 0, b"through stdin\n")
    process.close_stdin()
    code, out, err = await ended(process)
    home = "/home/user" if sandbox.plan is not None else str(sandbox.workdir)
    assert (code, out, err) == (7, f"hi {home}\nthrough stdin\n".encode(), b"err\n")


async def test_a_command_a_signal_ends_exits_with_minus_the_signal(
    sandbox: ManagedSandbox,
) -> None:
    await _launcher(sandbox)
    process = await sandbox.start_process(ProcessSpec(cmd="kill -TERM $$"))
    assert await process.wait(10) == -signal.SIGTERM


@pytest.mark.parametrize(
    ("argv", "code", "said"),
    [
        (("no-such-program-here",), 127, b"No such file or directory"),
        (("/etc/passwd",), 126, b"Permission denied"),  # found, not executable
    ],
)
async def test_what_cannot_be_executed_exits_as_through_a_shell_saying_so(
    sandbox: ManagedSandbox, argv: tuple[str, ...], code: int, said: bytes
) -> None:
    """As through the wrapper's shell (and the standby): the process starts, and exits
    127 (not found) or 126 (not executable) with why on its stderr; the launcher serves
    on."""
    running = await _launcher(sandbox)
    process = await sandbox.start_process(ProcessSpec(argv=argv))
    assert await ended(process) == (  # the launcher's words (a shell's are its own)
        code,
        b"",
        b"sandboxkit: cannot execute " + argv[0].encode() + b": " + said + b"\n",
    )
    process = await sandbox.start_process(ProcessSpec(argv=("echo", "still")))
    assert await ended(process) == (0, b"still\n", b"")
    assert _slot(sandbox).running is running


async def test_a_pty_command_and_another_user_start_the_usual_way(sandbox: ManagedSandbox) -> None:
    """The launcher runs commands on pipes as the sandbox's own user; a pty or another
    user's command starts anew (each stays alive while its parent is read: a command
    that ended could be reaped first)."""
    await _launcher(sandbox)
    specs = [ProcessSpec(cmd="exec cat", pty=True)]
    if sandbox.plan is not None:
        specs.append(ProcessSpec(cmd="exec cat", user="root"))  # root inside the namespace
    elif os.geteuid() == 0:
        specs.append(ProcessSpec(cmd="exec cat", user="nobody"))
    for spec in specs:
        process = await sandbox.start_process(spec)
        assert not is_launcher(psutil.Process(process.pid).ppid()), spec
        await process.kill()
        assert await process.wait(10) is not None


async def test_a_command_started_while_paused_runs_once_resumed(sandbox: ManagedSandbox) -> None:
    await _launcher(sandbox)
    await sandbox.pause()
    process = await sandbox.start_process(ProcessSpec(argv=("echo", "after")))
    assert not is_launcher(psutil.Process(process.pid).ppid())  # the launcher is frozen
    await sandbox.resume()
    assert await ended(process) == (0, b"after\n", b"")


async def test_the_second_command_starts_it_and_goes_through_it(
    sandbox: ManagedSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon never quiet enough to start it ahead: the sandbox's first command starts
    the usual way; the next ones (two at once here) start one launcher, wait for it and
    run as its children."""
    slot = _slot(sandbox)
    monkeypatch.setattr(slot._quiet, "left", lambda: 1.0)  # never quiet
    first = await sandbox.start_process(ProcessSpec(cmd="exec cat"))
    assert slot.running is None and not is_launcher(psutil.Process(first.pid).ppid())
    more = await asyncio.gather(
        *(sandbox.start_process(ProcessSpec(cmd="exec cat")) for _ in range(2))
    )
    parents = {psutil.Process(p.pid).ppid() for p in more}
    assert len(parents) == 1 and is_launcher(parents.pop())
    for process in (first, *more):
        process.close_stdin()
        assert await process.wait(10) == 0


async def test_at_its_process_limit_a_command_is_refused_as_out_of_processes() -> None:
    """The launcher's fork fails (EAGAIN) in a sandbox at its ``pids`` limit: a typed,
    retriable 503, not a "cannot execute"; once a process ends, commands start again."""
    async with Host(fast_config()) as host:
        sandbox = await host.create_sandbox(isolation="none", limits=Limits(pids=4))
        if sandbox.limits is None or sandbox.limits.enforced()["pids"] == "rlimit":
            pytest.skip("no cgroup to hold a pids limit here")
        await _launcher(sandbox)  # one of the four
        sleepers = []
        with pytest.raises(ResourceExhausted) as refused:
            for _ in range(4):
                sleepers.append(await sandbox.start_process(ProcessSpec(argv=("sleep", "60"))))
        assert refused.value.resource == "processes"
        assert len(sleepers) == 3
        await sleepers[0].kill()
        process = await sandbox.start_process(ProcessSpec(argv=("echo", "again")))
        assert await ended(process) == (0, b"again\n", b"")


async def test_a_launcher_killed_from_outside_is_replaced(sandbox: ManagedSandbox) -> None:
    first = await _launcher(sandbox)
    running = await sandbox.start_process(ProcessSpec(cmd="cat"))
    launcher_pid = psutil.Process(running.pid).ppid()
    assert is_launcher(launcher_pid)
    os.kill(launcher_pid, signal.SIGKILL)
    # Its command runs on (in namespaces bubblewrap's PID 1 adopts it), and its end is
    # still seen once its stdin closes: its code read off its zombie, or -1 (unknown)
    # where its new parent reaped it first.
    assert running.running
    running.close_stdin()
    assert await running.wait(10) in (0, -1)
    process = await sandbox.start_process(ProcessSpec(argv=("echo", "anew")))
    assert await ended(process) == (0, b"anew\n", b"")
    second = await _launcher(sandbox)
    assert second is not first


async def test_a_launcher_its_sandbox_stops_costs_one_command_then_is_replaced(
    sandbox: ManagedSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sandbox's code may stop its launcher (it runs as that code's account): the
    next command is refused with a typed, retriable error once the launcher has not
    answered for ANSWER_WITHIN, the launcher is dropped, and the command after starts."""
    first = await _launcher(sandbox)
    stopper = await sandbox.start_process(ProcessSpec(cmd="kill -STOP $PPID"))
    assert await stopper.wait(10) == 0
    # Short only now: a loaded machine may take longer than this to answer the stopper.
    monkeypatch.setattr(launcher, "ANSWER_WITHIN", 0.5)
    monkeypatch.setattr(launcher, "_TICK", 0.1)
    with pytest.raises(ResourceExhausted, match="did not answer"):
        await sandbox.start_process(ProcessSpec(argv=("true",)))
    process = await sandbox.start_process(ProcessSpec(argv=("echo", "on")))
    assert await ended(process) == (0, b"on\n", b"")
    assert _slot(sandbox).running is not first


async def test_nothing_of_the_launcher_outlives_its_sandbox(sandbox: ManagedSandbox) -> None:
    running = await _launcher(sandbox)
    inside = [p for p in sandbox.tree.pids() if is_launcher(p)]
    assert inside
    leader = running.child.pid
    await sandbox.kill()
    await poll(lambda: not any(alive(p) for p in (*inside, leader)), what="the launcher ended")
    assert not psutil.pid_exists(leader) or psutil.Process(leader).ppid() != os.getpid()


# -- a launcher that lies is dropped ------------------------------------------------------


class _Fake:
    """The launcher's end of the socket, played by the test; the Launcher under test
    holds the other end."""

    def __init__(self) -> None:
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.setblocking(False)
        self.holder = subprocess.Popen(["sleep", "60"])  # stands for its process
        self.launcher = Launcher(theirs, Child(self.holder, None), "fake")

    def say(self, kind: str, a: int = 0, b: int = 0, fds: tuple[int, ...] = ()) -> None:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        self.ours.sendmsg([struct.pack("=4I", ord(kind), a, b, 0)], rights if fds else [])

    def request(self) -> int:
        """Take the next request; its id."""
        data, ancillary, _, _ = self.ours.recvmsg(launcher.MAX_REQUEST, socket.CMSG_SPACE(12))
        for _, _, fds in ancillary:  # the command's pipes: this fake runs nothing
            for fd in struct.unpack(f"{len(fds) // 4}i", fds):
                os.close(fd)
        return int(struct.unpack("=4I", data[:16])[1])

    def close(self) -> None:
        self.launcher.close()
        self.ours.close()
        self.holder.kill()
        self.holder.wait()


class _Owner:
    def __init__(self) -> None:
        self.stdin_drained = asyncio.Event()

    def capture(self, stream: str, data: bytes) -> None:
        pass


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.fixture
async def fake() -> _Fake:
    made = _Fake()
    made.say("H", launcher.VERSION)
    await made.launcher.hello
    yield made
    made.close()


async def _spawn(fake: _Fake) -> asyncio.Task[Child]:
    task = asyncio.ensure_future(
        fake.launcher.spawn(["true"], {}, "/", _Owner(), frozen=lambda: False)  # type: ignore[arg-type]
    )
    await poll(lambda: fake.launcher._pending, what="the request sent")
    return task


async def test_a_descriptor_that_is_no_pidfd_is_refused_and_closed(fake: _Fake) -> None:
    before = _open_fds()
    task = await _spawn(fake)
    ident = await asyncio.to_thread(fake.request)
    read, write = os.pipe()  # a FIFO's end, which would block whoever reads it
    fake.say("S", ident, 1, (read,))
    with pytest.raises(LauncherGone):
        await task
    os.close(read)
    os.close(write)
    assert fake.launcher.broken
    assert _open_fds() <= before, "a descriptor it sent stayed open"


async def test_the_pid_comes_from_the_pidfd_not_the_message(fake: _Fake) -> None:
    task = await _spawn(fake)
    ident = await asyncio.to_thread(fake.request)
    pidfd = os.pidfd_open(fake.holder.pid)
    fake.say("S", ident, os.getpid(), (pidfd,))  # claims the daemon itself
    os.close(pidfd)
    child = await task
    assert child.pid == fake.holder.pid
    fake.say("X", ident, 3 << 8)
    await asyncio.wait_for(child.exited, 10)
    assert child.returncode == 3


@pytest.mark.parametrize("answered", ["after the cancel", "with the cancel"])
async def test_a_request_its_caller_abandoned_has_its_command_killed(
    fake: _Fake, answered: str
) -> None:
    # The request went away before the launcher answered, or in the same turn of the loop
    # as its answer: the answer read (here, at once) before the cancelled request cleans
    # up. Either way its command is killed and reaped, and the launcher stays usable.
    task = await _spawn(fake)
    ident = await asyncio.to_thread(fake.request)
    if answered == "after the cancel":
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # What the launcher started meanwhile.
    command = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        pidfd = os.pidfd_open(command.pid)
        fake.say("S", ident, command.pid, (pidfd,))
        os.close(pidfd)
        if answered == "with the cancel":
            # Not awaited: the loop must not read it first.
            assert select.select([fake.launcher._sock], [], [], 10)[0]
            task.cancel()
            fake.launcher._read()  # the answer, before the request's task runs again
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await asyncio.wait_for(command.wait(), 10) == -signal.SIGKILL
        assert await asyncio.to_thread(fake.request) == ident  # the 'A': reap it
        fake.say("X", ident, signal.SIGKILL)
        await poll(lambda: ident not in fake.launcher._abandoned, what="its end heard")
        assert fake.launcher.usable
    finally:
        if command.returncode is None:
            command.kill()
            await command.wait()


@pytest.mark.parametrize(
    "message",
    [b"short", struct.pack("=4I", ord("X"), 99, 0, 0), struct.pack("=4I", ord("Z"), 0, 0, 0)],
    ids=["malformed", "unknown id", "unknown type"],
)
async def test_a_message_out_of_protocol_drops_it(fake: _Fake, message: bytes) -> None:
    task = await _spawn(fake)
    fake.ours.send(message)
    with pytest.raises(LauncherGone):
        await task
    assert fake.launcher.broken


async def test_another_version_is_not_used() -> None:
    made = _Fake()
    try:
        made.say("H", launcher.VERSION + 1)
        with pytest.raises(LauncherGone):
            await made.launcher.hello
        assert not made.launcher.usable
    finally:
        made.close()


async def test_a_launcher_that_never_answers_is_dropped_paused_time_not_counted(
    fake: _Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "ANSWER_WITHIN", 0.2)
    monkeypatch.setattr(launcher, "_TICK", 0.05)
    frozen = True
    task = asyncio.ensure_future(
        fake.launcher.spawn(["true"], {}, "/", _Owner(), frozen=lambda: frozen)  # type: ignore[arg-type]
    )
    await asyncio.sleep(0.5)  # sleep-ok: paused longer than the limit, which must not count
    assert not task.done()
    frozen = False
    with pytest.raises(ResourceExhausted, match="did not answer"):
        await asyncio.wait_for(task, 10)
    assert fake.launcher.broken
