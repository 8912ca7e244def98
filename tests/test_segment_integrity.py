"""The output log's defence in depth: no file a sandbox can write crashes the daemon or
reaches a client as a malformed frame; a damaged segment is an exact gap; a log that
falls back to memory says so (an event, and fields on the process)."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support import poll

from sandboxkit.daemon import segment_store
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.output_log import OutputLog
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.wire import FrameDecoder

# -- a sandboxed process damages its own log's segments while consumers read ---------------

# Run as its own process (a daemon's host and logs): a SIGBUS there ends that process, and
# the test sees it in the exit status instead of losing pytest. It prints one JSON line.
_DAEMON = r"""
import asyncio, json, sys
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.wire import FrameDecoder

MODE = sys.argv[1]
BLOCK = 65536
WRITE = (
    "import sys\n"
    "for i in range(64): sys.stdout.buffer.write(bytes([i]) * 65536)\n"
)
EXPECTED = b"".join(bytes([i]) * BLOCK for i in range(64))
# A same-uid process that found the log's files (wherever they are) and damages them.
ATTACK = r'''
import os, sys
mode, directory = sys.argv[1], sys.argv[2]
for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        continue
    frames = name.endswith(".frames")
    size = os.path.getsize(path)
    if mode == "truncate" and frames:
        os.truncate(path, 0)
    elif mode == "shrink" and frames:
        os.truncate(path, size // 3)
    elif mode == "zero" and frames:
        with open(path, "r+b") as f:
            f.write(bytes(size))
    elif mode == "garble" and frames:
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(os.urandom(4096))
    elif mode == "index" and name.endswith(".index"):
        with open(path, "r+b") as f:
            f.write(bytes(size))
        os.truncate(path, size // 2)
'''


class Reader:
    # A consumer: its cursor, the offset of the next byte it expects, what it got.
    def __init__(self, log):
        self.log, self.cursor, self.next_offset = log, 0, 0
        self.received = self.lost = self.gaps = 0
        self.held = []

    def step(self, max_bytes):
        gap, chunks = self.log.read(self.cursor, max_bytes)
        if gap is not None:
            assert gap.cursor == self.cursor, gap
            self.lost += gap.bytes_lost
            self.gaps += 1
            self.next_offset += gap.bytes_lost
            self.cursor = gap.first_available
        self.held = chunks
        return gap is not None or bool(chunks)

    def take(self):
        # "Send" what was read: the frame bytes a client gets, decoded as a client would.
        for chunk in self.held:
            (frame,) = FrameDecoder().feed(b"".join((chunk.head, chunk.data)))
            assert frame.meta["seq"] == chunk.seq == self.cursor, (frame.meta, self.cursor)
            assert frame.meta["offset"] == chunk.offset == self.next_offset, "inexact gap"
            assert frame.payload == EXPECTED[chunk.offset : chunk.offset + chunk.size]
            self.cursor += 1
            self.next_offset += chunk.size
            self.received += chunk.size
        self.held = []


async def main():
    config = DaemonConfig(
        retention_bytes=8 << 20, output_cache_bytes=64 << 10, kill_grace=1.0, exit_drain=0.5
    )
    async with Host(config) as host:
        victim = await host.create_sandbox()
        neighbour = await host.create_sandbox()
        spec = ProcessSpec(argv=(sys.executable, "-c", WRITE))
        process = await victim.start_process(spec)
        other = await neighbour.start_process(spec)
        assert await process.wait(30) == 0 and await other.wait(30) == 0
        log = process.log
        readers = [Reader(log) for _ in range(3)]
        for reader in readers:  # each reads some from disk, and holds its last batch
            for _ in range(3):
                reader.take()
                reader.step(BLOCK * 2)
        attack = await victim.start_process(
            ProcessSpec(argv=(sys.executable, "-c", ATTACK, MODE, str(log.directory)))
        )
        assert await attack.wait(30) == 0, bytes(c.data for c in attack.log.read(0, 1 << 20)[1])
        for reader in readers:  # the held batch is sent after the damage
            reader.take()
            while reader.step(BLOCK * 2):
                reader.take()
        # The neighbour's stream is untouched.
        clean = Reader(other.log)
        while clean.step(BLOCK * 4):
            clean.take()
        print(json.dumps({
            "total": log.total_bytes,
            "readers": [[r.received, r.lost, r.gaps, r.cursor] for r in readers],
            "head": log.head,
            "neighbour": [clean.received, clean.lost, clean.cursor, other.log.head],
            "storage": log.storage,
            "events": [
                [e.reason, e.data["storage"]]
                for e in host.journal.since(0, pid=process.pid)
                if e.kind == "process.log_degraded"
            ],
        }))

