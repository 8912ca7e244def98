"""The E2B provider's entry points — create, connect, list — as the
:class:`~sandboxkit.client.provider.Provider` the client loads by name."""

from __future__ import annotations

import builtins
from typing import Any

import e2b
import msgspec

from sandboxkit.client.provider import CreateOptions
from sandboxkit.client.results import SandboxInfo
from sandboxkit.client.sandbox import AsyncSandbox
from sandboxkit.errors import ProviderUnsupported, SandboxNotFound
from sandboxkit.providers.e2b.sandbox import E2BSandbox
from sandboxkit.providers.e2b.session import E2BSession, no_control_plane
from sandboxkit.providers.e2b.target import DEBUG_SANDBOXES, DEFAULT_LOG_BYTES, Target
from sandboxkit.vocab import SandboxState

__all__ = ["E2BProvider"]


def _lifecycle(options: CreateOptions, target: Target) -> dict[str, Any] | None:
    """E2B's ``lifecycle`` for ``on_timeout``/``auto_resume``, or ``None`` for E2B's
    default (kill, no resume). Refused where E2B cannot honour them: debug mode has no
    control plane to pause, and E2B resumes only a sandbox its timeout paused."""
    if options.on_timeout == "kill" and not options.auto_resume:
        return None
    if target.debug:
        operation = "auto_resume" if options.on_timeout == "kill" else "on_timeout"
        raise no_control_plane(operation)
    if options.on_timeout != "pause":
        raise ProviderUnsupported(
            "E2B resumes only a sandbox its timeout paused: auto_resume=True needs "
            "on_timeout='pause'",
            provider="e2b",
            operation="auto_resume",
        )
    return {"on_timeout": "pause", "auto_resume": options.auto_resume}


class E2BProvider:
    """``provider="e2b"`` (see the package docstring for cloud vs debug)."""

    async def create(self, options: CreateOptions) -> AsyncSandbox:
        """A new E2B sandbox. ``on_timeout="pause"`` and ``auto_resume`` go to E2B's
        ``lifecycle`` (cloud); in debug mode they raise ProviderUnsupported."""
        opts = dict(options.options)
        keep_bytes = int(opts.pop("keep_bytes", DEFAULT_LOG_BYTES))
        target = Target.resolve(options.url, options.token, opts)
        lifecycle = _lifecycle(options, target)
        extra: dict[str, Any] = {} if lifecycle is None else {"lifecycle": lifecycle}
        timeout = options.timeout
        sdk = await e2b.AsyncSandbox.create(
            timeout=None if timeout is None else max(1, int(timeout)),
            envs=options.envs,
            metadata=options.metadata,
            **extra,
            **target.options,
        )
        sandbox_id = DEBUG_SANDBOXES.add(target) if target.debug else sdk.sandbox_id
        session = E2BSession(
            sdk,
            sandbox_id,
            target,
            timeout=timeout,
            metadata=options.metadata,
            keep_bytes=keep_bytes,
        )
        if lifecycle is not None:
            session.info = msgspec.structs.replace(
                session.info, on_timeout="pause", auto_resume=options.auto_resume
            )
        session.journal.record("sandbox.created", data={"debug": target.debug})
        return AsyncSandbox(E2BSandbox(session))

    async def connect(
        self, sandbox_id: str, *, url: str | None, token: str | None, options: dict[str, Any]
    ) -> AsyncSandbox:
        """A client of an existing E2B sandbox (cloud: any of yours; debug: one made in
        this process). Its processes are tapped from now on."""
        target = DEBUG_SANDBOXES.get(sandbox_id)
        if target is not None:
            sdk = await e2b.AsyncSandbox.connect("debug_sandbox_id", **target.options)
        else:
            target = Target.resolve(url, token, options)
            if target.debug:
                raise SandboxNotFound(
                    f"no E2B debug sandbox {sandbox_id} in this process", sandbox_id=sandbox_id
                )
            sdk = await e2b.AsyncSandbox.connect(sandbox_id, **target.options)
        session = E2BSession(sdk, sandbox_id, target, timeout=None, metadata=None)
        return AsyncSandbox(E2BSandbox(session))

    async def list_sandboxes(
        self, *, url: str | None, token: str | None, options: dict[str, Any]
    ) -> builtins.list[SandboxInfo]:
        """Your E2B sandboxes (cloud), or the debug sandboxes made in this process."""
        target = Target.resolve(url, token, options)
        if target.debug:
            return [_info(sid, "running", 0.0, {}) for sid in DEBUG_SANDBOXES.ids()]
        paginator = e2b.AsyncSandbox.list(**target.options)
        infos: builtins.list[SandboxInfo] = []
        while paginator.has_next:
            for item in await paginator.next_items():
                state = str(getattr(item.state, "value", item.state))
                infos.append(
                    _info(
                        item.sandbox_id,
                        "paused" if state == "paused" else "running",
                        item.started_at.timestamp(),
                        dict(item.metadata or {}),
                    )
                )
        return infos


def _info(
    sandbox_id: str, state: SandboxState, created_at: float, metadata: dict[str, str]
) -> SandboxInfo:
    return SandboxInfo(
        sandbox_id=sandbox_id,
        state=state,
        timeout=None,
        on_timeout="kill",
        auto_resume=False,
        created_at=created_at,
        processes=0,
        metadata=metadata,
        fanout="e2b",
    )
