"""The response that streams a completion's server-sent events.

Starlette's StreamingResponse watches for the client's disconnect inside an anyio task group, and
anyio holds back cancelling a task whose wake-up is already due. A stream fed a token every few
milliseconds always has one due, so the engine loop had to give the handlers a second turn per
step for a disconnect to get through. Here the watcher cancels the writing task with plain asyncio,
which takes effect at the writer's next resumption, due or not: one turn per step is enough, and
each chunk goes to `send` with nothing in between.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], headers: Mapping[str, str] | None = None,
                 on_disconnect: Callable[[], None] | None = None) -> None:
        self.body_iterator = body
        # Called the moment the client is known to be gone, before the writer is cancelled: that takes
        # a few more turns of the loop, each of which may be an engine step for nobody.
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.body_iterator:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _until_disconnect(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self.on_disconnect is not None:
            self.on_disconnect()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        watcher = asyncio.ensure_future(self._until_disconnect(receive))
        try:
            await asyncio.wait((writer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # A client gone: cancelling the writer runs the body's cleanup, which aborts its sequences.
            for task in (writer, watcher):
                task.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)
        if not writer.cancelled():
            writer.result()  # an error while writing is the app's, as with any response
