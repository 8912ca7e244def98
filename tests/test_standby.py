"""A sandbox's next launch started ahead (sandboxkit/daemon/standby.py): a command takes
it and runs exactly as it would have started anew — its argv, variables, cwd, stdin and
exit — in a process that was already in the sandbox's cgroups (and namespaces); what
does not fit starts the usual way; a dead standby is replaced; nothing outlives the
sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from freezer_support import alive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import ended, fast_config, poll, printed

from sandboxkit.daemon import isolation
from sandboxkit.daemon.freezer import MARK_VAR
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.sandbox import ManagedSandbox
from sandboxkit.daemon.standby import MAX_LINE, QUIET, SCRIPT, Quiet, exec_line

# -- the line: what the shell makes of it is exactly what was asked ---------------------

_SHOW = "import json, os, sys; print(json.dumps([sys.argv[1:], dict(os.environ), os.getcwd()]))"

# Anything a JSON request may carry but NUL: quotes, newlines, $, backslashes, unicode.
_word = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=40)
_name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True).filter(
    lambda n: not n.startswith("_sandboxkit")
)


def _evaluated(line: bytes, cwd: str) -> list[object]:
    """What ``/bin/sh -c SCRIPT`` does with ``line`` on its stdin (as a standby would)."""
    done = subprocess.run(
        ["/bin/sh", "-c", SCRIPT, "sh"],
        input=line,
        capture_output=True,
        cwd=cwd,
        env={"PATH": os.environ["PATH"]},
        timeout=30,
        check=True,
    )
    shown: list[object] = json.loads(done.stdout)
    return shown


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(args=st.lists(_word, max_size=6), envs=st.dictionaries(_name, _word, max_size=4))
def test_a_line_execs_exactly_the_argv_with_the_variables_and_cwd(
    tmp_path: object, args: list[str], envs: dict[str, str]
) -> None:
    where = str(tmp_path)
    line = exec_line([sys.executable, "-c", _SHOW, *args], envs, where)
    if line is None:  # too long for one line: the usual way
        assert len(repr((args, envs))) > MAX_LINE // 8
        return
    argv, env, cwd = _evaluated(line, "/")
    assert argv == args
    assert {k: env.get(k) for k in envs} == envs  # type: ignore[union-attr]
    assert cwd == where


@pytest.mark.parametrize(
    ("argv", "envs"),
    [
        (["-x"], {}),  # an option to some shells' exec
        (["echo", "a\0b"], {}),  # no exec takes a NUL
        (["echo"], {"A-B": "1"}),  # not a shell name: export would refuse it
        (["echo"], {"_sandboxkit_nl": "x"}),  # the standby's own
        (["echo"], {MARK_VAR: "x"}),  # the owner mark: the usual way puts it last
        (["echo", "x" * MAX_LINE], {}),  # a line read a byte at a time
    ],
)
def test_what_no_line_can_say_starts_the_usual_way(argv: list[str], envs: dict[str, str]) -> None:
    assert exec_line(argv, envs, None) is None


# -- in a daemon --------------------------------------------------------------------------


async def _standby_pids(sandbox: ManagedSandbox) -> set[int]:
    """The standby's processes once it is up (the sandbox runs nothing else): those in
    the sandbox's cgroup, and for an isolated one bubblewrap's monitor, their parent,
    which leaves it."""
    slot = sandbox.standby
    assert slot is not None
    await poll(lambda: slot.ready, what="the standby started")
    inside = await poll(lambda: sandbox.tree.pids(), what="the standby in the cgroup")
    return {*inside, *(psutil.Process(pid).ppid() for pid in inside)} - {os.getpid()}


@pytest.fixture(params=["none", "namespaces"])
async def sandbox(request: pytest.FixtureRequest) -> ManagedSandbox:
    if request.param == "namespaces" and not isolation.probe().available:
        pytest.skip("no namespaces here")
    async with Host(fast_config(standby="shell")) as host:
        made = await host.create_sandbox(isolation=request.param)
        if made.standby is None:
            pytest.skip("a launch here is one exec: no standby")
        yield made


async def test_a_command_runs_in_the_process_started_ahead(sandbox: ManagedSandbox) -> None:
    ahead = await _standby_pids(sandbox)
    os.makedirs(sandbox.workdir / "sub dir")
    process = await sandbox.start_process(
        ProcessSpec(
            argv=("/bin/sh", "-c", 'printf "%s|%s|%s" "$1" "$GREETING" "$(pwd)"', "sh", "it's\n$x"),
            envs={"GREETING": "hello 'there'"},
            cwd="sub dir",
        )
    )
    assert process.pid in ahead, "started anew, not taken"
    home = isolation.HOME if sandbox.plan is not None else str(sandbox.workdir)
    assert await ended(process) == (0, f"it's\n$x|hello 'there'|{home}/sub dir".encode(), b"")
    # The next one is started while (or once) the command ran, for the next command.
    await poll(lambda: set(sandbox.tree.pids()) - ahead, what="the next standby")


async def test_stdin_goes_to_the_command_after_its_line(sandbox: ManagedSandbox) -> None:
    ahead = await _standby_pids(sandbox)
    process = await sandbox.start_process(ProcessSpec(argv=("cat",)))
    assert process.pid in ahead
    await process.write_stdin("s", 0, b"one\ntwo")
    process.close_stdin()
    assert await ended(process) == (0, b"one\ntwo", b"")


async def test_a_command_that_cannot_be_executed_exits_127_saying_so(
    sandbox: ManagedSandbox,
) -> None:
    await _standby_pids(sandbox)
    process = await sandbox.start_process(ProcessSpec(argv=("no-such-program-xyz",)))
    code, out, err = await ended(process)
    assert (code, out) == (127, b"")
    assert b"no-such-program-xyz" in err and b"not found" in err


async def test_a_pty_command_starts_anew(sandbox: ManagedSandbox) -> None:
    ahead = await _standby_pids(sandbox)
    process = await sandbox.start_process(ProcessSpec(cmd="[ -t 1 ] && echo terminal", pty=True))
    assert process.pid not in ahead
    assert await process.wait(10) == 0
    assert printed(process, "pty") == b"terminal\r\n"


async def test_a_command_started_while_paused_runs_once_resumed(sandbox: ManagedSandbox) -> None:
    ahead = await _standby_pids(sandbox)
    await sandbox.pause()
    process = await sandbox.start_process(ProcessSpec(cmd="echo woke"))
    assert process.pid in ahead
    await asyncio.sleep(0.3)  # sleep-ok: a paused sandbox must stay silent this long
    assert process.running and printed(process, "stdout") == b""
    await sandbox.resume()
    assert await ended(process) == (0, b"woke\n", b"")


async def test_a_standby_killed_from_outside_is_replaced(sandbox: ManagedSandbox) -> None:
    ahead = await _standby_pids(sandbox)
    for pid in ahead:
        with contextlib.suppress(ProcessLookupError):  # gone with one killed before it
            os.kill(pid, signal.SIGKILL)
    await poll(lambda: not any(alive(pid) for pid in ahead), what="the standby gone")
    process = await sandbox.start_process(ProcessSpec(cmd="echo still"))
    assert process.pid not in ahead
    assert await ended(process) == (0, b"still\n", b"")
    await poll(lambda: sandbox.tree.pids(), what="a new standby")


async def test_nothing_of_the_standby_outlives_its_sandbox(sandbox: ManagedSandbox) -> None:
    ahead = await _standby_pids(sandbox)
    leader = min(ahead) if sandbox.plan is None else None
    await sandbox.kill()
    await poll(lambda: not any(alive(pid) for pid in ahead), what="the standby ended")
    if leader is not None:  # reaped by the daemon: no zombie left
        assert not psutil.pid_exists(leader) or psutil.Process(leader).ppid() != os.getpid()


async def test_with_standby_off_a_sandbox_keeps_no_process() -> None:
    async with Host(fast_config(standby="off")) as host:
        made = await host.create_sandbox(isolation="none")
        assert made.standby is None
        process = await made.start_process(ProcessSpec(cmd="echo $$"))
        await poll(lambda: not process.running)
        assert made.tree.pids() == []


# -- when standbys are started: once the daemon is quiet, one at a time ------------------


class _Slot:
    """Stands in for a StandbySlot: records when it is filled; its start ends on cue."""

    def __init__(self) -> None:
        self.filled_at: float | None = None
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _fill(self) -> asyncio.Future[None]:
        self.filled_at = time.monotonic()
        return self.started


async def test_a_standby_waits_until_nothing_was_launched_for_a_while() -> None:
    quiet = Quiet()
    slot = _Slot()
    touches = []
    quiet.wait(slot)  # type: ignore[arg-type]
    for _ in range(20):  # a burst of launches, about 4 a QUIET
        if slot.filled_at is None:
            quiet.touch()
            touches.append(time.monotonic())
        await asyncio.sleep(QUIET / 4)  # sleep-ok: the pace of a burst of launches
    await poll(lambda: slot.filled_at, what="started once quiet")
    assert slot.filled_at is not None
    # Never sooner than QUIET after a launch (a slow loop may make a gap in the burst).
    last = max(t for t in touches if t <= slot.filled_at)
    assert slot.filled_at - last >= QUIET * 0.95
    quiet.close()


async def test_standbys_are_started_one_at_a_time() -> None:
    quiet = Quiet()
    first, second = _Slot(), _Slot()
    quiet.wait(first)  # type: ignore[arg-type]
    quiet.wait(second)  # type: ignore[arg-type]
    await poll(lambda: first.filled_at, what="the first started")
    await asyncio.sleep(3 * QUIET)  # sleep-ok: time enough for the second, were it not held
    assert second.filled_at is None, "started beside the first"
    first.started.set_result(None)
    await poll(lambda: second.filled_at, what="the second, once the first is started")
    quiet.close()
