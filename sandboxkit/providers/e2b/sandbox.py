"""An E2B sandbox as the backend an :class:`~sandboxkit.client.sandbox.AsyncSandbox`
holds: pause/resume, timeout, kill and the journal through the SDK (see the package
docstring)."""

from __future__ import annotations

import builtins
import contextlib
from typing import Any

import msgspec

from sandboxkit.client.local import Connection
from sandboxkit.client.results import SandboxInfo
from sandboxkit.client.tasks import TaskOwner
from sandboxkit.errors import InvalidArgument
from sandboxkit.providers.e2b.commands import E2BCommands
from sandboxkit.providers.e2b.files import E2BFiles
from sandboxkit.providers.e2b.session import E2BSession
from sandboxkit.providers.e2b.target import DEBUG_SANDBOXES

__all__ = ["E2BSandbox"]


class E2BSandbox:
    """The :class:`~sandboxkit.client.backend.SandboxBackend` of one E2B sandbox. Make an
    ``AsyncSandbox`` holding one with ``AsyncSandbox.create(provider="e2b", ...)``."""

    provider: str | None = "e2b"
    metrics_scope: str = "client"
    """Consumer metrics are this client's own readers: E2B reports none."""

    def __init__(self, session: E2BSession) -> None:
        self.session = session
        self.commands = E2BCommands(session)
        self.files = E2BFiles(session)

    @property
    def sandbox_id(self) -> str:
        return self.session.sandbox_id

    @property
    def info(self) -> SandboxInfo:
        return self.session.info

    @property
    def owner(self) -> TaskOwner:
        return self.session.owner

    @property
    def debug(self) -> bool:
        """True in the SDK's debug mode (an envd, no control plane)."""
        return self.session.debug

    @property
    def connection(self) -> Connection:
        """Where the SDK talks to: the envd URL (debug) or E2B's API URL (cloud)."""
        session = self.session
        url = session.target.url if session.debug else session.sdk.connection_config.api_url
        return Connection(str(url), None)

    # -- lifecycle -------------------------------------------------------------------

    async def get_info(self) -> SandboxInfo:
        """The state as this client knows it; in the cloud, E2B's state (running or
        paused)."""
        session = self.session
        if not session.debug:
            info = await session.sdk.get_info()
            state = str(getattr(info.state, "value", info.state))
            session.set_state("paused" if state == "paused" else "running")
        else:
            session.set_state(session.info.state)
        return session.info

    async def pause(self) -> None:
        """The SDK's ``pause()`` (needs a control plane)."""
        session = self.session
        session.cloud_only("pause")
        session.resumed.clear()
        await session.sdk.pause()
        session.set_state("paused")
        session.journal.record("sandbox.paused", reason="user")

    async def resume(self) -> None:
        """The SDK's ``connect()`` (needs a control plane); taps the pause cut reopen,
        behind an unknown-size gap."""
        session = self.session
        session.cloud_only("resume")
        await session.sdk.connect()
        session.set_state("running")
        session.resumed.set()
        session.journal.record("sandbox.resumed", reason="user")

    async def set_timeout(self, timeout: float | None) -> None:
        """E2B's ``set_timeout`` (cloud): the sandbox ends ``timeout`` seconds from now,
        whether or not anyone uses it (E2B's clock; sandboxkit's counts idle time)."""
        if timeout is None:
            raise InvalidArgument("E2B sandboxes always have a timeout", field="timeout")
        session = self.session
        if not session.debug:
            await session.sdk.set_timeout(max(1, int(timeout)))
        session.info = msgspec.structs.replace(session.info, timeout=timeout)

    async def kill(self) -> None:
        """Kill the sandbox (cloud). In debug mode, where the SDK cannot kill a sandbox,
        every process this client knows is killed."""
        session = self.session
        if session.debug:
            with contextlib.suppress(Exception):
                for proc in await session.sdk.commands.list():
                    await session.sdk.commands.kill(proc.pid)
        else:
            await session.sdk.kill()
        session.set_state("killed")
        session.journal.record("sandbox.killed", reason="user")
        DEBUG_SANDBOXES.forget(session.sandbox_id)

    async def aclose(self) -> None:
        """Nothing beyond the taps and readers (the client's task owner stops those)."""

    # -- observability ---------------------------------------------------------------

    async def consumer_rows(self) -> builtins.list[dict[str, Any]]:
        """This client's taps and readers (client-side only: E2B reports no consumer
        metrics)."""
        rows = []
        for plog in self.session.logs.values():
            if plog.tap is not None:
                rows.append(plog.tap.row())
            rows.extend(r.row() for r in plog.readers)
        return rows

    async def raw_events(
        self, since: int = 0, *, wait: float | None = None
    ) -> builtins.list[dict[str, Any]]:
        """This client's journal (each event's ``data`` says ``"source": "client"``);
        ``wait`` is not supported (E2B has no journal to wait on): answered at once."""
        return self.session.journal.since(since)

    def describe(self) -> str:
        return " (e2b debug)" if self.session.debug else " (e2b cloud)"
