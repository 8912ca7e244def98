"""Providers: sandboxkit's client and notebook widgets on sandboxes run elsewhere.

``Sandbox.create(provider="e2b", ...)`` returns sandboxkit's own client classes backed by
the official ``e2b`` SDK (:mod:`sandboxkit.providers.e2b`, imported only then). This
package imports no provider SDK itself.
"""

from sandboxkit.providers.base import (
    PROVIDERS,
    ProviderUnavailable,
    ProviderUnsupported,
    UnknownGap,
    load,
    metrics_scope,
)

__all__ = [
    "PROVIDERS",
    "ProviderUnavailable",
    "ProviderUnsupported",
    "UnknownGap",
    "load",
    "metrics_scope",
]