asyncio.run(main())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["truncate", "shrink", "zero", "garble", "index"])
def test_a_sandbox_damaging_its_log_segments_costs_a_gap_never_the_daemon(
    mode: str, tmp_path: Path
) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", _DAEMON, mode],
        capture_output=True,
        timeout=50,
        env=env,
        check=False,
    )
    assert done.returncode != -signal.SIGBUS, "the daemon died of SIGBUS"
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    result = json.loads(done.stdout.decode().strip().splitlines()[-1])
    total = 64 * 65536
    assert result["total"] == total
    for received, lost, _gaps, cursor in result["readers"]:
        # Every byte accounted for: what was read is byte-exact (checked in the daemon),
        # what was lost is said by gaps of exact size, and every reader reached the end.
        assert received + lost == total
        assert cursor == result["head"]
    # The damage cost something (a gap), never a malformed frame (checked in the daemon).
    assert any(lost > 0 for _, lost, _, _ in result["readers"])
    assert result["neighbour"] == [total, 0, result["neighbour"][3], result["neighbour"][3]]
    # The damage is journalled; the log stays on disk.
    assert result["events"] and set(map(tuple, result["events"])) == {("segment_damaged", "disk")}
    assert result["storage"] == "disk"


# -- checksums: a corrupt frame read from disk is an exact gap -----------------------------


def _log_with_sealed_segments(directory: Path) -> OutputLog:
    log = OutputLog(1 << 20, directory=directory, cache_bytes=4096, segment_bytes=16 * 1024)
    for i in range(32):
        log.append("stdout", bytes([i]) * 4096)
    return log


def _read_all(log: OutputLog) -> tuple[int, int, int]:
    """(bytes received, bytes lost, gaps), checking each frame and each gap's size."""
    expected = b"".join(bytes([i]) * 4096 for i in range(32))
    cursor = next_offset = received = lost = gaps = 0
    while True:
        gap, chunks = log.read(cursor, 8192)
        if gap is not None:
            assert gap.cursor == cursor
            lost += gap.bytes_lost
            next_offset += gap.bytes_lost
            gaps += 1
            cursor = gap.first_available
        if not chunks:
            return received, lost, gaps
        for chunk in chunks:
            (frame,) = FrameDecoder().feed(chunk.frame)
            assert (frame.meta["seq"], frame.meta["offset"]) == (cursor, next_offset)
            assert (chunk.seq, chunk.offset) == (cursor, next_offset)
            assert frame.payload == expected[chunk.offset : chunk.offset + chunk.size]
            cursor += 1
            next_offset += chunk.size
            received += chunk.size


def test_a_corrupt_frame_on_disk_is_an_exact_gap(tmp_path: Path) -> None:
    log = _log_with_sealed_segments(tmp_path / "log")
    frames = sorted((tmp_path / "log").glob("*.frames"))
    assert len(frames) >= 4
    target = frames[1]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit-flipped byte in a payload
    target.write_bytes(bytes(data))
    received, lost, gaps = _read_all(log)
    assert 0 < lost < 32 * 4096 // 2 and gaps == 1
    assert received + lost == log.total_bytes == 32 * 4096
    assert log.storage == "disk"  # the rest of the log stays on disk
    log.close()


def test_a_zeroed_index_is_an_exact_gap(tmp_path: Path) -> None:
    log = _log_with_sealed_segments(tmp_path / "log")
    for index in sorted((tmp_path / "log").glob("*.index"))[:2]:
        index.write_bytes(bytes(index.stat().st_size))
    received, lost, gaps = _read_all(log)
    assert lost > 0 and gaps == 1
    assert received + lost == log.total_bytes
    log.close()


# -- degradations are visible ------------------------------------------------------------


def _disk_full(fd: int, parts: list[bytes]) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.timeout(30)
async def test_a_log_that_falls_back_to_memory_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    config = DaemonConfig(
        retention_bytes=8 << 20, output_cache_bytes=256 << 10, kill_grace=1.0, exit_drain=0.5
    )
    async with Host(config) as host:
        sandbox = await host.create_sandbox()
        write = "import sys; sys.stdout.buffer.write(b'x' * (2 << 20))"
        healthy = await sandbox.start_process(ProcessSpec(argv=(sys.executable, "-c", write)))
        assert await healthy.wait(20) == 0
        info = healthy.to_json()
        assert (info["log_storage"], info["log_retention_bytes"]) == ("disk", 8 << 20)
        assert not [e for e in host.journal.since(0) if e.kind == "process.log_degraded"]

        monkeypatch.setattr(segment_store, "_write_all", _disk_full)
        process = await sandbox.start_process(ProcessSpec(argv=(sys.executable, "-c", write)))
        assert await process.wait(20) == 0
        await poll(
            lambda: any(e.kind == "process.log_degraded" for e in host.journal.since(0)),
            5,
            "the degradation event",
        )
        (event,) = [e for e in host.journal.since(0) if e.kind == "process.log_degraded"]
        assert (event.sandbox_id, event.pid) == (sandbox.sandbox_id, process.pid)
        assert event.reason == "disk_error"
        assert event.data["errno"] == "ENOSPC" and event.data["storage"] == "memory"
        assert event.data["retention_bytes"] == 256 << 10
        info = process.to_json()
        assert info["log_storage"] == "memory"
        assert info["log_retention_bytes"] == 256 << 10
        assert "No space left" in info["log_error"]
        assert healthy.to_json()["log_storage"] == "disk"  # the other log is unaffected


