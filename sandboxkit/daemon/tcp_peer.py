"""A consumer's TCP connection as the kernel sees it: whether the peer still takes bytes,
and how many the kernel holds for it.

A consumer's send completes as soon as the server's buffers take the bytes, so a peer
that stopped reading (a SIGSTOPped client, a laptop asleep) looks healthy for as long as
those buffers last — many seconds, for a slow producer. The kernel knows sooner: once the
peer's receive window is full, bytes wait in the socket and none go out.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

__all__ = [
    "MAX_SEND_BUFFER",
    "PENDING_BYTES",
    "SEND_BUFFER",
    "size_send_buffer",
    "window_closed_for",
]

SEND_BUFFER = 128 * 1024
"""Kernel send buffer every connection starts with (the kernel doubles it).

A consumer's send completes only when the kernel takes more bytes, and the kernel wakes a
writer only after about half of what it holds drained. An autotuned buffer grows to
megabytes, so a consumer reading steadily but slowly (say 300 KB/s) would show no progress
for seconds and be kicked like a ghost; a bounded buffer keeps its progress visible every
few tens of KB, and bounds the bytes a ghost's connection pins."""

MAX_SEND_BUFFER = 1024 * 1024
"""Largest send buffer a consumer that drains fast is given (:func:`size_send_buffer`)."""


PENDING_BYTES = 16 * 1024
"""Most bytes of a consumer's send that asyncio's transport holds for it beyond what the
kernel took (``http/fast_path.py``, ``AsgiSink.send_parts``).

asyncio's transport copies what it is given: handed each consumer's 1 MiB sends whole, it
held a private copy of what the kernel did not take, 743 KiB a consumer at 400 consumers
of one process (300 MB, benchmarks/memory.py ``--section consumers``), and the heap kept
it after they left. The rest of a send waits instead in the chunks it is made of, which
the log and every other consumer share, and is written to the socket directly once the
transport has written this much. (uvloop's transport keeps references to the parts it is
given, not copies: it gets whole sends.)"""


def size_send_buffer(sock: Any, nbytes: int, current: int) -> int:
    """Set ``sock``'s send buffer to about ``nbytes`` (a power of two, within
    :data:`SEND_BUFFER` .. :data:`MAX_SEND_BUFFER`; the system may cap it lower) unless it
    is ``current`` already; returns the size now set.

    A consumer that drains fast gets the larger buffer: with :data:`SEND_BUFFER` its sends
    mostly fit only in part, and asyncio's transport copies the rest twice and writes it
    in many small pieces (a quarter of the daemon's CPU at 16 consumers,
    benchmarks/compare.py P7); one that drains slowly keeps the small one (above)."""
    size = 1 << (max(nbytes, 1).bit_length() - 1)
    size = min(MAX_SEND_BUFFER, max(SEND_BUFFER, size))
    if size != current:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        except (OSError, AttributeError, ValueError):
            return current
    return size


# Offsets in Linux's ``struct tcp_info`` (include/uapi/linux/tcp.h); stable ABI, fields
# only ever appended. ``tcpi_notsent_bytes`` exists since Linux 4.6.
_LAST_DATA_SENT = slice(44, 48)
"""``tcpi_last_data_sent``: milliseconds since data last left the socket."""
_NOTSENT_BYTES = slice(144, 148)
"""``tcpi_notsent_bytes``: bytes written to the socket and not yet sent."""
_INFO_SIZE = 148


def window_closed_for(sock: Any) -> float | None:
    """Seconds ``sock`` has held bytes it could not send (the peer's receive window is
    full: the peer takes no more), or ``None`` when nothing waits — or when the kernel
    cannot say (not Linux, not TCP, closed)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_SIZE)
    except (OSError, AttributeError, ValueError):
        return None
    if len(info) < _INFO_SIZE or not int.from_bytes(info[_NOTSENT_BYTES], sys.byteorder):
        return None
    return int.from_bytes(info[_LAST_DATA_SENT], sys.byteorder) / 1000
