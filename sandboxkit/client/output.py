"""One stream's output (stdout or stderr) as a handle received it: a bounded tail of the
raw bytes, the text they decode to, and the bytes of a character split at the end.

The bytes are what the process wrote; text is decoded from them (UTF-8, invalid bytes
as U+FFFD). A character may be split across chunks — and across a reattach, when one
handle stops and another continues from its cursor — so the undecoded tail travels with
the cursor (:class:`Cursor`) instead of being dropped with the handle.
"""

from __future__ import annotations

import codecs
from collections import deque

__all__ = ["DEFAULT_KEEP_OUTPUT", "Cursor", "KeepOutput", "StreamOutput", "incomplete_tail"]

DEFAULT_KEEP_OUTPUT = 8 * 1024 * 1024
"""Bytes of stdout (and of stderr) a handle keeps by default: the newest ones."""

KeepOutput = bool | int
"""``True``: keep everything; ``False``: nothing; a number: the newest that many bytes."""

_decode = codecs.utf_8_decode


class _Marker(str):
    """A gap's marker among the kept pieces: shown in the text, not output bytes."""


class Cursor(int):
    """Where a stream stopped: the sequence number of the next chunk (an ``int``, usable
    wherever a cursor is) carrying what was cut there, so that a stream continued from it
    (``commands.connect(pid, cursor=...)``) delivers it whole: the bytes of a split
    character, and the start of a line whose newline had not come yet (a line-by-line
    ``on_stdout`` gets that line once, whole, from the continuing handle). Arithmetic on
    it gives a plain ``int`` (and drops what it carries)."""

    stdout_tail: bytes
    stderr_tail: bytes
    stdout_line: str
    stderr_line: str

    def __new__(
        cls,
        seq: int,
        stdout_tail: bytes = b"",
        stderr_tail: bytes = b"",
        *,
        stdout_line: str = "",
        stderr_line: str = "",
    ) -> Cursor:
        cursor = super().__new__(cls, seq)
        cursor.stdout_tail = stdout_tail
        cursor.stderr_tail = stderr_tail
        cursor.stdout_line = stdout_line
        cursor.stderr_line = stderr_line
        return cursor

    def __repr__(self) -> str:
        lines = (
            f", stdout_line={self.stdout_line!r}, stderr_line={self.stderr_line!r}"
            if self.stdout_line or self.stderr_line
            else ""
        )
        return f"Cursor({int(self)}, {self.stdout_tail!r}, {self.stderr_tail!r}{lines})"

    __str__ = int.__repr__  # str(cursor) is the number, as in a query string


def incomplete_tail(data: bytes | memoryview) -> int:
    """How many bytes at the end of ``data`` begin a UTF-8 character they do not finish
    (0–3). UTF-8 synchronises on its lead bytes, so the last three bytes tell."""
    end = len(data)
    for start in range(end - 1, max(end - 4, -1), -1):
        byte = data[start]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): the last character starts here
            _, used = _decode(data[start:], "replace", False)
            return end - start - used
    return 0


