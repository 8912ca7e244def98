"""A framed stream body received into one buffer and decoded where it lies.

The client's cost per GB of a stream is its copies and its steps per read (issue 22: many
consumers in one process). So the socket is read straight into this buffer (the kernel's
copy), the chunked transfer coding is taken apart by offsets, and the frames are cut out
of the buffer by the one frame codec (:meth:`~sandboxkit.wire.FrameDecoder.cut`): a
payload byte is copied once, into its frame's ``bytes``. A frame that a read leaves
unfinished stays where it is and the next read lands right after it — moved to the front
only when it would not fit, and the buffer grown for a frame larger than the buffer.
"""

from __future__ import annotations

from sandboxkit.wire import HEADER_SIZE, Frame, FrameDecoder

__all__ = ["READ_SIZE", "FrameBuffer"]

READ_SIZE = 1024 * 1024
"""The buffer's usual size: at most this much is taken from the socket per read (fewer,
larger reads: each costs the event loop and the stream a round of Python)."""
_MIN_READ = 64 * 1024
"""Less room than this after an unfinished frame: it is moved to the front first."""
_FIRST_SIZE = 64 * 1024
"""The buffer a stream starts with, grown to its usual size once a read leaves it a quarter
of its room or less: most streams (a ``run`` of a short command) carry a few hundred
bytes, and a new 1 MiB buffer is 1 MiB to zero."""


class FrameBuffer:
    """Bytes received (:meth:`space`, :meth:`received`) in, whole frames out.

    The buffer holds, in order: the bytes of frames not yet whole (``[_start:_fend]``,
    contiguous: the chunk framing between them removed), then received bytes the chunk
    decoder took (framing, or data already moved down), up to ``_end``. Frames cut are
    *borrowed*: their payloads are views into the buffer (not copies), so its bytes are
    neither moved nor overwritten until :meth:`release` says those frames are done
    with; a read that needs room before then gets a fresh buffer instead."""

    def __init__(self, size: int = READ_SIZE) -> None:
        self._size = size
        self._min_read = min(_MIN_READ, size // 4)
        self._raw = bytearray(min(size, _FIRST_SIZE))
        self._view = memoryview(self._raw)
        self._end = 0
        self._start = 0
        self._fend = 0
        self._need = HEADER_SIZE  # bytes the unfinished frame needs to be cut
        self._held = False  # frames cut since the last release borrow from the buffer
        self._early: list[Frame] = []  # cut by piece(), for the next cut()
        self.decoder = FrameDecoder()

    @property
    def raw(self) -> bytearray:
        """The buffer itself (what :meth:`space` is a view of)."""
        return self._raw

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return self._fend - self._start

    def space(self) -> memoryview:
        """Where the next read goes: after the unfinished frame, with room for it."""
        size = len(self._raw)
        if self._start + self._need > size or size - self._end < min(self._min_read, size // 4):
            if self._held or self._need > size or size < self._size:
                # Borrowed bytes stay put: the unfinished frame goes to a new buffer
                # (of the usual size at least: the first grows once it runs short).
                self._renew(max(self._need, self._size))
            elif self._start:
                self._move_front()
        return self._view[self._end :]

    def received(self, nbytes: int) -> tuple[int, int]:
        """``nbytes`` were read into :meth:`space`: the range of the buffer they are in
        (to take apart: each piece of frame bytes in it goes to :meth:`piece`)."""
        start = self._end
        self._end += nbytes
        return start, self._end

    def piece(self, start: int, stop: int) -> None:
        """Frame bytes at ``[start:stop]`` (past the frame bytes already taken)."""
        fend = self._fend
        if start == fend:  # right after the others (the usual case)
            self._fend = stop
            return
        if fend - self._start >= self._need:
            # Chunk framing after whole frames (a read that took several of the daemon's
            # sends): they are cut where they lie first, so that only a frame the framing
            # fell inside is ever moved (moving them cost up to half of each read).
            self._cut(self._early)
        if self._start == fend:  # nothing unfinished before it: the frames begin here
            self._start, self._fend = start, stop
        else:  # framing fell inside a frame: close the hole, moving the smaller side
            before = fend - self._start  # (a memoryview assignment handles the overlap)
            if before <= stop - start:  # e.g. a frame's head sent apart from its payload
                self._view[start - before : start] = self._view[self._start : fend]
                self._start, self._fend = start - before, stop
            else:
                self._view[fend : fend + stop - start] = self._view[start:stop]
                self._fend = fend + stop - start

    def cut(self, frames: list[Frame]) -> None:
        """Append the frames now whole to ``frames``, their payloads borrowed (see
        :meth:`release`). MalformedFrame on bytes that cannot be frames."""
        if self._early:
            frames += self._early
            self._early.clear()
        self._cut(frames)
        self._end = self._fend  # the framing after the frame bytes is taken: overwrite it
        if self._start == self._fend:
            self._rewind()

    def _cut(self, frames: list[Frame]) -> None:
        """Cut the whole frames of ``[_start:_fend]`` into ``frames``; note what the
        unfinished one needs."""
        start, fend = self._start, self._fend
        if fend - start >= self._need:
            cut = self.decoder.cut(self._view[:fend], start, frames, borrow=True)
            self._held = self._held or cut > start
            start = self._start = cut
        if start == fend:
            self._need = HEADER_SIZE
        elif fend - start >= HEADER_SIZE:
            self._need = self.decoder.frame_size(self._view, start)  # MalformedFrame if bad
        else:
            self._need = HEADER_SIZE

    def release(self) -> None:
        """The frames cut so far are done with: their bytes may be reused."""
        self._held = False
        self._rewind()

    def _rewind(self) -> None:
        """With nothing unfinished and nothing borrowed, the next read starts at the
        front (of a buffer no larger than usual)."""
        if self._held or self._start != self._fend:
            return
        self._start = self._fend = self._end = 0
        if len(self._raw) > self._size:  # back from a frame larger than usual
            self._renew(self._size)

    def _move_front(self) -> None:
        size = self._fend - self._start
        self._view[:size] = self._view[self._start : self._fend]
        self._start, self._fend, self._end = 0, size, size

    def _renew(self, size: int) -> None:
        """A new buffer of ``size`` holding the unfinished frame at its front (the old
        one lives on while views of it do)."""
        raw = bytearray(size)
        kept = self._fend - self._start
        raw[:kept] = self._view[self._start : self._fend]
        self._raw, self._view = raw, memoryview(raw)
        self._start, self._fend, self._end = 0, kept, kept
        self._held = False
