"""Whether a TCP peer still takes bytes, read from the kernel.

A consumer's send completes as soon as the server's buffers take the bytes, so a peer
that stopped reading (a SIGSTOPped client, a laptop asleep) looks healthy for as long as
those buffers last — many seconds, for a slow producer. The kernel knows sooner: once the
peer's receive window is full, bytes wait in the socket and none go out.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

__all__ = ["window_closed_for"]

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
