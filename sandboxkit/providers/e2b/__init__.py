"""The E2B provider: sandboxkit's client — and so its notebook widgets — on E2B sandboxes,
through the official ``e2b`` SDK.

``AsyncSandbox.create(provider="e2b", ...)`` (or the sync ``Sandbox.create``) returns an
:class:`~sandboxkit.client.sandbox.AsyncSandbox` holding an :class:`E2BSandbox` backend:
its commands, files, pause/resume and journal go through ``e2b.AsyncSandbox``. ``ProcessPanel``,
``BackpressureChart``, ``LifecycleTimeline`` and ``SandboxDashboard`` take it as they take a
local sandbox.

Which E2B: ``url=`` names an envd, and the SDK runs in its debug mode against it (no API
calls, so no pause, resume, sandbox list or sandbox kill there; see below); so does
``E2B_DEBUG=1``, or having no API key at all (envd at ``http://localhost:49983``).
Otherwise an API key — ``token=`` or ``E2B_API_KEY`` — selects E2B's cloud.
``provider_options={"debug": ...}`` decides outright; the other ``provider_options`` go
to ``e2b.AsyncSandbox.create`` (``template``, ``api_url``, ``domain``...). The tests
point it at sandboxkit's own envd endpoint, under ``/live`` so that a reattach behaves as
E2B's envd does.

How sandboxkit's model maps onto E2B's:

* **One tap per process.** The provider keeps one SDK stream (the *tap*) open to every
  process it started or was asked to follow, and records what arrives in a bounded
  client-side log (:class:`~sandboxkit.providers.e2b.log.ProcessLog`, 8 MiB by
  default). Readers — a panel, a handle — follow that log from a cursor (bytes of
  output, stdout and stderr together), so a Reattach replays exactly, and a reader that
  falls behind the log's retention gets a
  :class:`~sandboxkit.client.stream.GapInfo` with the true count of bytes this client saw
  and dropped.
* **No replay after nobody was attached.** E2B's envd sends a reconnecting stream only
  output produced after it reconnected. So where the tap was not attached — a process
  started elsewhere and followed from now, a stream cut by a pause or the network and
  reopened — the readers get an :class:`~sandboxkit.client.stream.UnknownGap`: "output
  may be missing here, amount unknown", never a made-up number.
* **Metrics are client-side only.** E2B reports no per-consumer metrics: ``consumers()``
  lists this client's readers and taps, with lag measured against what the tap received
  (not against the process), and ``metrics_scope`` is ``"client"`` so the widgets say so.
* **The journal is this client's.** ``events()``/``raw_events()`` hold what this client did
  and saw (pause, resume, starts, exits, restarts, attaches, gaps), each marked
  ``"source": "client"``; E2B keeps no event journal to read.
* **Kill-restart** is a kill (SIGKILL, E2B's only signal) and a new start of the same
  command, envs and cwd; the new pid is followed from its first byte.
* **Pause/resume** are the SDK's ``pause()`` and ``connect()`` (which resumes): they need
  a control plane — E2B's cloud, or a sandboxkit daemon's (``sandboxkit serve --envd``
  serves one under ``/api``; pass ``provider_options={"api_url": ..., "sandbox_url": ...}``
  or set ``E2B_API_URL``/``E2B_SANDBOX_URL``, and the daemon's token as the API key).
  Taps cut by the pause reopen after the resume, behind an unknown-size gap.
* ``on_timeout="pause"`` and ``auto_resume=True`` go to E2B's ``lifecycle`` (cloud, or a
  sandboxkit daemon's control plane); in debug mode they raise
  :class:`~sandboxkit.errors.ProviderUnsupported`, never silently dropped.
* Text goes through the SDK's UTF-8 decoder, which replaces bytes that are not UTF-8
  (U+FFFD): E2B's SDK gives no raw bytes of a command's stdout/stderr. A ``pty=True``
  process runs through the SDK's pty API, whose output is raw bytes (kept as stdout).

The package's modules share one owner object, :class:`~.session.E2BSession` (the SDK
sandbox, the process logs, the journal, the known state): ``target`` (cloud or debug),
``log`` (one process's client-side log), ``tap`` (the SDK stream that fills it),
``reader`` (what a handle follows), ``journal``, ``commands``, ``files``, ``sandbox`` (the
backends the client classes hold) and ``provider`` (create, connect, list).
"""

from __future__ import annotations

import e2b  # the SDK first: without it, the loader's error names the pip extra

from sandboxkit.providers.e2b.commands import E2BCommands
from sandboxkit.providers.e2b.files import E2BFiles
from sandboxkit.providers.e2b.provider import E2BProvider
from sandboxkit.providers.e2b.sandbox import E2BSandbox
from sandboxkit.providers.e2b.session import E2BSession
from sandboxkit.providers.e2b.target import DEFAULT_ENVD_URL, DEFAULT_LOG_BYTES

__all__ = [
    "DEFAULT_ENVD_URL",
    "DEFAULT_LOG_BYTES",
    "PROVIDER",
    "E2BCommands",
    "E2BFiles",
    "E2BProvider",
    "E2BSandbox",
    "E2BSession",
]

del e2b  # imported for its error only

PROVIDER = E2BProvider()
"""What ``load("e2b")`` returns."""