# -- out of reach by path ----------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_log_segments_are_not_beside_the_sandboxes(tmp_path: Path) -> None:
    """A sandbox's working directory is ``<root>/<id>``: its ``..`` names every sandbox of
    the daemon. The logs' files are kept in a directory of the daemon's own (mode 0700)
    elsewhere, so that no path a sandbox derives from where it runs reaches them."""
    # No spare sandbox (daemon/spare.py) beside the one listed below.
    config = DaemonConfig(root_dir=tmp_path / "root", kill_grace=1.0, spare="off")
    async with Host(config) as host:
        sandbox = await host.create_sandbox()
        write = "import sys; sys.stdout.buffer.write(b'x' * (1 << 20))"
        process = await sandbox.start_process(ProcessSpec(argv=(sys.executable, "-c", write)))
        assert await process.wait(20) == 0
        directory = process.log.directory
        assert directory is not None and list(directory.glob("*.frames"))
        root = sandbox.workdir.parent
        assert root not in directory.parents
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
            sandbox.sandbox_id,
            f"{sandbox.sandbox_id}.tmp",  # its /tmp (sandbox_paths)
        ]
        runtime = directory.parent.parent
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert not directory.exists() and not runtime.exists()


def test_the_segment_being_written_cut_under_the_producer_is_a_gap_and_the_log_goes_on(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "log"
    log = OutputLog(1 << 20, directory=directory, cache_bytes=4096, segment_bytes=64 * 1024)
    expected = b"".join(bytes([i]) * 4096 for i in range(32))
    for i in range(8):
        log.append("stdout", bytes([i]) * 4096)
    (frames,) = directory.glob("*.frames")  # the one segment, still written to
    log.drop_cache()  # (its chunks are in the file now; readers go there)
    os.truncate(frames, 0)
    for i in range(8, 32):  # the producer writes on, past the cut (a hole, then frames)
        assert log.append("stdout", bytes([i]) * 4096) is not None
    cursor = next_offset = received = lost = 0
    while True:
        gap, chunks = log.read(cursor, 8192)
        if gap is not None:
            lost += gap.bytes_lost
            next_offset += gap.bytes_lost
            cursor = gap.first_available
        if not chunks:
            break
        for chunk in chunks:
            (frame,) = FrameDecoder().feed(chunk.frame)
            assert (frame.meta["seq"], frame.meta["offset"]) == (cursor, next_offset)
            assert frame.payload == expected[chunk.offset : chunk.offset + chunk.size]
            cursor += 1
            next_offset += chunk.size
            received += chunk.size
    assert lost > 0 and received + lost == log.total_bytes == len(expected)
    assert received >= 8 * 4096  # what came after the cut, in its next segment
    assert log.storage == "disk"
    log.close()


def test_a_buffer_read_into_again_never_changes_chunks_a_reader_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads from disk go into reused buffers; one is read into again only once nothing
    holds a view of it. A reader holding chunks (not sent yet) while other readers push
    its block out of the few kept keeps its bytes."""
    monkeypatch.setattr(segment_store, "_BLOCKS", segment_store._Blocks(64 * 1024))
    monkeypatch.setattr(segment_store, "_BLOCK_BYTES", 16 * 1024)
    log = OutputLog(1 << 22, directory=tmp_path / "log", cache_bytes=4096, segment_bytes=1 << 16)
    for i in range(256):
        log.append("stdout", bytes([i]) * 4096)
    _, held = log.read(0, 16 * 1024)
    assert [c.seq for c in held] == [0, 1, 2, 3]
    for start in range(4, 250, 4):  # other readers: every block goes, buffers come back
        _, chunks = log.read(start, 16 * 1024)
        assert [bytes(c.data) for c in chunks] == [bytes([c.seq]) * 4096 for c in chunks]
        del chunks
    assert [bytes(c.data) for c in held] == [bytes([i]) * 4096 for i in range(4)]
    assert [c.seq for c in log.read(0, 16 * 1024)[1]] == [0, 1, 2, 3]  # read again: same
    log.close()
