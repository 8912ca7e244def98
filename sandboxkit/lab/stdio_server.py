"""A stdio JSON-RPC 2.0 server shaped like an MCP server: the lab's workload.

Run it as ``python -m sandboxkit.lab.stdio_server``. It reads newline-delimited JSON
requests on stdin and answers each with one JSON line on stdout. The list methods
(``tools/list``, ``resources/list``, ``prompts/list``) and ``tools/call`` answer with a
line of ``--response-size`` bytes (default 6000: several KB per response, like a real MCP
server's catalogue; padded exactly, unless the bare response is already longer), and
every line is written in pieces of ``--piece-size`` bytes with a flush after each, so that
one response spans several output chunks in the daemon — the shape under which the public
reports saw a stdio server go silent after a response or two. ``--piece-delay SECONDS``
sleeps between pieces, so that even a fast reader sees them as separate chunks.

Methods: ``initialize``, ``ping``, ``tools/list``, ``resources/list``, ``prompts/list`` and
``tools/call`` with ``{"name": "echo", "arguments": {"text": ..., "pad": true}}``.
A message without an ``id`` is a notification and gets no answer. Errors follow JSON-RPC:
``-32700`` parse error (id null), ``-32600`` invalid request, ``-32601`` unknown method,
``-32602`` bad params, ``-32603`` internal error. Bad input never ends the server; stdin
EOF ends it with status 0.

``--chatter-rate HZ`` adds ``notifications/message`` lines at that rate from a background
thread; a lock around each whole line keeps them from splitting a response.

Pure standard library, so it starts fast and runs under any interpreter of the project.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

__all__ = [
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "PROTOCOL_VERSION",
    "LineWriter",
    "Padded",
    "RpcFailure",
    "ServerConfig",
    "StdioServer",
    "command",
    "encode",
    "main",
    "pad_to",
    "parse_args",
    "serve",
    "split_pieces",
]

PROTOCOL_VERSION = "2024-11-05"
"""The MCP protocol version this server announces."""

SERVER_NAME = "sandboxkit-lab-stdio"
SERVER_VERSION = "0.1.0"

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

_DEFAULT_RESPONSE_SIZE = 6000
_DEFAULT_PIECE_SIZE = 1024
_ITEM_DESCRIPTION = "A lab item that pads the catalogue, like a real server's long description. "

JsonObject = dict[str, Any]


class _Stream(Protocol):
    """The part of a binary output stream the writer needs."""

    def write(self, data: bytes, /) -> int | None:
        """Write ``data``."""

    def flush(self) -> None:
        """Push buffered bytes to the file descriptor."""


@dataclass(frozen=True)
class ServerConfig:
    """Command-line settings of the server."""

    response_size: int = _DEFAULT_RESPONSE_SIZE
    piece_size: int = _DEFAULT_PIECE_SIZE
    chatter_rate: float = 0.0
    piece_delay: float = 0.0


def encode(message: JsonObject) -> bytes:
    """One message as compact ASCII JSON (so characters and bytes count the same)."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def split_pieces(data: bytes, piece_size: int) -> list[bytes]:
    """``data`` cut into consecutive pieces of at most ``piece_size`` bytes."""
    if piece_size <= 0:
        raise ValueError("piece_size must be positive")
    return [data[i : i + piece_size] for i in range(0, len(data), piece_size)] or [b""]


@dataclass
class LineWriter:
    """Writes whole lines to a stream, each in pieces with a flush after every piece.

    The lock is held for a whole line, so lines written from several threads never
    interleave, however many pieces each takes.
    """

    stream: _Stream
    piece_size: int = _DEFAULT_PIECE_SIZE
    piece_delay: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    lines: int = 0
    pieces: int = 0

    def write_line(self, payload: bytes) -> int:
        """Write ``payload`` plus a newline; returns the number of pieces written."""
        data = payload + b"\n"
        parts = split_pieces(data, self.piece_size)
        with self.lock:
            for index, part in enumerate(parts):
                if index and self.piece_delay > 0:
                    time.sleep(self.piece_delay)
                self.stream.write(part)
                self.stream.flush()
            self.lines += 1
            self.pieces += len(parts)
        return len(parts)


def pad_to(message: JsonObject, size: int, fill: Callable[[JsonObject, str], None]) -> JsonObject:
    """Make ``message`` encode to exactly ``size`` bytes (if it is shorter) by calling
    ``fill(message, padding)`` with a string of dots of the right length."""
    fill(message, "")
    missing = size - len(encode(message))
    if missing > 0:
        fill(message, "." * missing)
    return message


