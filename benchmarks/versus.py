"""This checkout against another, end to end: each with its own client and daemon, in turns.

Whether a figure measured when an older commit was current still holds cannot be read off
today's machine, whose speed moves by the hour (a bare server's line took 0.24 ms in one
run and 0.48 ms in another, same day). This runs both checkouts now, side by side.
``compare.py --baseline-daemon`` puts another checkout's daemon beside this one's in P1
(fan-out, the daemon's CPU per GB), driven by this checkout's client; what a person sees
of a version also depends on its client. So here each checkout runs in a worker process
of its own, with its ``sandboxkit`` first on ``sys.path`` and its own daemon
(``sandboxkit serve``, unisolated as in ``compare.py``), and bare uvicorn -> httpx in a
third. The driver asks them for one run of a figure in turns, the first of each round
rotating, so that a slow spell falls on all alike, and reports each figure's median over
the rounds and the median of the rounds' ratios.

Figures (``_figures.py``, the client's public API only): a child's line -> ``on_stdout``
p50 and p99 (P3), reattach -> first replayed byte after 1 MB p50 and p99 (P4), a unary
request, ``create()`` + first command back to back, ``run(["true"])`` in a running sandbox,
``pause()`` + ``resume()`` of 4 processes (P5).

    git worktree add --detach ../then <commit>    # or: git archive <commit> | tar -x -C ../then
    python benchmarks/versus.py ../then --rounds 7

The other checkout runs with this environment's packages. One from 2026-12-02 on has a
launcher compiled at install (``hatch_build.py``), which a worktree lacks: copy this
checkout's ``sandboxkit/daemon/sandboxkit-launcher`` into it, or its commands start the
way they do where none was built. Every process started here is stopped here;
everything runs on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BARE = "bare"
N_LINES = 200

# figure -> (its rows, whether bare uvicorn -> httpx measures it too)
FIGURES: dict[str, tuple[tuple[str, ...], bool]] = {
    "lines": (("P3 line -> on_stdout p50, ms", "P3 line -> on_stdout p99, ms"), True),
    "replay": (("P4 reattach -> first byte p50, ms", "P4 reattach -> first byte p99, ms"), True),
    "unary": (("P5 unary request p50, ms",), True),
    "create": (("P5 create() + first command p50, ms",), False),
    "run": (('P5 run(["true"]) p50, ms',), False),
    "pause": (("P5 pause() + resume(), 4 processes, p50, ms",), False),
}


# -- a worker: one checkout's client and daemon, or the bare reference ------------------


def worker(side: str) -> None:
    """Serve figures on stdin/stdout: a request is ``[figure, tries]``, the answer the
    figure's values in ms, one JSON line each."""
    if side != BARE:
        sys.path.insert(0, side)  # before anything imports sandboxkit
    import _figures as f
    from _daemon import local_daemon

    def p(values: list[float], q: float) -> float:
        return f.percentile(values, q) * 1e3

    with contextlib.ExitStack() as stack:
        if side == BARE:
            from compare import _free_port, running  # this checkout's; the other's may differ

            port = _free_port()
            argv = [sys.executable, "-c", f.BARE_REF, str(port), f.LINES]
            ref = stack.enter_context(running(argv, port))
            runs: dict[str, Callable[[int], Any]] = {
                "lines": lambda n: f.bare_lines(port, f.Lines(ref.pid, n)),
                "replay": lambda n: f.bare_replay(port, n),
                "unary": lambda n: f.bare_unary(port, n),
            }
        else:
            daemon, info = stack.enter_context(local_daemon(cwd=Path(side)))
            runs = {
                "lines": lambda n: f.sdk_lines(info, f.Lines(daemon.pid, n)),
                "replay": lambda n: f.sdk_replay(info, n),
                "unary": lambda n: f.sdk_unary(info, n),
                "create": lambda n: f.create_first(info, n, 0.0),
                "run": lambda n: f.run_true(info, n),
                "pause": lambda n: f.pause_resume(info, n),
            }
        print(json.dumps(sys.modules["sandboxkit"].__file__), flush=True)  # which was imported
        for request in sys.stdin:
            figure, n = json.loads(request)
            got = asyncio.run(runs[figure](n))
            if figure == "lines":
                values = [p(got.latencies, 0.5), p(got.latencies, 0.99)]
            elif figure == "replay":
                values = [p(got, 0.5), p(got, 0.99)]
            elif figure == "run":
                values = [statistics.median(got[0]) * 1e3]
            else:
                values = [statistics.median(got) * 1e3]
            print(json.dumps(values), flush=True)


# -- the driver ---------------------------------------------------------------------


class Worker:
    def __init__(self, side: str) -> None:
        self.side = side
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", side],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )

    def ask(self, *request: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if request:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker for {self.side} ended (its error is above)")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def workers(sides: list[str]) -> Iterator[dict[str, Worker]]:
    started: dict[str, Worker] = {}
    try:
        for side in sides:
            started[side] = Worker(side)
        for side, w in started.items():
            found = Path(w.ask())
            if side != BARE and not found.is_relative_to(side):
                raise RuntimeError(f"{side}'s worker imported sandboxkit from {found}")
        yield started
    finally:
        for w in started.values():
            w.close()


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:  # Worker's process
        worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the other checkout (its top directory)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer tries a run")
    parser.add_argument("--figures", nargs="+", choices=list(FIGURES), default=list(FIGURES))
    args = parser.parse_args()
    from compare import wait_idle

    this, other = str(HERE.parent), str(args.other.resolve())
    if not (Path(other) / "sandboxkit" / "__init__.py").is_file():
        parser.error(f"{other} holds no sandboxkit package")
    tries = {"lines": N_LINES, "replay": 30, "unary": 100, "create": 20, "run": 30, "pause": 30}
    if args.quick:
        tries = {k: max(10, v // 3) for k, v in tries.items()}
    # values[side][row] -> one value a round
    values: dict[str, dict[str, list[float]]] = {s: {} for s in (this, other, BARE)}
    wait_idle(30)
    with workers([this, other, BARE]) as ws:
        for r in range(args.rounds):
            for figure in args.figures:
                rows, bare_too = FIGURES[figure]
                sides = [this, other] + ([BARE] if bare_too else [])
                for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                    for row, v in zip(rows, ws[side].ask(figure, tries[figure]), strict=True):
                        values[side].setdefault(row, []).append(v)
            print(f"round {r + 1} of {args.rounds}", file=sys.stderr)
    print(f"\nthis checkout vs {other}, {args.rounds} rounds, in turns\n")
    heads = ["figure", "this", "other", "bare uvicorn -> httpx"]
    heads += ["this ÷ other", "this ÷ bare", "other ÷ bare"]
    print("| " + " | ".join(heads) + " |\n" + "|---" * len(heads) + "|")
    for row in (row for figure in args.figures for row in FIGURES[figure][0]):
        a, b, c = (values[s].get(row) for s in (this, other, BARE))
        assert a is not None and b is not None
        cells = [f"{statistics.median(a):.3f}", f"{statistics.median(b):.3f}"]
        cells += [f"{statistics.median(c):.3f}" if c else "—", f"**{_ratio(a, b):.2f}×**"]
        cells += [f"{_ratio(a, c):.2f}×", f"{_ratio(b, c):.2f}×"] if c else ["—", "—"]
        print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
