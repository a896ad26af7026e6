"""What every route that generates does around the engine: render the chat template,
validate, collect or stream the answer, counting each request in the metrics once.

The APIs differ in their bodies and answers (router/openai/, router/anthropic/); the
steps between are these.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from textgate.router.engine.channel import Channel, ErrorEvent
from textgate.router.engine.request import ValidRequest
from textgate.router.generation.chat_template import render_chat
from textgate.router.generation.result import Generated, collect
from textgate.router.generation.schemas import GenerateRequest
from textgate.router.generation.tools import ToolPlan, template_reads_tools, tool_messages
from textgate.router.generation.validation import Wording
from textgate.router.http.delivery import CLIENT_DISCONNECTED, StreamPacing, guard_stream
from textgate.router.http.event_stream import FrameWriter, OnEnd, event_stream
from textgate.router.http.request_io import ClientDisconnectedError, unless_disconnected
from textgate.router.http.sse import SseResponse
from textgate.router.http.state import RouterState
from textgate.router.metrics import RequestTimings

CLIENT_CLOSED_REQUEST = 499
"""The status of a client that left before its (non-streamed) answer was ready (nginx's)."""


class Serving:
    """The shared steps of the generating routes over one `RouterState`."""

    def __init__(self, state: RouterState) -> None:
        self._state = state
        self._metrics = state.metrics

    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: ToolPlan | None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt of chat-template `messages`, with the tools of `tools` shown (the
        template's own format, or a system message for templates without one)."""
        tokenizer = self._state.tokenizer
        template_tools = None
        if tools is not None:
            reads_tools = template_reads_tools(tokenizer)
            messages = tool_messages(messages, tools, reads_tools)
            template_tools = [t.as_openai() for t in tools.tools] if reads_tools else None
        # Templates are jinja: rendering long conversations is CPU work for a thread.
        return await asyncio.to_thread(
            render_chat,
            tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=template_tools,
        )

    async def validate(
        self,
        inputs: GenerateRequest,
        stream: bool,
        input_ids: Sequence[int] | None = None,
        *,
        wording: Wording,
        received: float,
    ) -> ValidRequest:
        """`inputs` validated and tokenized (ValidationError), counted as validated; its
        deadline counts from `received` (when the route got it, time.monotonic())."""
        valid = await self._state.validator.validate(
            inputs, stream=stream, input_ids=input_ids, wording=wording, received_at=received
        )
        self._metrics.request_validated(valid.input_length, valid.max_new_tokens)
        return valid

    async def collect(
        self, request: Request, channels: Sequence[Channel], received: float
    ) -> list[Generated] | None:
        """Every channel's result, or None when the client left first (all are cancelled)."""
        try:
            results = await unless_disconnected(request, _collect_all(channels))
        except ClientDisconnectedError:
            if any(c.cancelled for c in channels):
                self._metrics.request_cancelled(CLIENT_DISCONNECTED)
            return None
        self._metrics.request_succeeded(
            RequestTimings(
                received_at=received,
                queued_at=min(g.queued_at for g in results),
                started_at=min(g.started_at for g in results),
                ended_at=max(g.ended_at for g in results),
                generated_tokens=sum(g.finished.generated_tokens for g in results),
                first_token_at=_earliest(g.first_token_at for g in results),
            )
        )
        return results

    def stream(self, channels: Sequence[Channel], writer: FrameWriter, received: float) -> Response:
        """The SSE response of `channels` in `writer`'s frames, paced and bounded as
        configured; a client that leaves cancels them."""
        pacing = StreamPacing.from_config(self._state.config)
        on_disconnect = guard_stream(channels, pacing, self._metrics)
        frames = event_stream(channels, writer, self._on_stream_end(channels, received), pacing)
        return SseResponse(frames, on_disconnect=on_disconnect)

    def _on_stream_end(self, channels: Sequence[Channel], received: float) -> OnEnd:
        def on_end(failure: ErrorEvent | None, generated_tokens: int) -> None:
            if failure is not None:
                self._metrics.request_failed(failure.error_type)
                return
            queued = min(c.queued_at for c in channels)
            started = min(c.started_at or c.queued_at for c in channels)
            first_token = _earliest(c.first_token_at for c in channels)
            ended = time.monotonic()
            timings = RequestTimings(
                received, queued, started, ended, generated_tokens, first_token
            )
            self._metrics.request_succeeded(timings)

        return on_end


def _earliest(times: Iterable[float | None]) -> float | None:
    """The first of the known `times`; None when none is."""
    return min((t for t in times if t is not None), default=None)


async def _collect_all(channels: Sequence[Channel]) -> list[Generated]:
    """Every channel's result; GenerationError when one fails (the others are cancelled)."""
    tasks = [asyncio.ensure_future(collect(c)) for c in channels]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        # No-ops once finished; otherwise the shards drop the rest (failure, client gone),
        # and their collectors, which would wait for events that no longer come, stop.
        for channel in channels:
            channel.cancel()
        for task in tasks:
            task.cancel()
