"""Server-sent events: `data: {json}\\n\\n` frames, sent as soon as they exist.

A write is whatever the frame iterator yields: one frame, or several joined when the
client reads slower than tokens come (`router/http/delivery.py` decides).

`SseResponse` listens for `http.disconnect` beside the body (whatever ASGI spec
version the server speaks), so a client that leaves cancels its request even while
the request still waits in the queue and no frame is being written. While no frame is
due it sends a keep-alive comment every `KEEP_ALIVE_S` (TGI: axum's default, 15 s), so
proxies and load balancers do not close a stream that waits behind a long queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from textgate.router.http.errors import ErrorResponse

KEEP_ALIVE_S = 15.0
KEEP_ALIVE_FRAME = b":\n\n"  # an SSE comment: every client ignores it

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # Proxies such as nginx would otherwise hold tokens back in their buffers.
    "X-Accel-Buffering": "no",
}


def sse_frame(payload: BaseModel, event: str | None = None) -> bytes:
    """One SSE event carrying `payload` as JSON; `event` names its type (an `event:`
    line, as typed streams such as OpenAI's Responses and Anthropic's Messages send)."""
    named = "" if event is None else f"event: {event}\n"
    return f"{named}data: {payload.model_dump_json()}\n\n".encode()


def error_frame(message: str, error_type: str) -> bytes:
    """The final event of a stream that failed."""
    return sse_frame(ErrorResponse(error=message, error_type=error_type))


class SseResponse(StreamingResponse):
    """A text/event-stream response that reports its client leaving to `on_disconnect`."""

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        *,
        on_disconnect: Callable[[], None],
        headers: Mapping[str, str] | None = None,
        keep_alive_s: float = KEEP_ALIVE_S,
    ) -> None:
        super().__init__(frames, headers={**SSE_HEADERS, **(headers or {})})
        self._frames = frames
        self._on_disconnect = on_disconnect
        self._keep_alive_s = keep_alive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self._on_disconnect()
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self._send_frames(send)
            except OSError:
                # Servers speaking ASGI >= 2.4 report a gone client by failing `send`.
                self._on_disconnect()
            group.cancel_scope.cancel()

    async def _send_frames(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        # One timer task per stream sends the keep-alives, so a frame costs no more than
        # its own send (no task or timeout per frame) and is never interrupted.
        last_sent = time.monotonic()

        async def keep_alive() -> None:
            nonlocal last_sent
            while True:
                await asyncio.sleep(last_sent + self._keep_alive_s - time.monotonic())
                if time.monotonic() - last_sent >= self._keep_alive_s:
                    await send(_body(KEEP_ALIVE_FRAME))
                    last_sent = time.monotonic()

        pinger = asyncio.ensure_future(keep_alive())
        try:
            async for frame in self._frames:
                await send(_body(frame))
                last_sent = time.monotonic()
        finally:
            with anyio.CancelScope(shield=True):
                pinger.cancel()
                await asyncio.gather(pinger, return_exceptions=True)
                # Run the generator's cleanup (it cancels the request) even when cancelled.
                aclose = getattr(self._frames, "aclose", None)
                if aclose is not None:
                    await aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _body(frame: bytes) -> dict[str, object]:
    """An ASGI body message that keeps the response open."""
    return {"type": "http.response.body", "body": frame, "more_body": True}
