"""Decoded output cut into lines for a line-by-line callback, exactly and with one copy.

A line is what ends in ``\\n`` (delivered without it, and without a ``\\r`` before it); a
line still growing past :data:`LONGEST_LINE` is delivered in pieces of that size. The
start of a line whose end has not come is carried to the next text (and in a cursor to
the next handle). A stream read at full rate calls this once per chunk: each character
is copied once, into its line (issue 22), never into a joined text that is then cut.
"""

from __future__ import annotations

__all__ = ["LONGEST_LINE", "split_lines"]

LONGEST_LINE = 64 * 1024
"""A line that grows past this without a newline is delivered in pieces of this size."""


def split_lines(partial: str, text: str) -> tuple[list[str], str]:
    """``partial`` (a line begun before, no newline in it) followed by ``text``: the
    lines and pieces now complete (their ``\\n`` removed, a ``\\r`` before it kept), and
    what is left to wait for its end (at most :data:`LONGEST_LINE` characters)."""
    if "\n" in text:
        complete = text.split("\n")
        rest = complete.pop()
        if partial:
            complete[0] = partial + complete[0]
        head = ""
    else:  # no line ends here: a long line, chunk by chunk
        complete, head, rest = [], partial, text
    # What waits for its end is head + rest, never joined unless it is short.
    size = len(head) + len(rest)
    if size <= LONGEST_LINE:
        return complete, head + rest if head else rest
    # Pieces of the longest size, leaving at most that much to wait for its end.
    end = (size - 1) // LONGEST_LINE * LONGEST_LINE
    if len(head) >= LONGEST_LINE:  # a cursor's line longer than usual: join it once
        rest, head = head + rest, ""
    first = LONGEST_LINE - len(head)
    complete.append(head + rest[:first])
    stop = end - len(head)
    complete += (rest[i : i + LONGEST_LINE] for i in range(first, stop, LONGEST_LINE))
    return complete, rest[stop:]
