"""The fault lab, measured: the stalls of F1/F2 reproduced on purpose against the
in-process daemon, the fix (``cursor``) immune on the same workload, the ghost makers
themselves, and ``sandboxkit demo`` end to end.

Every assertion is on a measured outcome (stall counts, responses and bytes received,
delays, consumer states), with bounds rather than constants.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import psutil
import pytest
from support import LoopHold, child_env, fast_config
from support import poll as _poll

from sandboxkit import AsyncSandbox
from sandboxkit.daemon.config import DaemonConfig, LabDefaults
from sandboxkit.daemon.faults.ghost import GhostSink
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.lab import stdio_server
from sandboxkit.lab.experiment import _fill_until_blocked, reattach_cycles
from sandboxkit.lab.ghosts import FrozenClient, LeakyClient, make_ghost
from sandboxkit.lab.jsonrpc import REFRESH_METHODS as REFRESH
from sandboxkit.lab.jsonrpc import JsonRpcClient
from sandboxkit.lab_options import LabOptions

REPO = Path(__file__).resolve().parents[1]

KICK_QUEUE = 4
"""Chunks per consumer queue under ``kick``: small, so a ghost's queue fills fast."""

GHOST_FILL_RESPONSE = 100_000
"""Response size that fills a TCP ghost (leaky, frozen) within the first cycle: its
buffers (the daemon's socket send buffer plus the HTTP server's write buffer) take about
250 KB on Linux loopback, and one refresh is three responses."""

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def daemon_config() -> DaemonConfig:
    return fast_config(lab=LabDefaults(kick_queue=KICK_QUEUE))


async def _async(value: Any) -> Any:
    """``value``, as an awaitable (for :func:`_poll` on a plain condition)."""
    return value


class GhostProbe:
    """An ``on_cycle`` callback that records, at the end of each cycle, the daemon's view
    of every open ghost consumer (a sync HTTP call: the daemon runs on its own thread)."""

    def __init__(self, conn: dict[str, str]) -> None:
        self.conn = conn
        self.ghosts: dict[int, list[dict[str, Any]]] = {}

    def __call__(self, row: dict[str, Any]) -> None:
        response = httpx.get(
            self.conn["url"] + "/consumers",
            headers={"Authorization": f"Bearer {self.conn['token']}"},
            timeout=5,
        )
        response.raise_for_status()
        self.ghosts[int(row["cycle"])] = [
            c for c in response.json() if c["ghost"] or str(c["name"]).startswith("ghost-")
        ]

    def wedged(self, cycle: int) -> list[dict[str, Any]]:
        """Ghost consumers whose send was stuck (or that were kicked for it) at the end of
        ``cycle``."""
        return [c for c in self.ghosts.get(cycle, []) if c["state"] in ("blocked", "kicked")]

    def first_wedged_cycle(self) -> int | None:
        return next((i for i in sorted(self.ghosts) if self.wedged(i)), None)


def _show(frame: pd.DataFrame) -> str:
    columns = [
        "policy",
        "ghost",
        "cycle",
        "responses_complete",
        "bytes_received",
        "time_to_complete",
        "stalled",
        "kicks",
    ]
    return "\n" + frame[columns].to_string(index=False)


