"""The response of ``GET …/stream``: one consumer's frames, as the body of a chunked
HTTP response (straight to uvicorn's connection where :mod:`.fast_path` can, through
ASGI otherwise); the consumer is detached when the client goes away."""

from __future__ import annotations

import asyncio

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sandboxkit.daemon.consumers import Consumer
from sandboxkit.daemon.host import Host
from sandboxkit.daemon.http.fast_path import CYCLE, AsgiSink
from sandboxkit.wire import CONTENT_TYPE

__all__ = ["FrameStreamResponse"]


class FrameStreamResponse(Response):
    """Streams one consumer's frames; detaches it when the client goes away."""

    def __init__(self, host: Host, consumer: Consumer) -> None:
        super().__init__(media_type=CONTENT_TYPE)
        self.host = host
        self.consumer = consumer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cycle = scope.get(CYCLE) if scope.get("http_version") == "1.1" else None
        sink = AsgiSink(send, cycle)
        sink.hold_head()  # until the start frame follows it
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", CONTENT_TYPE.encode()),
                    (b"cache-control", b"no-store"),
                    (b"x-sandboxkit-consumer", self.consumer.consumer_id.encode()),
                ],
            }
        )
        stream = self.host.start_stream(self.consumer, sink)
        gone = asyncio.ensure_future(_disconnected(receive))
        closed = asyncio.ensure_future(sink.closed.wait())
        try:
            await asyncio.wait({stream, gone, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The client left (or this request is cancelled): the consumer goes too. If
            # only the sink closed, the consumer lives on elsewhere (a snapshot ghost).
            if not closed.done():
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
            for task in (gone, closed):
                task.cancel()
            await asyncio.gather(gone, closed, return_exceptions=True)


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
