"""The daemon's send path at full rate (issue 11): several frames per send, byte-exact, and
the choice of event loop."""

from __future__ import annotations

import sys

import pytest

from sandboxkit.daemon.host import Host
from sandboxkit.daemon.process import ProcessSpec
from sandboxkit.daemon.server import event_loop_factory
from sandboxkit.wire import FrameDecoder, FrameKind

BLOCKS = 32  # 64 KiB writes: 2 MiB in all
WRITER = (
    "import sys\n"
    f"for i in range({BLOCKS}):\n"
    "    sys.stdout.buffer.write(bytes([65 + i % 26]) * 65536)\n"
)


class CountingSink:
    """Takes everything at once, counting its sends."""

    def __init__(self) -> None:
        self.sends = 0
        self.data = bytearray()

    async def send(self, data: bytes) -> None:
        self.sends += 1
        self.data += data

    async def close(self) -> None:
        pass


async def test_frames_are_coalesced_into_fewer_sends_byte_exact(host: Host) -> None:
    sbx = await host.create_sandbox()
    process = await sbx.start_process(ProcessSpec(argv=(sys.executable, "-c", WRITER)))
    await process.wait()
    consumer = host.consumer(process, 0)
    sink = CountingSink()
    await host.start_stream(consumer, sink)

    frames = FrameDecoder().feed(bytes(sink.data))
    data = [f for f in frames if f.kind == FrameKind.DATA]
    assert frames[-1].kind == FrameKind.END
    expected = b"".join(bytes([65 + i % 26]) * 65536 for i in range(BLOCKS))
    assert b"".join(f.payload for f in data) == expected
    assert [f.meta["seq"] for f in data] == list(range(len(data)))
    # One send per 64 KiB frame costs a Python round trip each; they go out in groups.
    assert sink.sends < len(data) / 1.5, (sink.sends, len(data))
    assert consumer.frames_sent == len(frames)


def test_event_loop_choice() -> None:
    assert event_loop_factory("asyncio") is None
    with pytest.raises(ValueError, match="event_loop"):
        event_loop_factory("trio")
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        assert event_loop_factory("auto") is None  # not installed: asyncio's own
    else:
        factory = event_loop_factory("auto")
        assert factory is not None and "uvloop" in type(factory()).__module__
