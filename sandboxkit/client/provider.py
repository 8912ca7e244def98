"""The provider contract and the loader: how ``create(provider="e2b")`` finds a provider
without the client importing any.

A *provider* runs sandboxes somewhere else (E2B's cloud, an envd) behind the client's own
classes: it makes :class:`~sandboxkit.client.sandbox.AsyncSandbox` objects that hold its
backend (:mod:`sandboxkit.client.backend`). The provider layer sits above the client: the
package :mod:`sandboxkit.providers` registers each provider it ships here, by name, with a
loader that imports it (and its SDK) only when it is first asked for; ``import sandboxkit``
imports that package with the client. The client never imports it.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sandboxkit.errors import ProviderUnavailable
from sandboxkit.vocab import OnTimeout

if TYPE_CHECKING:
    from sandboxkit.client.results import SandboxInfo
    from sandboxkit.client.sandbox import AsyncSandbox

__all__ = ["CreateOptions", "Provider", "known", "load", "register"]


@dataclass(frozen=True)
class CreateOptions:
    """What ``AsyncSandbox.create`` passes a provider: every option a provider may honour
    (a provider refuses, with :class:`~sandboxkit.errors.ProviderUnsupported`, one it has
    no equivalent of; none is dropped)."""

    timeout: float | None
    on_timeout: OnTimeout
    auto_resume: bool
    envs: dict[str, str] | None
    metadata: dict[str, str] | None
    url: str | None
    token: str | None
    options: dict[str, Any]
    """``provider_options``: the provider's own."""


class Provider(Protocol):
    """A provider: it creates, connects to and lists its sandboxes. ``url``/``token``
    are the provider's (E2B: an envd URL or API URL, an API key); ``options`` its own."""

    async def create(self, options: CreateOptions) -> AsyncSandbox: ...

    async def connect(
        self, sandbox_id: str, *, url: str | None, token: str | None, options: dict[str, Any]
    ) -> AsyncSandbox: ...

    async def list_sandboxes(
        self, *, url: str | None, token: str | None, options: dict[str, Any]
    ) -> builtins.list[SandboxInfo]: ...


@dataclass(frozen=True)
class _Entry:
    load: Callable[[], Provider]
    extra: str
    """The pip extra that installs the provider's SDK (``pip install 'sandboxkit[e2b]'``),
    and the name of the SDK's top-level module."""


_PROVIDERS: dict[str, _Entry] = {}


def register(name: str, load: Callable[[], Provider], *, extra: str) -> None:
    """Make ``name`` a provider: ``load()`` imports it (its SDK with it) and returns it,
    when ``create(provider=name)`` first asks. ``extra``: the pip extra of its SDK."""
    _PROVIDERS[name] = _Entry(load, extra)


def known() -> builtins.list[str]:
    """The names of the registered providers."""
    return sorted(_PROVIDERS)


def load(name: str) -> Provider:
    """The provider ``name``, loaded now. :class:`ProviderUnavailable` for an unknown name
    or an SDK that is not installed (the message names the ``pip install``)."""
    try:
        entry = _PROVIDERS[name]
    except KeyError:
        raise ProviderUnavailable(
            f"no provider {name!r} (known: "
            f"{', '.join(known()) or 'none registered; import sandboxkit.providers'})",
            provider=name,
        ) from None
    try:
        return entry.load()
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != entry.extra:
            raise
        raise ProviderUnavailable(
            f"the {name!r} provider needs the {entry.extra} SDK: "
            f"pip install 'sandboxkit[{entry.extra}]'",
            provider=name,
        ) from exc
