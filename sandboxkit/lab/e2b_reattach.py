"""The reattach experiment with the official ``e2b`` SDK as the client.

The same cycle as :func:`sandboxkit.lab.experiment.reattach_cycles` — pause, resume,
reattach, refresh — but the stdio server is started, fed and read through the e2b SDK
(debug mode, against the daemon's envd endpoint): pause and resume go through sandboxkit,
the reattach is e2b's ``commands.connect(pid)``. The e2b stream open at the pause becomes
a pause-snapshot ghost in the daemon, as a snapshot restore leaves one behind in envd.
Under ``blocking`` the ghost wedges the shared loop and the refresh stalls; under
``cursor`` it does not.

Needs the ``e2b`` package (``pip install e2b``).
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import time
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from sandboxkit.client.sandbox import AsyncSandbox
from sandboxkit.lab import stdio_server
from sandboxkit.lab.experiment import CYCLE_COLUMNS, lab_options
from sandboxkit.lab.jsonrpc import REFRESH_METHODS as REFRESH
from sandboxkit.lab_options import GHOST_BUFFER

__all__ = ["compare_e2b", "e2b_reattach_cycles"]

GHOST = "pause-snapshot"


class _E2BRpc:
    """JSON-RPC over an e2b command: requests by ``send_stdin``, responses from the
    ``on_stdout`` of the current e2b handle, matched by id."""

    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox
        self.pid = -1
        self.handle: Any = None
        self.first_response_at: float | None = None
        self.bytes_received = 0
        self._next_id = 0
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._buffer = ""

    def feed(self, text: str) -> None:
        self.bytes_received += len(text.encode())
        self._buffer += text
        *lines, self._buffer = self._buffer.split("\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            future = self._pending.pop(message.get("id", -1), None)
            if future is not None and not future.done():
                if self.first_response_at is None:
                    self.first_response_at = time.monotonic()
                future.set_result(message)

    async def request(self, method: str, deadline: float) -> Any:
        self._next_id += 1
        rid = self._next_id
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        line = json.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": {}})
        try:
            await self.sandbox.commands.send_stdin(self.pid, line + "\n")
            return await asyncio.wait_for(future, deadline)
        finally:
            self._pending.pop(rid, None)

    async def reattach(self) -> None:
        """Drop the current handle (a pause cut its stream) and ``connect(pid)`` anew."""
        await self.drop()
        self._buffer = ""
        self.first_response_at = None
        self.bytes_received = 0
        self.handle = await self.sandbox.commands.connect(self.pid, timeout=0, on_stdout=self.feed)

    async def drop(self) -> None:
        if self.handle is not None:
            await self.handle.disconnect()
            self.handle = None


async def e2b_reattach_cycles(
    cycles: int = 6,
    policy: str = "cursor",
    *,
    url: str,
    token: str | None,
    envd_url: str,
    deadline: float = 3.0,
    response_size: int = 6000,
    kick_grace: float | None = None,
    ghost_buffer: int = GHOST_BUFFER,
    on_cycle: Callable[[dict[str, Any]], Any] | None = None,
) -> pd.DataFrame:
    """Run ``cycles`` e2b reattach cycles in a fresh sandbox of the daemon at ``url``
    whose envd endpoint is ``envd_url``; one row per cycle (:data:`CYCLE_COLUMNS`)."""
    from e2b import AsyncSandbox as E2BSandbox

    sbx = await AsyncSandbox.create(
        lab=lab_options(
            policy, pause_ghosts=True, kick_grace=kick_grace, ghost_buffer=ghost_buffer
        ),
        url=url,
        token=token,
        metadata={"lab": f"{policy}/e2b"},
    )
    rows: list[dict[str, Any]] = []
    rpc: _E2BRpc | None = None
    try:
        e2b = await E2BSandbox.create(
            debug=True, sandbox_url=f"{envd_url}/sandboxes/{sbx.sandbox_id}"
        )
        rpc = _E2BRpc(e2b)
        argv = stdio_server.command(response_size=response_size, piece_delay=0.001)
        rpc.handle = await e2b.commands.run(
            shlex.join(argv), background=True, stdin=True, timeout=0, on_stdout=rpc.feed
        )
        rpc.pid = rpc.handle.pid
        await rpc.request("initialize", deadline=10.0)
        for index in range(cycles):
            events = await sbx.raw_events()
            events_from = int(events[-1]["seq"]) + 1 if events else 0
            start, wall_start = time.monotonic(), time.time()
            await sbx.pause()
            t_pause = time.monotonic() - start
            await sbx.resume()
            t_resume = time.monotonic() - start
            await rpc.reattach()
            t_reattach = time.monotonic() - start
            results = await asyncio.gather(
                *(rpc.request(method, deadline) for method in REFRESH), return_exceptions=True
            )
            complete = sum(1 for r in results if not isinstance(r, BaseException))
            t_complete = time.monotonic() - start if complete == len(REFRESH) else math.nan
            t_first = (
                rpc.first_response_at - start if rpc.first_response_at is not None else math.nan
            )
            events = await sbx.raw_events(since=events_from)
            kicks = [e for e in events if e["kind"] == "consumer.kicked"]
            row = {
                "policy": policy,
                "ghost": GHOST,
                "cycle": index,
                "responses_expected": len(REFRESH),
                "responses_complete": complete,
                "bytes_received": rpc.bytes_received,
                "time_to_first_byte": t_first - t_reattach,
                "time_to_complete": t_complete - t_reattach,
                "stalled": complete < len(REFRESH),
                "kicks": len(kicks),
                "gaps": sum(1 for e in events if e["kind"] == "consumer.gap"),
                "t_pause": t_pause,
                "t_resume": t_resume,
                "t_reattach": t_reattach,
                "t_first_byte": t_first,
                "t_complete": t_complete,
                "t_kick": min((e["ts"] - wall_start for e in kicks), default=math.nan),
                "deadline": deadline,
            }
            rows.append(row)
            if on_cycle is not None:
                on_cycle(row)
    finally:
        if rpc is not None:
            await rpc.drop()
        await sbx.kill()
    result: pd.DataFrame = pd.DataFrame(rows, columns=CYCLE_COLUMNS)
    return result


async def compare_e2b(
    policies: Sequence[str] = ("blocking", "cursor"),
    cycles: int = 6,
    **options: Any,
) -> pd.DataFrame:
    """:func:`e2b_reattach_cycles` under each policy; one row per cycle."""
    frames = [await e2b_reattach_cycles(cycles, policy, **options) for policy in policies]
    frame: pd.DataFrame = pd.concat(frames, ignore_index=True)
    return frame
