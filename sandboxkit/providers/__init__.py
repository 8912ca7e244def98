"""Providers: sandboxkit's client and notebook widgets on sandboxes run elsewhere.

This package sits above the client: importing it registers each provider it ships with
the client's loader (:mod:`sandboxkit.client.provider`), so that
``Sandbox.create(provider="e2b", ...)`` finds it — an :class:`AsyncSandbox` holding a
backend of the official ``e2b`` SDK (:mod:`sandboxkit.providers.e2b`, imported only
then). ``import sandboxkit`` imports this package with the client; it imports no
provider SDK itself.
"""

from sandboxkit.client.provider import Provider, load, register
from sandboxkit.providers.base import (
    ProviderUnavailable,
    ProviderUnsupported,
    UnknownGap,
    metrics_scope,
)

__all__ = [
    "ProviderUnavailable",
    "ProviderUnsupported",
    "UnknownGap",
    "load",
    "metrics_scope",
]


def _e2b() -> Provider:
    from sandboxkit.providers.e2b import PROVIDER

    return PROVIDER


register("e2b", _e2b, extra="e2b")
