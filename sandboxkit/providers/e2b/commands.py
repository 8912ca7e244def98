"""``sbx.commands`` of an E2B sandbox: the SDK's commands behind the client's
:class:`~sandboxkit.client.commands.AsyncCommands` (its backend)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import shlex
from collections.abc import Callable
from typing import Any

import e2b
from e2b import NotFoundException

from sandboxkit.client.options import FollowOptions
from sandboxkit.client.results import ProcessInfo
from sandboxkit.client.stdin import StdinSession
from sandboxkit.errors import ProcessNotFound, ProviderUnsupported
from sandboxkit.providers.e2b.log import ProcessLog
from sandboxkit.providers.e2b.reader import Reader
from sandboxkit.providers.e2b.session import E2BSession, spec_of
from sandboxkit.providers.e2b.target import USER

__all__ = ["E2BCommands"]

_END_WAIT = 2.0
"""Seconds a restart waits for the old process's end before starting the new one."""

_PTY_ROWS, _PTY_COLS = 24, 80
"""The terminal size of a ``pty=True`` process (the classic 80×24)."""
_PTY_MARK = b"\x1e\x1fsandboxkit\x1f\x1e"
"""Printed just before a ``pty=True`` command runs: the shell's noise before it is dropped."""
_PTY_MARK_TYPED = "\\036\\037sandboxkit\\037\\036"
"""The same, as ``printf`` octal escapes, so that the echo of the typed line is not it."""


