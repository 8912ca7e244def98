"""Copies of a segment store's frames read back from disk and checked, shared by every
store of the daemon (:class:`Blocks`): readers at the same place share one verified copy,
so the copy and its check are paid once per block, not once per reader."""

from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["BLOCKS", "BLOCK_BYTES", "Block", "BlockOwner", "Blocks", "Record"]

Record = tuple[int, int, float, int, int, int, int, int]
"""An index record: ``(position, offset, ts, size, head, stream, frame CRC, record CRC)``."""

BLOCK_BYTES = 256 * 1024
"""A read from disk copies about this many bytes of payload at a time (a chunk more, or
one larger chunk), checked once and shared by the readers that come by (:class:`_Blocks`);
a reader that asks for more takes several blocks. Small enough that a sender holding
chunks pins little memory, large enough that a syscall is a small part of the copy."""


class BlockOwner(Protocol):
    """A store, as its blocks know it: the blocks of it held now."""

    blocks: list[Block]


@dataclass(slots=True, eq=False)
class Block:
    """Chunks ``first_seq ..`` of one segment, copied out of its files and checked."""

    store: BlockOwner
    first_seq: int
    records: list[Record]
    frames: memoryview
    """Their frames, from file position ``records[0][0]`` on."""
    buffer: bytearray
    """What ``frames`` is a view of: written again only once no view of it is left."""
    size: int = field(default=0)

    @property
    def end_seq(self) -> int:
        return self.first_seq + len(self.records)


class Blocks:
    """The copies read back, shared by every store of the daemon: the most recently used,
    up to :data:`BLOCKS_LIMIT` bytes in all. Readers behind a log's cache mostly read the
    same stretch one after the other (a burst of output they all follow), so each block
    is copied and checked once for all of them, not once per reader. A block a reader
    still holds chunks of stays alive with them, whatever this cache does."""

    def __init__(self, limit: int) -> None:
        self._lru: OrderedDict[int, Block] = OrderedDict()
        self._size = 0
        self._limit = limit
        # Buffers of blocks let go of, to read into again: a fresh 256 KiB for every
        # read was fresh pages to fault in. One is taken only once nothing holds a view
        # of it (a sender's chunks), which Python tracks for us: a bytearray with views
        # out cannot be resized (BufferError).
        self._free: deque[bytearray] = deque()

    def buffer(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes that no one holds a view of."""
        free = self._free
        for _ in range(len(free)):
            buffer = free.popleft()
            try:
                if len(buffer) < size:
                    buffer.extend(bytes(size - len(buffer)))
                else:  # (resizing is refused while views are out: a probe)
                    buffer.append(0)
                    del buffer[-1]
            except BufferError:
                free.append(buffer)
                continue
            return buffer
        return bytearray(max(size, BLOCK_BYTES + (BLOCK_BYTES >> 2)))

    def give_back(self, buffer: bytearray) -> None:
        """A buffer :meth:`buffer` gave that was not made a block (taken again only once
        no view of it is left)."""
        if len(self._free) < _FREE_BUFFERS:
            self._free.append(buffer)

    def add(self, block: Block) -> None:
        block.store.blocks.append(block)
        self._lru[id(block)] = block
        self._size += block.size
        while self._size > self._limit and len(self._lru) > 1:
            self._forget(next(iter(self._lru.values())))

    def touch(self, block: Block) -> None:
        self._lru.move_to_end(id(block))

    def drop(self, store: BlockOwner, before: int | None = None) -> None:
        for block in list(store.blocks):
            if before is None or block.end_seq <= before:
                self._forget(block)

    def _forget(self, block: Block) -> None:
        if self._lru.pop(id(block), None) is not None:
            self._size -= block.size
            if len(self._free) < _FREE_BUFFERS:
                self._free.append(block.buffer)
        with contextlib.suppress(ValueError):
            block.store.blocks.remove(block)


BLOCKS_LIMIT = 4 << 20
_FREE_BUFFERS = 8
# What reading back costs the daemon's own memory once its readers have gone: at most the
# blocks kept and the spare buffers, ~6.5 MiB in all whatever the number of logs (chunks
# a sender still holds keep their block's buffer on top, as long as they are held).
BLOCKS = Blocks(BLOCKS_LIMIT)