class StreamOutput:
    """The output of one stream of one process, as one handle received it.

    ``keep`` bounds what is kept: the newest ``keep`` bytes (``True``: all, ``False``:
    none); ``dropped`` counts the bytes received and no longer kept. ``tail`` is the
    undecoded start of a character split at the end (carried over from a previous handle
    at first)."""

    def __init__(self, keep: KeepOutput, tail: bytes = b"") -> None:
        self.limit: int | None = None if keep is True else int(keep)
        self.tail = tail
        self.received = 0
        self.dropped = 0
        self._head = tail  # bytes of a character the previous handle began
        # Output as bytes, or as the ASCII text it decoded to (the same bytes: see add),
        # and gap markers.
        self._pieces: deque[bytes | str] = deque()
        self._skip = 0  # leading bytes (or characters) of the first piece no longer kept
        self._kept = 0
        self._text: str | None = ""

    def add(self, data: bytes | memoryview, decode: bool) -> str:
        """Record a chunk; its text (with the tail before it) if ``decode``, else ``""``
        (the tail is tracked either way). ``data`` may be a view (decoded straight from
        the receive buffer): what is kept of it is its own, never the view."""
        self.received += len(data)
        text = ""
        kept: bytes | str | None = None
        if decode:
            tail = self.tail
            joined = tail + data if tail else data
            text, used = _decode(joined, "replace", False)
            self.tail = bytes(joined[used:])
            # ASCII text decoded from exactly this chunk is its bytes, character for
            # byte: kept as it is, the chunk is never copied (isascii() is a flag, and
            # the bytes are ``encode()`` away when asked for). Anything else (a
            # character across chunks, U+FFFD for a bad byte) keeps the bytes.
            if not tail and len(text) == len(data) and text.isascii():
                kept = text
        elif len(data) >= 3:
            self.tail = bytes(data[len(data) - incomplete_tail(data) :])
        else:
            joined = self.tail + data
            self.tail = joined[len(joined) - incomplete_tail(joined) :]
        if self.limit != 0:
            if kept is None:
                kept = data if type(data) is bytes else bytes(data)
            self._pieces.append(kept)
            self._kept += len(kept)
            self._text = None
            self._trim()
        return text

    def mark(self, marker: str) -> str:
        """Record a break in the output (a gap), shown as ``marker`` in :attr:`text`; a
        character split across it can never be finished: returns its replacement."""
        broken = _decode(self.tail, "replace", True)[0] if self.tail else ""
        self.tail = b""
        if self.limit != 0:
            self._pieces.append(_Marker(marker))
            self._kept += len(marker)
            self._text = None
            self._trim()
        return broken

    def _trim(self) -> None:
        if self.limit is None:
            return
        while self._kept > self.limit:
            first = self._pieces[0]
            excess = self._kept - self.limit
            left = len(first) - self._skip
            if left <= excess:
                self._pieces.popleft()
                self._skip = 0
                self._kept -= left
                if type(first) is not _Marker:
                    self.dropped += left
            else:
                # Skipped, not sliced off: a slice would copy the rest of the piece on
                # every chunk added (the usual case for a stream read at full rate).
                self._skip += excess
                self._kept -= excess
                if type(first) is not _Marker:
                    self.dropped += excess
            self._head = b""

    def _live(self) -> list[bytes | memoryview | str]:
        """The pieces as kept: the first without its skipped start."""
        pieces: list[bytes | memoryview | str] = list(self._pieces)
        if self._skip:
            first = pieces[0]
            if isinstance(first, str):  # still a _Marker once sliced: the type tells
                pieces[0] = type(first)(first[self._skip :])
            else:
                pieces[0] = memoryview(first)[self._skip :]
        return pieces

    @property
    def data(self) -> bytes:
        """The kept bytes, exactly as the process wrote them (no markers)."""
        return b"".join(
            p if not isinstance(p, str) else p.encode("ascii")
            for p in self._live()
            if type(p) is not _Marker
        )

    def text(self, final: bool = False) -> str:
        """The kept output decoded, with a marker where a gap was; without the bytes of an
        unfinished last character unless ``final`` (then they decode to U+FFFD)."""
        if self._text is None:
            parts: list[str] = []
            run: list[bytes | memoryview] = [self._head] if self._head else []
            skip = self.dropped > 0  # the kept tail may start inside a character

            def flush(last: bool) -> None:
                nonlocal skip
                raw = b"".join(run)
                run.clear()
                if skip:
                    start = 0
                    while start < min(3, len(raw)) and raw[start] & 0xC0 == 0x80:
                        start += 1
                    raw, skip = raw[start:], False
                parts.append(_decode(raw, "replace", last)[0])

            for piece in self._live():
                if isinstance(piece, str):
                    # A marker, or text kept decoded: either way the bytes before it are
                    # decoded to their end (kept text only follows a finished character).
                    flush(True)
                    parts.append(piece)
                else:
                    run.append(piece)
            flush(False)
            self._text = "".join(parts)
            pieces = self._pieces
            if final and pieces and not self._head and all(type(p) is str for p in pieces):
                # The output ended, all of it kept as text (ASCII): the joined text is what
                # is kept now, not the pieces beside it (a finished handle held it twice).
                self._pieces = deque([self._text])
                self._skip = 0
        if final and self.tail and self.limit != 0:
            return self._text + _decode(self.tail, "replace", True)[0]
        return self._text