# -- 1. F1 as shipped: blocking + pause-snapshot ghosts --------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_blocking_with_pause_snapshot_ghosts_stalls_after_the_first_output(
    conn: dict[str, str],
) -> None:
    frame = await reattach_cycles(6, "blocking", "pause-snapshot", deadline=1.0, **conn)

    assert list(frame["cycle"]) == list(range(6))
    assert (frame["responses_expected"] == len(REFRESH)).all()
    stalled = frame[frame["stalled"]]
    assert len(stalled) >= 5, f"expected >= 5/6 stalled cycles:{_show(frame)}"
    # A stalled cycle is one whose refresh did not complete by the deadline.
    assert (stalled["responses_complete"] < len(REFRESH)).all()
    assert stalled["time_to_complete"].isna().all()
    # Every reattach itself succeeded (a start frame, then silence), in every cycle.
    assert frame["t_reattach"].notna().all()
    # The signature of the public reports: the first answer (or part of the output)
    # still arrives, then nothing more ...
    partial = stalled[
        ((stalled["responses_complete"] > 0) & (stalled["responses_complete"] < len(REFRESH)))
        | (stalled["bytes_received"] > 0)
    ]
    assert not partial.empty, f"no stalled cycle received anything at all:{_show(frame)}"
    # ... and once the shared loop is wedged, later fresh reattaches get no byte at all.
    first_partial = int(partial["cycle"].min())
    later = frame[frame["cycle"] > first_partial]
    assert not later.empty
    assert later["stalled"].all(), _show(frame)
    assert (later["bytes_received"] == 0).all(), _show(frame)
    assert later["time_to_first_byte"].isna().all()


async def test_a_pause_snapshot_ghost_takes_no_byte_however_large_the_send() -> None:
    """A ghost's socket comes back from the snapshot full: a send of one byte or of a
    whole chunk blocks alike, so what gets past a ghost never depends on how the output
    after the restore happens to be chunked (a loaded machine reads larger chunks)."""
    ghost = await GhostSink.open()
    try:
        for size in (1, 256 * 1024):
            send = asyncio.ensure_future(ghost.send(b"x" * size))
            done, _ = await asyncio.wait({send}, timeout=0.2)
            send.cancel()
            await asyncio.gather(send, return_exceptions=True)
            assert not done, f"the ghost took a send of {size} bytes"
    finally:
        await ghost.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_blocking_stalls_while_the_daemons_loop_runs_late(daemon: DaemonServer) -> None:
    """Held up at every turn, the daemon reads the server's answers in larger chunks;
    the ghost still wedges ``blocking`` (it used to take whole chunks, and a cycle read
    "not stalled" on a loaded machine), and ``cursor`` still answers in full."""
    assert daemon.loop is not None
    conn = {"url": daemon.url, "token": daemon.token}
    hold = LoopHold(daemon.loop, 0.008)
    try:
        for policy, stalled in (("blocking", True), ("cursor", False)):
            frame = asyncio.run(reattach_cycles(1, policy, "pause-snapshot", deadline=1.0, **conn))
            assert list(frame["stalled"]) == [stalled], _show(frame)
    finally:
        hold.stop()


# -- 2. the fix: cursor is immune to every ghost kind ------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("ghost", "response_size"),
    [
        # The exact workload that stalls ``blocking`` in the test above ...
        ("pause-snapshot", 6000),
        # ... and the one that fills TCP ghosts and stalls ``blocking`` below.
        pytest.param("leaky", GHOST_FILL_RESPONSE, marks=pytest.mark.slow),
        pytest.param("frozen", GHOST_FILL_RESPONSE, marks=pytest.mark.slow),
    ],
)
async def test_cursor_never_stalls_whatever_the_ghost(
    conn: dict[str, str], ghost: str, response_size: int
) -> None:
    deadline = 2.0
    probe = GhostProbe(conn)
    frame = await reattach_cycles(
        3,
        "cursor",
        ghost,
        deadline=deadline,
        response_size=response_size,
        on_cycle=probe,
        **conn,
    )

    assert len(frame) == 3
    assert not frame["stalled"].any(), _show(frame)
    assert (frame["responses_complete"] == len(REFRESH)).all()
    # Every cycle got every byte of the three responses (each a line of response_size).
    assert (frame["bytes_received"] >= len(REFRESH) * response_size).all(), _show(frame)
    # Well within the deadline, not just under it.
    assert (frame["time_to_complete"] < deadline / 2).all(), _show(frame)
    assert (frame["time_to_first_byte"] < frame["time_to_complete"]).all()
    # The ghosts were real: by the last cycle at least one had a send stuck on its full
    # buffers, and nobody else noticed. (A send shows as blocked once stuck for 0.2 s;
    # three fast cycles can take less, so look again, with a deadline, after the last.)
    last = int(frame["cycle"].max())

    async def wedged_after_last() -> bool:
        probe({"cycle": last})
        return bool(probe.wedged(last))

    if not probe.wedged(last):
        await _poll(wedged_after_last, 2, f"a wedged ghost by the end: {probe.ghosts}")