def _catalogue_item(kind: str, index: int) -> JsonObject:
    name = f"{kind}_{index:03d}"
    description = f"{_ITEM_DESCRIPTION}({kind} #{index})"
    if kind == "tool":
        return {
            "name": name,
            "description": description,
            "inputSchema": {"type": "object", "properties": {}},
        }
    if kind == "resource":
        return {
            "uri": f"lab://resources/{index:03d}",
            "name": name,
            "description": description,
            "mimeType": "text/plain",
        }
    return {"name": name, "description": description, "arguments": []}


_ECHO_TOOL: JsonObject = {
    "name": "echo",
    "description": "Returns its text argument (padded to the response size unless pad=false).",
    "inputSchema": {
        "type": "object",
        "properties": {"text": {"type": "string"}, "pad": {"type": "boolean"}},
        "required": ["text"],
    },
}

_LISTS = {
    "tools/list": ("tools", "tool"),
    "resources/list": ("resources", "resource"),
    "prompts/list": ("prompts", "prompt"),
}


@dataclass
class Padded:
    """A result to pad to the response size: ``fill(message, padding)`` puts the
    padding somewhere in the response ``message``."""

    result: JsonObject
    fill: Callable[[JsonObject, str], None]


class RpcFailure(Exception):
    """A JSON-RPC error to send back instead of a result."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


class StdioServer:
    """Answers JSON-RPC lines; the transport (stdin loop, writer) is separate."""

    def __init__(self, config: ServerConfig, writer: LineWriter) -> None:
        self.config = config
        self.writer = writer
        self.requests = 0

    # -- dispatch --------------------------------------------------------------------

    def handle_line(self, line: bytes) -> JsonObject | None:
        """The response to one input line, or ``None`` (blank line, notification)."""
        if not line.strip():
            return None
        try:
            message = json.loads(line)
        except Exception as exc:  # ValueError, UnicodeDecodeError, RecursionError...
            return _error(None, PARSE_ERROR, "Parse error", str(exc)[:200])
        if not isinstance(message, dict):
            return _error(None, INVALID_REQUEST, "Invalid Request", "expected a JSON object")
        has_id = "id" in message
        request_id = message.get("id")
        if has_id and not _valid_id(request_id):
            return _error(None, INVALID_REQUEST, "Invalid Request", "id must be a string or number")
        method = message.get("method")
        if not isinstance(method, str):
            if not has_id:
                return None  # a stray response or junk without an id: nothing to answer
            return _error(request_id, INVALID_REQUEST, "Invalid Request", "method must be a string")
        params = message.get("params")
        if not has_id:
            return None  # notification: never answered, whatever the method
        self.requests += 1
        try:
            result = self.dispatch(method, params)
        except RpcFailure as failure:
            return _error(request_id, failure.code, failure.message, failure.data)
        except Exception as exc:  # a bug in a handler must not end the server
            return _error(request_id, INTERNAL_ERROR, "Internal error", repr(exc)[:200])
        if isinstance(result, Padded):
            message = {"jsonrpc": "2.0", "id": request_id, "result": result.result}
            return pad_to(message, self.config.response_size, result.fill)
        return {"jsonrpc": "2.0", "id": request_id, "result": result}

    def dispatch(self, method: str, params: Any) -> Any:
        """The result of ``method`` (a :class:`Padded` one for the sized methods); raises
        :class:`RpcFailure` for a JSON-RPC error."""
        if params is not None and not isinstance(params, (dict, list)):
            raise RpcFailure(INVALID_PARAMS, "Invalid params", "params must be an object or array")
        if method == "initialize":
            return self.initialize()
        if method == "ping":
            return {}
        if method in _LISTS:
            return self.catalogue(method)
        if method == "tools/call":
            return self.call_tool(params if isinstance(params, dict) else {})
        raise RpcFailure(METHOD_NOT_FOUND, "Method not found", method)

    # -- methods ---------------------------------------------------------------------

    def initialize(self) -> JsonObject:
        """Server identity and capabilities."""
        return {
            "protocolVersion": PROTOCOL_VERSION,
            "serverInfo": {"name": SERVER_NAME, "version": SERVER_VERSION},
            "capabilities": {
                "tools": {"listChanged": False},
                "resources": {"listChanged": False},
                "prompts": {"listChanged": False},
                "logging": {},
            },
        }

    def catalogue(self, method: str) -> Padded:
        """A list result whose whole response line is ``response_size`` bytes: whole
        items up to about that size, then padding in the last item's description."""
        key, kind = _LISTS[method]
        items: list[JsonObject] = [dict(_ECHO_TOOL)] if kind == "tool" else []
        # Whole items up to about the size (each ~200 bytes), then exact padding.
        budget = self.config.response_size - 120
        used = sum(len(encode(item)) + 1 for item in items)
        index = 0
        while True:
            item = _catalogue_item(kind, index)
            cost = len(encode(item)) + 1
            if used + cost > budget:
                break
            items.append(item)
            used += cost
            index += 1
        if not items:
            items.append(_catalogue_item(kind, 0))
        result: JsonObject = {key: items}

        def fill(message: JsonObject, padding: str) -> None:
            last = message["result"][key][-1]
            last["description"] = last["description"].rstrip(".") + padding

        return Padded(result, fill)

    def call_tool(self, params: JsonObject) -> JsonObject | Padded:
        """``tools/call``: only ``echo`` exists."""
        name = params.get("name")
        arguments = params.get("arguments") or {}
        if not isinstance(arguments, dict):
            raise RpcFailure(INVALID_PARAMS, "Invalid params", "arguments must be an object")
        if name != "echo":
            raise RpcFailure(INVALID_PARAMS, "Unknown tool", name)
        text = arguments.get("text", "")
        if not isinstance(text, str):
            raise RpcFailure(INVALID_PARAMS, "Invalid params", "text must be a string")
        result: JsonObject = {"content": [{"type": "text", "text": text}], "isError": False}
        if arguments.get("pad", True) is False:
            return result

        def fill(message: JsonObject, padding: str) -> None:
            message["result"]["_meta"] = {"padding": padding}

        return Padded(result, fill)

    # -- chatter ---------------------------------------------------------------------

    def chatter(self, stop: threading.Event) -> None:
        """Emit ``notifications/message`` at ``chatter_rate`` until ``stop`` is set."""
        rate = self.config.chatter_rate
        if rate <= 0:
            return
        started = time.monotonic()
        seq = 0
        while True:
            due = started + (seq + 1) / rate
            if stop.wait(max(0.0, due - time.monotonic())):
                return
            seq += 1
            note = {
                "jsonrpc": "2.0",
                "method": "notifications/message",
                "params": {
                    "level": "info",
                    "logger": SERVER_NAME,
                    "data": {"seq": seq, "ts": time.time()},
                },
            }
            try:
                self.writer.write_line(encode(note))
            except (BrokenPipeError, ValueError, OSError):
                return


