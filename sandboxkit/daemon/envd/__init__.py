"""An envd-compatible endpoint: the official ``e2b`` SDK drives sandboxkit sandboxes.

See :mod:`sandboxkit.daemon.envd.app` for how URLs map to sandboxes, and ``docs/e2b.md``.
"""

from sandboxkit.daemon.envd.app import DEFAULT_PORT, EnvdServer, create_envd_app

__all__ = ["DEFAULT_PORT", "EnvdServer", "create_envd_app"]
