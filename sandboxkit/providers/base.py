"""What the widgets ask of any sandbox, provider's or not, without importing a provider's
SDK: where its consumer metrics come from. The provider errors live in
:mod:`sandboxkit.errors`, the gap of unknown size beside ``GapInfo`` in
:mod:`sandboxkit.client.stream`, the contract and the loader in
:mod:`sandboxkit.client.provider`; they are re-exported here for the widgets.

A *provider* runs sandboxes somewhere else (E2B's cloud, an envd) behind sandboxkit's own
client classes, so the notebook widgets watch them unchanged. What the other side cannot
tell is said so, never guessed: output nobody was attached to is an :class:`UnknownGap`
(no byte count), and metrics a provider computes itself are marked client-side.
"""

from __future__ import annotations

from typing import Any

from sandboxkit.client.provider import load
from sandboxkit.client.stream import UnknownGap
from sandboxkit.errors import ProviderUnavailable, ProviderUnsupported

__all__ = [
    "ProviderUnavailable",
    "ProviderUnsupported",
    "UnknownGap",
    "load",
    "metrics_scope",
]


def metrics_scope(sbx: Any) -> str:
    """``"daemon"`` when a sandboxkit daemon measures the consumers of ``sbx`` (a sync or
    async sandbox); ``"client"`` when only this client's own readers are known."""
    inner = getattr(sbx, "async_sandbox", sbx)
    scope = getattr(inner, "metrics_scope", "daemon")
    return scope if isinstance(scope, str) else "daemon"
