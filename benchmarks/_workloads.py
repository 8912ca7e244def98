"""Processes the benchmarks run in sandboxes (imported as ``_workloads``)."""

from __future__ import annotations

PRODUCER = (
    "import sys, time\n"
    "block = b'y' * 65536\n"
    "out = sys.stdout.buffer\n"
    "start, sent = time.monotonic(), 0\n"
    "while True:\n"
    "    out.write(block)\n"
    "    out.flush()\n"
    "    sent += len(block)\n"
    "    ahead = sent / {rate} - (time.monotonic() - start)\n"
    "    if ahead > 0:\n"
    "        time.sleep(ahead)\n"
)
"""Writes 64 KiB blocks at ``rate`` bytes per second until it is killed."""