class E2BCommands:
    """The :class:`~sandboxkit.client.backend.CommandsBackend` of an E2B sandbox: how a
    process starts, how a pid is tapped and read, and the calls that go straight to the
    SDK (see the package docstring for what differs from a sandboxkit daemon)."""

    def __init__(self, session: E2BSession) -> None:
        self.session = session

    @property
    def sdk(self) -> Any:
        """The SDK's ``commands``."""
        return self.session.sdk.commands

    async def start_process(self, spec: dict[str, Any]) -> ProcessInfo:
        """Start a process through the SDK and tap its output from its first byte. An
        ``argv`` runs as the shell command that quotes it; ``tag`` is not offered by E2B.
        ``pty=True`` goes through the SDK's pty API (:meth:`_start_pty`): the output is the
        terminal's raw bytes, as stdout."""
        cmd = shlex.join(spec["argv"]) if "argv" in spec else spec["cmd"]
        return await self._start_spec(
            {
                "cmd": cmd,
                "argv": None,
                "envs": dict(spec["envs"]),
                "cwd": spec["cwd"],
                "timeout": spec["timeout"],
                "pty": spec["pty"],
            }
        )

    async def follow_reader(self, pid: int, cursor: int | None, options: FollowOptions) -> Reader:
        """A process this client does not tap yet is tapped from now: what it printed
        before is an unknown-size gap. An unknown pid raises ResultUnavailable."""
        await self.session.ensure_tap(pid)
        return self.open_reader(pid, cursor, options)

    async def start_reader(self, spec: dict[str, Any], options: FollowOptions) -> Reader:
        """Started, then read from its first byte (the tap holds all of it)."""
        info = await self.start_process(spec)
        return self.open_reader(info.pid, 0, options)

    def open_reader(self, pid: int, cursor: int | None, options: FollowOptions) -> Reader:
        """A :class:`Reader` of the process's client-side log from ``cursor`` (bytes of
        output this client received; ``None``: the oldest it keeps)."""
        plog = self.session.logs[pid]
        reader = Reader(self.session, plog, cursor, options)
        plog.readers.add(reader)
        return reader

    # -- starting through the SDK ------------------------------------------------------

    async def _start_spec(self, spec: dict[str, Any]) -> ProcessInfo:
        """Start ``spec`` as :attr:`ProcessLog.spec` keeps it (a restart starts it again)."""
        if spec.get("pty"):
            return await self._start_pty(spec)
        plog_holder: list[ProcessLog] = []
        early: list[tuple[str, str]] = []

        def out(stream: str) -> Callable[[str], None]:
            def feed(text: str) -> None:
                data = text.encode("utf-8", "surrogateescape")
                if plog_holder:
                    plog_holder[0].append(stream, data)
                else:  # output before the start event's pid reached us: keep it in order
                    early.append((stream, text))

            return feed

        timeout = spec.get("timeout")
        handle = await self.sdk.run(
            spec["cmd"],
            background=True,
            envs=spec["envs"] or None,
            cwd=spec["cwd"],
            user=USER,
            stdin=True,
            timeout=0 if timeout is None else timeout,
            on_stdout=out("stdout"),
            on_stderr=out("stderr"),
            retain_output=False,
        )
        plog = self.session.new_log(handle.pid, spec)
        plog_holder.append(plog)
        for stream, text in early:
            plog.append(stream, text.encode("utf-8", "surrogateescape"))
        self.session.tap(plog, handle)
        self.session.journal.record("process.started", plog.pid, data={"cmd": spec["cmd"]})
        return self.session.process_info(plog)

    async def _start_pty(self, spec: dict[str, Any]) -> ProcessInfo:
        """E2B's ``pty.create`` starts an interactive login shell, not a command: the
        command is typed into it (``exec``, so the command's exit is the process's), and
        what the shell prints before it — its prompt, the echo of the typed line — is
        dropped up to a marker the typed line prints (typed as octal escapes, so its echo
        does not contain it)."""
        plog_holder: list[ProcessLog] = []
        pending = bytearray()
        started = False

        def feed(data: bytes) -> None:
            nonlocal started
            if not started:
                pending.extend(data)
                at = pending.find(_PTY_MARK)
                if at < 0:
                    return
                started = True
                data = bytes(pending[at + len(_PTY_MARK) :])
                pending.clear()
            if plog_holder:
                plog_holder[0].append("stdout", bytes(data))
            else:
                pending.extend(data)

        timeout = spec.get("timeout")
        handle = await self.session.sdk.pty.create(
            e2b.PtySize(rows=_PTY_ROWS, cols=_PTY_COLS),
            on_data=feed,
            user=USER,
            cwd=spec["cwd"],
            envs=spec["envs"] or None,
            timeout=0 if timeout is None else timeout,
        )
        plog = self.session.new_log(handle.pid, spec)
        plog.pty = True
        plog_holder.append(plog)
        if started and pending:
            plog.append("stdout", bytes(pending))
            pending.clear()
        typed = f"printf '{_PTY_MARK_TYPED}'; exec /bin/bash -c {shlex.quote(spec['cmd'])}\n"
        await self.session.sdk.pty.send_stdin(handle.pid, typed.encode())
        self.session.tap(plog, handle)
        self.session.journal.record(
            "process.started", plog.pid, data={"cmd": spec["cmd"], "pty": True}
        )
        return self.session.process_info(plog)

    async def list(self) -> builtins.list[ProcessInfo]:
        """Processes E2B lists as running, those this client follows (E2B stops listing
        one a moment before its end reaches the tap: it is listed as running until
        then), and those this client saw end."""
        running = {p.pid: p for p in await self.sdk.list()}
        for pid, proc in running.items():
            if pid not in self.session.logs:
                self.session.new_log(pid, spec_of(proc))
        infos = []
        for pid, plog in self.session.logs.items():
            if pid in running or plog.ended or plog.tap is not None:
                infos.append(self.session.process_info(plog))
        return infos

    async def get(self, pid: int) -> ProcessInfo:
        for info in await self.list():
            if info.pid == pid:
                return info
        raise ProcessNotFound(f"no process {pid} in sandbox {self.session.sandbox_id}", pid=pid)

    async def kill(self, pid: int) -> bool:
        """Kill a process (SIGKILL: E2B sends no other signal); False if it was not
        running."""
        killed = bool(await self.sdk.kill(pid))
        if killed:
            self.session.journal.record("process.killed", pid)
        return killed

    async def restart(self, pid: int) -> ProcessInfo:
        """Kill ``pid`` and start its command again (same envs and cwd); the new process
        is tapped from its first byte."""
        old = self.session.logs.get(pid)
        if old is None:
            await self.list()
            old = self.session.logs.get(pid)
        if old is None:
            raise ProcessNotFound(f"no process {pid} in sandbox {self.session.sandbox_id}", pid=pid)
        if old.spec.get("cmd") is None:
            raise ProviderUnsupported(
                f"process {pid} was not started as a shell command; restart it by hand",
                provider="e2b",
                operation="restart",
            )
        await self.sdk.kill(pid)
        if not old.ended:
            changed = old.waiter()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), _END_WAIT)
        info = await self._start_spec(dict(old.spec))
        new = self.session.logs[info.pid]
        old.restarted_to, new.restarted_from = info.pid, pid
        self.session.journal.record("process.restarted", info.pid, data={"old_pid": pid})
        return self.session.process_info(new)

    def stdin_session(self, pid: int, **options: Any) -> StdinSession:
        raise ProviderUnsupported(
            "E2B has no exactly-once stdin sessions; use send_stdin",
            provider="e2b",
            operation="stdin_session",
        )

    async def send_stdin(self, pid: int, data: str | bytes) -> None:
        """Write to the process's stdin (at most once: E2B does not deduplicate a retry,
        so none is made)."""
        plog = self.session.logs.get(pid)
        try:
            if plog is not None and plog.pty:
                raw = data.encode() if isinstance(data, str) else data
                await self.session.sdk.pty.send_stdin(pid, raw)
            else:
                await self.sdk.send_stdin(pid, data)
        except NotFoundException as exc:
            raise ProcessNotFound(str(exc), pid=pid) from exc

    async def close_stdin(self, pid: int) -> None:
        try:
            await self.sdk.close_stdin(pid)
        except NotFoundException as exc:
            raise ProcessNotFound(str(exc), pid=pid) from exc
