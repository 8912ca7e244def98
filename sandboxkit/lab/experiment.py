"""The reattach experiment: pause → resume → reattach → refresh, cycle after cycle.

This is how the public reports measured the stall (a stdio server reattached after a
resume answered the first request and then went silent in 6 of 6 cycles). Here it runs on
real processes and real sockets, under any fan-out policy and ghost kind, and every number
in the resulting table is measured.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pandas as pd

from sandboxkit.client.sandbox import AsyncSandbox
from sandboxkit.lab import stdio_server
from sandboxkit.lab.ghosts import Ghost, make_ghost
from sandboxkit.lab.jsonrpc import REFRESH_METHODS, JsonRpcClient
from sandboxkit.lab_options import (
    FANOUT_POLICIES,
    GHOST_BUFFER,
    GHOST_KINDS,
    QUEUE_POLICIES,
    LabOptions,
)

__all__ = ["CYCLE_COLUMNS", "compare", "lab_options", "reattach_cycles"]

CYCLE_COLUMNS = [
    "policy",
    "ghost",
    "cycle",
    "responses_expected",
    "responses_complete",
    "bytes_received",
    "time_to_first_byte",
    "time_to_complete",
    "stalled",
    "kicks",
    "gaps",
    "t_pause",
    "t_resume",
    "t_reattach",
    "t_first_byte",
    "t_complete",
    "t_kick",
    "deadline",
]


def lab_options(
    policy: str,
    *,
    pause_ghosts: bool,
    kick_grace: float | None = None,
    ghost_buffer: int | None = None,
) -> LabOptions:
    """The sandbox options for one experiment; ValueError for a policy or value the
    daemon would refuse."""
    try:
        return msgspec.convert(
            {
                "fanout": policy,
                "pause_ghosts": pause_ghosts,
                "kick_grace": kick_grace,
                "ghost_buffer": ghost_buffer,
            },
            LabOptions,
        )
    except msgspec.ValidationError as exc:
        raise ValueError(f"{exc} (policies: {', '.join(FANOUT_POLICIES)})") from None


@dataclass
class _Cycle:
    start: float
    wall_start: float
    t_pause: float = math.nan
    t_resume: float = math.nan
    t_reattach: float = math.nan
    t_first_byte: float = math.nan
    t_complete: float = math.nan

    def at(self) -> float:
        return time.monotonic() - self.start


async def reattach_cycles(
    cycles: int = 6,
    policy: str = "cursor",
    ghost: str = "pause-snapshot",
    *,
    deadline: float = 3.0,
    response_size: int = 6000,
    kick_grace: float | None = None,
    ghost_buffer: int = GHOST_BUFFER,
    url: str | None = None,
    token: str | None = None,
    on_cycle: Callable[[dict[str, Any]], Any] | None = None,
) -> pd.DataFrame:
    """Run ``cycles`` reattach cycles in a fresh sandbox; one row per cycle.

    Each cycle: (make a client-side ghost, for ``leaky``/``frozen``) → pause → resume →
    drop the old client → ``connect(pid)`` a new one at the head → send the refresh
    (:data:`~sandboxkit.lab.jsonrpc.REFRESH_METHODS`) at once and wait ``deadline``
    seconds for the answers. A cycle is *stalled* if any answer is missing by then.
    Under ``blocking``/``kick`` the clients connect without a cursor: those policies
    deliver new output only.
    """
    if ghost not in GHOST_KINDS:
        raise ValueError(f"ghost must be one of {', '.join(GHOST_KINDS)}")
    lab = lab_options(
        policy,
        pause_ghosts=ghost == "pause-snapshot",
        kick_grace=kick_grace,
        ghost_buffer=ghost_buffer,
    )
    replays = policy not in QUEUE_POLICIES
    sbx = await AsyncSandbox.create(
        lab=lab,
        url=url,
        token=token,
        metadata={"lab": f"{policy}/{ghost}"},
    )
    rows: list[dict[str, Any]] = []
    ghosts: list[Ghost] = []
    client: JsonRpcClient | None = None
    try:
        # Each response goes out in 1 KiB pieces a moment apart, so that it spans several
        # output chunks, as a real server's larger answers do.
        server = await sbx.commands.start(
            stdio_server.command(response_size=response_size, piece_delay=0.001)
        )
        pid = server.pid
        client = JsonRpcClient(sbx, pid, cursor=0 if replays else None)
        await client.start()
        await client.request("initialize", {"protocolVersion": "2025-06-18"}, deadline=10.0)
        conn = sbx.connection
        for index in range(cycles):
            events_from = await _journal_head(sbx)
            cycle = _Cycle(time.monotonic(), time.time())
            made = await make_ghost(
                ghost, conn.url, conn.token, sbx.sandbox_id, pid, buffer=ghost_buffer
            )
            if made is not None:
                ghosts.append(made)
                await _fill_until_blocked(sbx, client, f"ghost-{made.kind}")
            await sbx.pause()
            cycle.t_pause = cycle.at()
            await sbx.resume()
            cycle.t_resume = cycle.at()
            await client.close()
            head = (await sbx.commands.get(pid)).head
            client = JsonRpcClient(sbx, pid, cursor=head if replays else None)
            await client.start()
            cycle.t_reattach = cycle.at()
            complete = await _refresh(client, deadline)
            if client.first_byte_at is not None:
                cycle.t_first_byte = client.first_byte_at - cycle.start
            if complete == len(REFRESH_METHODS):
                cycle.t_complete = cycle.at()
            events = await sbx.raw_events(since=events_from)
            kicks = [e for e in events if e["kind"] == "consumer.kicked"]
            row = {
                "policy": policy,
                "ghost": ghost,
                "cycle": index,
                "responses_expected": len(REFRESH_METHODS),
                "responses_complete": complete,
                "bytes_received": client.bytes_received,
                "time_to_first_byte": cycle.t_first_byte - cycle.t_reattach,
                "time_to_complete": cycle.t_complete - cycle.t_reattach,
                "stalled": complete < len(REFRESH_METHODS),
                "kicks": len(kicks),
                "gaps": sum(1 for e in events if e["kind"] == "consumer.gap"),
                "t_pause": cycle.t_pause,
                "t_resume": cycle.t_resume,
                "t_reattach": cycle.t_reattach,
                "t_first_byte": cycle.t_first_byte,
                "t_complete": cycle.t_complete,
                "t_kick": min((e["ts"] - cycle.wall_start for e in kicks), default=math.nan),
                "deadline": deadline,
            }
            rows.append(row)
            if on_cycle is not None:
                on_cycle(row)
    finally:
        if client is not None:
            await client.close()
        for made in ghosts:
            await asyncio.to_thread(made.close)
        await sbx.kill()
    frame: pd.DataFrame = pd.DataFrame(rows, columns=CYCLE_COLUMNS)
    return frame


async def _fill_until_blocked(
    sbx: AsyncSandbox, client: JsonRpcClient, name: str, rounds: int = 40
) -> None:
    """Let output go by until the newest client-side ghost is blocked.

    A TCP ghost takes a couple of hundred KiB (its connection's buffers on the daemon's
    side) before it blocks; a ghost left open for a while has taken that already. Filler
    answers of 64 KiB stand in for that while. Under a shared-loop policy the filler may
    itself wedge: then no more output reaches anyone, and filling stops. An answer late
    while some of it arrived is a loaded machine, not a wedge: filling goes on.
    """
    filler = {"name": "echo", "arguments": {"text": "f" * 65536, "pad": False}}
    for _ in range(rounds):
        table = await sbx.consumers()
        ghosts = table[(table["name"] == name) & table["closed_at"].isna()]
        if not ghosts.empty and ghosts.sort_values("attached_at").iloc[-1]["state"] == "blocked":
            return
        received = client.bytes_received
        try:
            await client.request("tools/call", filler, deadline=0.5)
        except TimeoutError:
            if client.bytes_received == received:
                return


async def _journal_head(sbx: AsyncSandbox) -> int:
    events = await sbx.raw_events()
    return int(events[-1]["seq"]) + 1 if events else 0


async def _refresh(client: JsonRpcClient, deadline: float) -> int:
    """Send the refresh requests together; count the answers within ``deadline``."""
    results = await asyncio.gather(
        *(client.request(method, {}, deadline=deadline) for method in REFRESH_METHODS),
        return_exceptions=True,
    )
    return sum(1 for r in results if not isinstance(r, BaseException))


async def compare(
    policies: Sequence[str] = FANOUT_POLICIES,
    ghosts: Sequence[str] = ("pause-snapshot",),
    cycles: int = 6,
    *,
    progress: bool = True,
    **options: Any,
) -> pd.DataFrame:
    """:func:`reattach_cycles` over every policy × ghost kind; one row per cycle, with a
    progress bar (``tqdm``) counting cycles."""
    grid: Iterable[tuple[str, str]] = [(p, g) for p in policies for g in ghosts]
    bar = _progress(len(policies) * len(ghosts) * cycles, progress)
    frames = []
    try:
        for policy, ghost in grid:
            if bar is not None:
                bar.set_description(f"{policy}/{ghost}")
            frames.append(
                await reattach_cycles(
                    cycles,
                    policy,
                    ghost,
                    on_cycle=(lambda _row: bar.update(1)) if bar is not None else None,
                    **options,
                )
            )
    finally:
        if bar is not None:
            bar.close()
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=CYCLE_COLUMNS)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="cycle", file=sys.stderr)
