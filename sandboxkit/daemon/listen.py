"""Binding a listening socket, with an error a person can act on: which address, and
what the daemon wanted it for (the API, the envd endpoint) — not a bare "Address already
in use"."""

from __future__ import annotations

import socket

__all__ = ["bind_or_say"]


def bind_or_say(sock: socket.socket, bind: str, port: int, what: str) -> None:
    """Bind ``sock``; an OSError that names the address and what it was for (closed)."""
    try:
        sock.bind((bind, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno, f"cannot listen on {bind}:{port} for {what}: {exc.strerror or exc}"
        ) from exc
