"""The SDK is byte-exact: text split anywhere — across chunks, across reattaches — is
decoded exactly, and binary output can be had as bytes."""

from __future__ import annotations

import asyncio
import random
import sys

import pytest

from sandboxkit import AsyncSandbox, Sandbox
from sandboxkit.client import Cursor
from sandboxkit.client.commands import AsyncCommandHandle

# One character of each UTF-8 length, written in 7-byte pieces (so most pieces end inside
# a character) with a short pause between them.
TEXT = "aé€😀" * 400
WRITER = """
import sys, time
data = ("aé€😀" * 400).encode()
for i in range(0, len(data), 7):
    sys.stdout.buffer.write(data[i : i + 7])
    sys.stdout.buffer.flush()
    time.sleep(0.001)  # sleep-ok: the child's pace, so chunks stay small
"""


@pytest.mark.timeout(60)
async def test_text_split_across_reattaches_is_exact(conn: dict[str, str]) -> None:
    rng = random.Random(7)
    async with await AsyncSandbox.create(**conn) as sbx:
        # Followed while it writes: the daemon keeps each write it hands out as a chunk.
        info = await sbx.commands.start([sys.executable, "-c", WRITER])

        text: list[str] = []
        raw: list[bytes] = []
        handles: list[AsyncCommandHandle] = []
        cursor: int | None = 0
        reattaches = split = 0
        while True:
            # Each handle takes a few chunks, then its callback waits until it is
            # disconnected: reattach points fall all over the output.
            budget = rng.randint(1, 6)
            full = asyncio.Event()

            async def take(piece: str, full: asyncio.Event = full) -> None:
                nonlocal budget
                text.append(piece)
                budget -= 1
                if budget <= 0:
                    full.set()
                    await asyncio.Event().wait()  # until disconnect() cancels it

            handle = await sbx.commands.connect(
                info.pid,
                cursor,
                on_stdout=take,
                on_stdout_bytes=raw.append,
                lines=False,
                on_end=lambda _handle, full=full: full.set(),  # the process exited
            )
            handles.append(handle)
            await full.wait()
            if handle.done:
                break
            cursor = await handle.disconnect()
            reattaches += 1
            split += bool(cursor is not None and cursor.stdout_tail)
        result = await handle.wait()

    # Enough reattaches, and some of them inside a character (the case this is about); how
    # many depends on the machine's pace (writes made while no one reads are joined).
    assert reattaches >= 20 and split >= 3, (reattaches, split)
    assert "\ufffd" not in "".join(text)
    assert "".join(text) == TEXT
    assert "".join(h.stdout for h in handles) == TEXT
    assert result.stdout == handles[-1].stdout
    assert b"".join(raw) == TEXT.encode()
    assert b"".join(h.stdout_bytes for h in handles) == TEXT.encode()


BINARY = """
import sys
sys.stdout.buffer.write(bytes(range(256)) * 8)
"""


async def test_binary_output_as_bytes(conn: dict[str, str]) -> None:
    async with await AsyncSandbox.create(**conn) as sbx:
        chunks: list[bytes] = []
        handle = await sbx.commands.run(
            [sys.executable, "-c", BINARY], background=True, on_stdout_bytes=chunks.append
        )
        await handle.wait()
    assert b"".join(chunks) == bytes(range(256)) * 8
    assert handle.stdout_bytes == bytes(range(256)) * 8
    assert handle.stdout == (bytes(range(256)) * 8).decode("utf-8", "replace")


def test_sync_facade_carries_bytes_and_cursor(conn: dict[str, str]) -> None:
    with Sandbox.create(**conn) as sbx:
        chunks: list[bytes] = []
        handle = sbx.commands.run(
            [sys.executable, "-c", BINARY], background=True, on_stdout_bytes=chunks.append
        )
        handle.wait()
        cursor = handle.disconnect()
        assert isinstance(cursor, Cursor) and cursor == handle.cursor
        again = sbx.commands.connect(handle.pid, 0, keep_output=100)
        again.wait()
    assert b"".join(chunks) == handle.stdout_bytes == bytes(range(256)) * 8
    assert again.stdout_bytes == (bytes(range(256)) * 8)[-100:]
