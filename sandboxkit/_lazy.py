"""Names a package exports but imports only on first use (PEP 562).

The daemon shares the ``sandboxkit`` package with the client, and the stdio workload server
shares ``sandboxkit.lab``: neither may pay for (or even have) httpx, pandas or the widgets.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, where ``where`` maps each lazy
    name to the submodule (relative to ``package``) that defines it. A name is imported
    once, then kept in the package's namespace."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
