"""A streaming response for server-sent events that notices a client going away at once.

Starlette's StreamingResponse listens for ``http.disconnect`` only under ASGI < 2.4; under 2.4 it waits for a
write to raise, and uvicorn silently drops writes to a closed connection. Here a listener runs beside the
writer in every case, and ``on_close`` always runs (cancelling the generation and freeing its worker),
whether the stream ended, failed or was cut off.
"""

from __future__ import annotations

from typing import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:
                async def write():
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone (a server may raise on send)
                        pass
                    tg.cancel_scope.cancel()

                async def listen():
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(write)
                tg.start_soon(listen)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            self.on_close()
