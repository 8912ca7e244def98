"""Zero-copy fan-out (issue 22): readers behind the output cache of a log whose files no
sandbox can reach get their frames as spans of the segment files, sent with
``sendfile``; the wire bytes are the file's bytes, checked once, and a segment shrunk or
evicted under a span is still a gap, never a crash or a torn frame."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import httpx
import pytest
from support import fast_config, stream_payload, wait_until

from sandboxkit.daemon import file_span, isolation, sendfile_writer
from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.output_log import OutputLog
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.server import DaemonServer
from sandboxkit.wire import FrameDecoder, FrameKind

BLOCK = 64 * 1024


@pytest.fixture
def daemon_config() -> DaemonConfig:
    return fast_config(output_cache_bytes=256 << 10)  # most of a stream behind the cache


@pytest.fixture
def private(monkeypatch: pytest.MonkeyPatch) -> None:
    # The suite runs its sandboxes without isolation (conftest), which turns zero-copy
    # off for the whole daemon process: these tests stand for an isolated daemon.
    monkeypatch.setattr(file_span, "_unisolated", False)


def _log(tmp_path: Path, *, retention: int = 4 << 20, segment: int = 256 << 10) -> OutputLog:
    log = OutputLog(
        retention,
        charge_overhead=True,
        directory=tmp_path / "log",
        cache_bytes=128 << 10,
        segment_bytes=segment,
    )
    log.zero_copy = file_span.files_private
    return log


def _fill(log: OutputLog, blocks: int) -> bytes:
    data = b"".join(bytes([i % 251]) * BLOCK for i in range(blocks))
    for i in range(blocks):
        log.append("stdout", data[i * BLOCK : (i + 1) * BLOCK])
    log.finish(0)
    return data


def _drain(log: OutputLog, cursor: int = 0) -> tuple[list[dict[str, int]], bytes, int]:
    """Read the log as a consumer would (spans where given, chunks elsewhere), decoding
    the bytes it would send: (gaps, payload, spans)."""
    decoder = FrameDecoder()
    gaps: list[dict[str, int]] = []
    out = bytearray()
    spans = 0
    while True:
        spanned = log.read_span(cursor, 256 << 10)
        if spanned is not None:
            gap, span = spanned
            try:
                wire = span.read()
            finally:
                span.close()
            assert wire is not None
            spans += 1
            frames = decoder.feed(wire)
            assert decoder.pending == 0, "a span ends at a frame's end"
            assert [f.meta["seq"] for f in frames] == list(range(span.first_seq, span.end_seq))
            end = span.end_seq
        else:
            gap, chunks = log.read(cursor, 256 << 10)
            frames = decoder.feed(b"".join(c.frame for c in chunks))
            end = chunks[-1].seq + 1 if chunks else cursor
        if gap is not None:
            gaps.append(
                {"cursor": gap.cursor, "first": gap.first_available, "lost": gap.bytes_lost}
            )
        for frame in frames:
            assert frame.kind == FrameKind.DATA
            out += frame.payload
        if end == cursor and gap is None:
            return gaps, bytes(out), spans
        cursor = end if gap is None or frames else gap.first_available


def test_behind_the_cache_a_reader_gets_spans_of_the_files_exact_frames(
    tmp_path: Path, private: None
) -> None:
    log = _log(tmp_path)
    data = _fill(log, 32)
    gaps, got, spans = _drain(log)
    assert (gaps, got) == ([], data)
    assert spans >= 4  # 2 MiB behind a 128 KiB cache: most of it from the files
    log.close()


def test_not_zero_copy_where_a_sandbox_could_reach_the_files(tmp_path: Path) -> None:
    assert file_span.zero_copy_check("auto", isolated=False) is None
    assert file_span.zero_copy_check("off", isolated=True) is None
    assert file_span.zero_copy_check("auto", isolated=True) is file_span.files_private
    log = _log(tmp_path)
    _fill(log, 8)
    file_span.unisolated_ran()  # (the suite's sandboxes already did)
    assert log.read_span(0, 1 << 20) is None
    log.close()


def test_zero_copy_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="zero_copy"):
        DaemonConfig(zero_copy="sometimes")


def test_a_segment_shrunk_after_it_was_checked_is_an_exact_gap(
    tmp_path: Path, private: None
) -> None:
    log = _log(tmp_path)
    data = _fill(log, 32)
    held = log.read_span(0, BLOCK)  # checks the first segment, and holds a span of it
    assert held is not None
    span = held[1]
    first = log.directory / "0000000000.frames"  # type: ignore[operator]
    os.truncate(first, 1000)
    assert span.read() is None, "nothing of a span the file no longer holds"
    span.close()
    gaps, got, _ = _drain(log)
    (gap,) = gaps
    assert gap["cursor"] == 0 and gap["lost"] == len(data) - len(got)
    assert got == data[gap["lost"] :]
    log.close()


def test_a_span_keeps_its_bytes_when_its_segment_is_evicted_and_reused(
    tmp_path: Path, private: None
) -> None:
    # Retention of two segments: the oldest file is given back, and its file would be
    # written over by the next segment (the spare) but for the span that holds it.
    log = _log(tmp_path, retention=700 << 10, segment=256 << 10)
    log.append("stdout", b"a" * BLOCK)
    log.append("stdout", b"b" * BLOCK)
    log.append("stdout", b"c" * BLOCK)
    held = log.read_span(0, 1 << 20)
    assert held is not None
    span = held[1]
    before = span.read()
    for i in range(40):
        log.append("stdout", bytes([100 + i % 50]) * BLOCK)
    assert log.first_seq > span.end_seq  # evicted, and the files turned over since
    assert span.read() == before
    span.close()
    log.close()


def test_a_span_cut_short_by_its_file_raises_torn(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100_000)
    fd = os.open(path, os.O_RDONLY)

    class Pin:
        pins = 1

    span = file_span.FileSpan(fd, 0, 100_000, 0, 1, 90_000, 90_000, Pin())
    os.truncate(path, 50_000)
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)

    async def writable() -> None:
        pass

    class Transport:
        def write(self, data: bytes) -> None:
            raise AssertionError("the socket pair takes it all")

    writer = sendfile_writer.SpanWriter(a.fileno())
    with pytest.raises(sendfile_writer.TornSpan):
        asyncio.run(writer.send(span, Transport(), writable))
    writer.close()
    span.close()
    a.close()
    assert b.recv(1 << 20).startswith(b"186a0\r\n" + b"x" * 1000), "the size line went first"
    b.close()


@pytest.mark.timeout(60)
def test_stream_from_the_files_over_http_is_the_output(
    daemon: DaemonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    real = os.sendfile

    def counting(out: int, fd: int, offset: int | None, count: int) -> int:
        n = real(out, fd, offset, count)
        sent.append(n)
        return n

    monkeypatch.setattr(sendfile_writer.os, "sendfile", counting)
    write = "import sys\nfor i in range(96): sys.stdout.buffer.write(bytes([i]) * 65536)\n"
    expected = b"".join(bytes([i]) * BLOCK for i in range(96))
    host = daemon.host
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=30) as http:
        sid = http.post("/sandboxes", json={}).json()["sandbox_id"]
        body = {"argv": [sys.executable, "-c", write]}
        pid = http.post(f"/sandboxes/{sid}/processes", json=body).json()["pid"]
        process = host.sandboxes[sid].processes[pid]
        monkeypatch.setattr(file_span, "_unisolated", False)
        process.log.zero_copy = file_span.files_private
        log = process.log
        wait_until(lambda: log.ended, 20, "the writer's end")
        with http.stream("GET", f"/sandboxes/{sid}/processes/{pid}/stream?cursor=0") as r:
            payload = stream_payload(r.iter_raw())
        http.delete(f"/sandboxes/{sid}")
    assert payload == expected
    assert sum(sent) > len(expected) // 2, "most of it from the files, with sendfile"


@pytest.mark.skipif(
    not isolation.probe().available and not os.environ.get("CI"),
    reason="no namespaces here",
)
async def test_an_isolated_sandboxs_log_is_sent_from_its_files(private: None) -> None:
    config = DaemonConfig(output_cache_bytes=128 << 10, kill_grace=1.0, exit_drain=0.5)
    async with Host(config) as host:
        sandbox = await host.create_sandbox(isolation="namespaces")
        spec = ProcessSpec(cmd="head -c 2097152 /dev/zero")
        process = await sandbox.start_process(spec)
        assert await process.wait(20) == 0
        assert process.log.zero_copy is file_span.files_private
        gaps, got, spans = _drain(process.log)
        assert (gaps, got) == ([], bytes(2 << 20)) and spans
        # A sandbox without isolation could write any log's files: from then on, none is
        # sent unchecked.
        other = await host.create_sandbox(isolation="none")
        assert await (await other.start_process(ProcessSpec(cmd="true"))).wait(10) == 0
        assert process.log.read_span(0, 1 << 20) is None
