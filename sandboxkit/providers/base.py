"""What every provider shares, without importing any provider's SDK: its errors, the gap
of unknown size, and the lazy loader.

A *provider* runs sandboxes somewhere else (E2B's cloud, an envd) behind sandboxkit's own
client classes, so the notebook widgets watch them unchanged. What the other side cannot
tell is said so, never guessed: output nobody was attached to is an :class:`UnknownGap`
(no byte count), and metrics a provider computes itself are marked client-side.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from sandboxkit.errors import SandboxkitError

__all__ = [
    "PROVIDERS",
    "ProviderUnavailable",
    "ProviderUnsupported",
    "UnknownGap",
    "load",
    "metrics_scope",
]

PROVIDERS: dict[str, tuple[str, str]] = {
    "e2b": ("sandboxkit.providers.e2b", "e2b"),
}
"""Provider name → (module, the pip extra that installs its SDK)."""


class ProviderUnavailable(SandboxkitError):
    """The provider's SDK is not installed (the message names the ``pip install``), or
    no such provider exists."""

    code = "provider_unavailable"
    status = 400
    origin = "client"
    fields = ("provider",)


class ProviderUnsupported(SandboxkitError):
    """The provider cannot do this (e.g. pause in E2B's debug mode, which has no control
    plane); nothing was changed."""

    code = "provider_unsupported"
    status = 501
    origin = "client"
    fields = ("provider", "operation")


@dataclass(frozen=True)
class UnknownGap:
    """Output may have been produced here while nobody was attached, and the provider can
    neither replay it nor say how much: ``bytes_lost`` is ``None`` on purpose."""

    cursor: int
    """Where in the stream (bytes this client received before the gap) it sits."""
    reason: str
    """Why, in words a person reads (e.g. "E2B does not replay output ...")."""
    bytes_lost: None = None


def load(name: str) -> ModuleType:
    """The provider module ``name``, imported now (its SDK with it)."""
    try:
        module_name, extra = PROVIDERS[name]
    except KeyError:
        known = ", ".join(sorted(PROVIDERS))
        raise ProviderUnavailable(f"no provider {name!r} (known: {known})", provider=name) from None
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != extra:
            raise
        raise ProviderUnavailable(
            f"the {name!r} provider needs the {extra} SDK: pip install 'sandboxkit[{extra}]'",
            provider=name,
        ) from exc


def metrics_scope(sbx: Any) -> str:
    """``"daemon"`` when a sandboxkit daemon measures the consumers of ``sbx`` (a sync or
    async sandbox); ``"client"`` when only this client's own readers are known."""
    inner = getattr(sbx, "async_sandbox", sbx)
    scope = getattr(inner, "metrics_scope", "daemon")
    return scope if isinstance(scope, str) else "daemon"