def _valid_id(value: Any) -> bool:
    return value is None or (isinstance(value, (str, int, float)) and not isinstance(value, bool))


def _error(request_id: Any, code: int, message: str, data: Any = None) -> JsonObject:
    error: JsonObject = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def serve(config: ServerConfig, stdin: BinaryIO, stdout: _Stream) -> int:
    """Answer every line of ``stdin`` until EOF; returns the exit status."""
    writer = LineWriter(stdout, config.piece_size, config.piece_delay)
    server = StdioServer(config, writer)
    stop = threading.Event()
    chatter = threading.Thread(target=server.chatter, args=(stop,), name="chatter", daemon=True)
    if config.chatter_rate > 0:
        chatter.start()
    try:
        for line in stdin:
            response = server.handle_line(line)
            if response is not None:
                writer.write_line(encode(response))
    except BrokenPipeError:
        # The reader went away: nobody is left to answer. Point stdout at /dev/null so
        # the interpreter's final flush does not complain.
        _silence_stdout()
        return 0
    finally:
        stop.set()
        if chatter.is_alive():
            chatter.join(timeout=2.0)
    return 0


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def command(
    *,
    response_size: int | None = None,
    piece_size: int | None = None,
    piece_delay: float | None = None,
    chatter_rate: float | None = None,
) -> list[str]:
    """The argv that runs this server with the given options (``None``: its default)."""
    argv = [sys.executable, "-m", "sandboxkit.lab.stdio_server"]
    options = {
        "--response-size": response_size,
        "--piece-size": piece_size,
        "--piece-delay": piece_delay,
        "--chatter-rate": chatter_rate,
    }
    for flag, value in options.items():
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError("must be a finite number >= 0")
    return value


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    """Settings from the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m sandboxkit.lab.stdio_server",
        description="A stdio JSON-RPC server shaped like an MCP server (sandboxkit fault lab).",
    )
    parser.add_argument(
        "--response-size",
        type=_positive_int,
        default=_DEFAULT_RESPONSE_SIZE,
        help="bytes per list or echo response line (default %(default)s)",
    )
    parser.add_argument(
        "--piece-size",
        type=_positive_int,
        default=_DEFAULT_PIECE_SIZE,
        help="bytes per write+flush of an output line (default %(default)s)",
    )
    parser.add_argument(
        "--chatter-rate",
        type=_non_negative_float,
        default=0.0,
        help="notifications/message lines per second from a background thread (default 0)",
    )
    parser.add_argument(
        "--piece-delay",
        type=_non_negative_float,
        default=0.0,
        help="seconds to sleep between the pieces of one line (default 0)",
    )
    args = parser.parse_args(argv)
    return ServerConfig(args.response_size, args.piece_size, args.chatter_rate, args.piece_delay)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m sandboxkit.lab.stdio_server``."""
    config = parse_args(argv)
    return serve(config, sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    sys.exit(main())