# -- 3. F2 as shipped: kick + k ghosts delays a refresh by k x grace, serially ----------

KICK_RESPONSE = (300_000 + KICK_QUEUE * DaemonConfig().read_chunk) * 2 // 3
"""Three of these per refresh overflow every TCP ghost twice over: ~250 KB of socket
buffers plus KICK_QUEUE chunks of at most ``read_chunk`` (the refresh writes each at once,
so its chunks are that large)."""


class TimedRpcClient(JsonRpcClient):
    """A JSON-RPC client that notes when each piece of output arrives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arrivals: list[float] = []

    def feed(self, text: str) -> None:
        # Wall-clock time, to be set against the daemon's event timestamps.
        self.arrivals.append(time.time())
        super().feed(text)


@dataclass
class Refresh:
    started: float
    """When the three requests were sent (wall clock)."""
    arrivals: list[float]
    """When each piece of the answers arrived (wall clock)."""

    @property
    def elapsed(self) -> float:
        """Seconds from sending the three requests to the last answer."""
        return self.arrivals[-1] - self.started

    def silence_within(self, start: float, end: float) -> float:
        """Seconds of ``start .. end`` in which the client received nothing."""
        marks = [self.started, *self.arrivals]
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in itertools.pairwise(marks))


async def _refresh(client: TimedRpcClient) -> Refresh:
    client.arrivals.clear()
    started = time.time()
    results = await asyncio.gather(
        *(client.request(method, {}, deadline=10.0) for method in REFRESH)
    )
    assert len(results) == len(REFRESH)
    return Refresh(started, list(client.arrivals))


async def _kick_run(
    conn: dict[str, str], ghosts: int, grace: float
) -> tuple[list[dict[str, Any]], Refresh, list[dict[str, Any]]]:
    """In a fresh ``kick`` sandbox: a refresh with no ghost, then ``ghosts`` leaky clients
    attach and the same refresh again; the kicks during the first, the second's timings
    and its kicks."""
    sbx = await AsyncSandbox.create(lab=LabOptions(fanout="kick", kick_grace=grace), **conn)
    made: list[LeakyClient] = []
    client: TimedRpcClient | None = None
    try:
        # Big pieces: the server writes the whole refresh at once, so the time measured is
        # the fan-out's, not the server's.
        server = await sbx.commands.start(
            stdio_server.command(response_size=KICK_RESPONSE, piece_size=65536)
        )
        client = TimedRpcClient(sbx, server.pid, cursor=0)
        await client.start()
        await client.request("initialize", {}, deadline=10.0)
        await _refresh(client)
        baseline_kicks = [e for e in await sbx.raw_events() if e["kind"] == "consumer.kicked"]
        for _ in range(ghosts):
            made.append(
                await asyncio.to_thread(
                    LeakyClient, conn["url"], conn["token"], sbx.sandbox_id, server.pid
                )
            )
        events = await sbx.raw_events()
        since = int(events[-1]["seq"]) + 1 if events else 0
        ghosted = await _refresh(client)
        kicks = [e for e in await sbx.raw_events(since) if e["kind"] == "consumer.kicked"]
        return baseline_kicks, ghosted, kicks
    finally:
        if client is not None:
            await client.close()
        for ghost in made:
            ghost.close()
        await sbx.kill()


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_kick_delays_a_refresh_by_k_times_the_grace_one_ghost_after_another(
    conn: dict[str, str],
) -> None:
    grace = 0.5
    quiet1, one, one_kicks = await _kick_run(conn, 1, grace)
    quiet2, two, two_kicks = await _kick_run(conn, 2, grace)
    # What is asserted is cause and order, read off the daemon's kick events and the
    # client's arrival times, not how long a refresh takes: on a loaded machine any
    # refresh can pause for most of a second with no ghost at all.

    # No ghost, nothing kicked: the shared loop never waited a grace out.
    assert quiet1 == [] and quiet2 == [], (quiet1, quiet2)
    # Each ghost is kicked once, for its full queue, after the grace; the healthy client
    # never is.
    for kicks, k in ((one_kicks, 1), (two_kicks, 2)):
        assert len(kicks) == k, kicks
        assert all(e["reason"] == "queue_full" for e in kicks), kicks
        assert all(e["data"]["name"] == "ghost-leaky" for e in kicks), kicks
        assert all(e["data"]["blocked_for"] == pytest.approx(grace) for e in kicks), kicks
    for refresh, kicks in ((one, one_kicks), (two, two_kicks)):
        windows = [(e["ts"] - e["data"]["blocked_for"], e["ts"]) for e in kicks]
        # The kicks happen during the refresh, and it cannot finish before the graces
        # ran out ...
        assert all(refresh.started <= start for start, _ in windows), (refresh, kicks)
        assert refresh.arrivals[-1] >= max(end for _, end in windows), (refresh, kicks)
        # ... and while the shared loop waits out a ghost's grace, the healthy client gets
        # nothing: it is the ghost that holds the refresh up (the tail of what was already
        # in its queue and socket may still land at the window's start).
        for start, end in windows:
            silent = refresh.silence_within(start, end)
            assert silent >= 0.7 * (end - start), (silent, refresh, kicks)
    # ... serially, inside the one shared loop: the second ghost's grace starts when the
    # first one's is over, so two ghosts cost about twice one.
    first, second = sorted(e["ts"] for e in two_kicks)
    assert second - first >= 0.8 * grace, two_kicks
    assert two.elapsed >= 2 * 0.95 * grace and one.elapsed >= 0.95 * grace, (one, two)


# -- 4. the client-side ghosts wedge blocking too --------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ghost", ["leaky", "frozen"])
async def test_leaky_and_frozen_ghosts_wedge_blocking_once_their_buffers_fill(
    conn: dict[str, str], ghost: str
) -> None:
    probe = GhostProbe(conn)
    frame = await reattach_cycles(
        3,
        "blocking",
        ghost,
        deadline=1.0,
        response_size=GHOST_FILL_RESPONSE,
        on_cycle=probe,
        **conn,
    )

    assert len(frame) == 3
    # The first ghost fills within the first two cycles (~300 KB of output per cycle).
    first = probe.first_wedged_cycle()
    assert first is not None and first <= 1, (probe.ghosts, _show(frame))
    absorbed = max(c["bytes_sent"] for c in probe.wedged(first))
    assert absorbed < 2 * len(REFRESH) * GHOST_FILL_RESPONSE, absorbed
    # No stall before the first ghost is full; every cycle after it stalls, and its fresh
    # reattach gets nothing at all (the one shared loop is stuck on the ghost for good).
    assert not frame[frame["cycle"] < first]["stalled"].any(), _show(frame)
    after = frame[frame["cycle"] > first]
    assert after["stalled"].all(), _show(frame)
    assert (after["bytes_received"] == 0).all(), _show(frame)
    assert int(frame["stalled"].sum()) >= 2, _show(frame)
    # Nobody is kicked under ``blocking``: the wedge lasts.
    assert int(frame["kicks"].sum()) == 0
    for cycle in range(first, 3):
        assert probe.wedged(cycle), probe.ghosts


# -- 5. sandboxkit demo end to end --------------------------------------------------------


def _env(state_path: Path) -> dict[str, str]:
    env = child_env()
    env["SANDBOXKIT_STATE_FILE"] = str(state_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_demo_writes_csv_and_pngs_that_match_its_printed_table(tmp_path: Path) -> None:
    state_path = tmp_path / "state" / "daemon.json"
    out = tmp_path / "out"
    env = _env(state_path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "sandboxkit",
            "demo",
            "--cycles",
            "2",
            "--policies",
            "blocking",
            "cursor",
            "--deadline",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # It ran on a daemon of its own, which it stopped: the default one was never started.
    private = re.search(r"on a private daemon, pid (\d+) at http://127\.0\.0\.1:\d+", result.stdout)
    assert private, result.stdout
    assert not _alive(int(private[1])), "the demo's daemon is still running"
    assert not state_path.exists(), "the demo started the default daemon"
    assert f"wrote into {out.resolve()}" in result.stdout, result.stdout

    # The printed table: one row per policy with its "k/n" stalls.
    printed: dict[str, tuple[int, int]] = {}
    for line in result.stdout.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[0] in ("blocking", "cursor"):
            match = re.fullmatch(r"(\d+)/(\d+)", cells[2])
            assert match, line
            printed[cells[0]] = (int(match[1]), int(match[2]))
    assert set(printed) == {"blocking", "cursor"}, result.stdout

    cycles = pd.read_csv(out / "cycles.csv")
    assert len(cycles) == 4
    assert set(cycles["ghost"]) == {"pause-snapshot"}
    from_csv = {
        policy: (int(group["stalled"].astype(bool).sum()), len(group))
        for policy, group in cycles.groupby("policy")
    }
    assert from_csv == printed, (from_csv, result.stdout)

    table = pd.read_csv(out / "stall_table.csv")
    from_table = {
        row["policy"]: (int(row["stalled_cycles"]), int(row["cycles"]))
        for _, row in table.iterrows()
    }
    assert from_table == printed
    assert {row["policy"]: row["stalls"] for _, row in table.iterrows()} == {
        policy: f"{k}/{n}" for policy, (k, n) in printed.items()
    }
    # The measured outcome itself: the shipped design stalls, the fix does not.
    assert printed["blocking"][0] >= 1 and printed["cursor"][0] == 0, result.stdout

    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} >= {"stall_rates.png", "timeline.png"}
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC), png
        assert len(data) > 1000, png


# -- 6. the ghost makers themselves -------------------------------------------------------

# Writes 2 MB once stdin says go, then waits for stdin to close.
WRITER = (
    "import sys\n"
    "sys.stdin.readline()\n"
    "out = sys.stdout.buffer\n"
    "for _ in range(200):\n"
    "    out.write(b'x' * 9999 + b'\\n')\n"
    "    out.flush()\n"
    "sys.stdin.read()\n"
)
WRITTEN = 200 * 10_000


async def _ghost_row(sbx: AsyncSandbox, name: str) -> dict[str, Any] | None:
    rows = [r for r in (await sbx.consumers()).to_dict("records") if r["name"] == name]
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["leaky", "frozen"])
async def test_ghost_maker_attaches_then_stops_reading(conn: dict[str, str], kind: str) -> None:
    name = f"ghost-{kind}"
    async with await AsyncSandbox.create(**conn) as sbx:
        process = await sbx.commands.start([sys.executable, "-c", WRITER])
        ghost = await make_ghost(kind, conn["url"], conn["token"], sbx.sandbox_id, process.pid)
        assert ghost is not None and ghost.kind == kind
        try:
            # It attached: the daemon has a live consumer for it.
            row = await _poll(lambda: _ghost_row(sbx, name), 10, f"{name} consumer")
            assert pd.isna(row["closed_at"])
            assert row["state"] == "streaming"
            if isinstance(ghost, FrozenClient):
                reader = psutil.Process(ghost.process.pid)
                await _poll(
                    lambda: _async(reader.status() == psutil.STATUS_STOPPED),
                    5,
                    "the frozen reader to be stopped",
                )

            # The process writes a lot: the ghost's send gets stuck on its full buffers.
            await sbx.commands.send_stdin(process.pid, b"go\n")

            async def blocked() -> dict[str, Any] | None:
                row = await _ghost_row(sbx, name)
                return row if row is not None and row["state"] == "blocked" else None

            row = await _poll(blocked, 10, f"{name} to be blocked")
            assert 0 < row["bytes_sent"] < WRITTEN, row
            assert row["lag_bytes"] > 0, row
            # It really stopped: no progress while the output sits there.
            await asyncio.sleep(0.3)  # sleep-ok: observation window
            again = await _ghost_row(sbx, name)
            assert again is not None and again["bytes_sent"] == row["bytes_sent"], again
        finally:
            await asyncio.to_thread(ghost.close)

        if isinstance(ghost, FrozenClient):
            # close() ended the reader: exited, reaped, no process left.
            assert ghost.process.returncode is not None
            assert not _alive(ghost.process.pid)

        # Releasing the ghost releases its consumer (it is detached, not left to a kick).
        async def gone() -> dict[str, Any] | None:
            row = await _ghost_row(sbx, name)
            return row if row is not None and row["state"] in ("closed", "kicked") else None

        row = await _poll(gone, 10, f"{name} to be released")
        assert row["state"] == "closed", row


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["leaky", "frozen"])
async def test_ghost_maker_refuses_an_error_response(conn: dict[str, str], kind: str) -> None:
    """A ghost must be a real consumer: attaching to an unknown process (an error
    response, no stream) fails instead of yielding a ghost that wedges nothing."""
    async with await AsyncSandbox.create(**conn) as sbx:
        with pytest.raises(ConnectionError, match=r"HTTP/1\.1 4\d\d"):
            await make_ghost(kind, conn["url"], conn["token"], sbx.sandbox_id, 999_999)
        consumers = await sbx.consumers()
        assert consumers.empty


class _Consumers:
    """A sandbox's consumer table in which the ghost turns ``blocked`` once it has been
    looked at ``blocked_after`` times."""

    def __init__(self, blocked_after: int) -> None:
        self.looks = 0
        self.blocked_after = blocked_after

    async def consumers(self) -> pd.DataFrame:
        self.looks += 1
        state = "blocked" if self.looks > self.blocked_after else "streaming"
        row = {"name": "ghost-tcp", "closed_at": None, "attached_at": 1.0, "state": state}
        return pd.DataFrame([row])


class _SlowFiller:
    """A client whose every filler answer misses its deadline; ``flowing``: with some of
    its bytes arriving meanwhile (a loaded machine), else none (the output wedged)."""

    def __init__(self, flowing: bool) -> None:
        self.flowing = flowing
        self.requests = 0
        self.bytes_received = 0

    async def request(self, method: str, params: dict[str, Any], deadline: float) -> Any:
        self.requests += 1
        if self.flowing:
            self.bytes_received += 4096
        raise TimeoutError


async def test_filling_goes_on_past_a_slow_answer_while_output_flows() -> None:
    # On a loaded machine a filler's answer can take longer than its deadline while the
    # output still flows: that is not the wedge that ends the filling (nothing reaching
    # this client either), so the ghost is filled until it blocks, and the cycle that
    # follows measures the stall the policy makes (was: filling stopped at the first slow
    # answer, and a blocking policy's cycle could read "not stalled").
    sbx, client = _Consumers(blocked_after=3), _SlowFiller(flowing=True)
    await _fill_until_blocked(sbx, client, "ghost-tcp")  # type: ignore[arg-type]
    assert client.requests == 3 and sbx.looks == 4
    # Nothing arrives at all: the output is wedged, filling stops at once.
    sbx, client = _Consumers(blocked_after=3), _SlowFiller(flowing=False)
    await _fill_until_blocked(sbx, client, "ghost-tcp")  # type: ignore[arg-type]
    assert client.requests == 1
