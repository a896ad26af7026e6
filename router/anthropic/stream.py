"""Anthropic's stream of one answer: typed SSE events (`event:` lines), in Anthropic's order.

    message_start        the message with no content yet, the prompt's usage
    content_block_start  the answer's one block: text (at once, without tools) or,
                         with tools, text or tool_use once the text says which
    ping
    content_block_delta  text_delta, or input_json_delta (the call's input JSON text)
    content_block_stop
    message_delta        stop_reason, stop_sequence, usage
    message_stop

A failure ends the stream with an `error` event (Anthropic's error body). The deltas are
the differences between successive readings of the text so far
(router/generation/answer.py), the reading the non-streamed answer is made of: joined,
they are exactly that answer's text or call input.
"""

from __future__ import annotations

from pydantic import BaseModel

from textgate.router.anthropic.output import new_id, stop_delta
from textgate.router.anthropic.schemas import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    MessageDelta,
    MessageResponse,
    MessageStart,
    MessageStop,
    OutputBlock,
    Ping,
    StopDelta,
    TextBlock,
    TextDelta,
    ToolUseBlock,
    Usage,
)
from textgate.router.engine.channel import ErrorEvent, StepEvent
from textgate.router.generation.answer import AnswerDiff
from textgate.router.generation.result import INCOMPLETE, TextLedger
from textgate.router.generation.stop_text import StreamText, TextOptions
from textgate.router.http.errors import anthropic_error, anthropic_status
from textgate.router.http.sse import sse_frame

BLOCK = 0
"""The index of the answer's block: an answer is one text or one tool_use block."""


def event_frame(payload: BaseModel) -> bytes:
    """One Anthropic event: its `type` as the SSE event name, and its body."""
    return sse_frame(payload, event=getattr(payload, "type", None))


class MessageEvents:
    """The events of one streamed answer (an `event_stream` frame writer)."""

    def __init__(
        self,
        message_id: str,
        model: str,
        input_tokens: int,
        options: TextOptions,
        *,
        tools: bool,
    ) -> None:
        self._message_id = message_id
        self._model = model
        self._input_tokens = input_tokens
        self._options = options
        self._tools = tools
        self._ledger = TextLedger()
        self._text = StreamText(options)
        self._answer = AnswerDiff(tools)
        self._opened = False
        self._stop: StopDelta | None = None

    def opening(self) -> bytes:
        message = MessageResponse(
            id=self._message_id,
            model=self._model,
            content=[],
            stop_reason=None,
            usage=Usage(input_tokens=self._input_tokens, output_tokens=0),
        )
        # Without tools the answer is text: its block opens at once, as Anthropic's does.
        frames = [event_frame(MessageStart(message=message))]
        if not self._tools:
            frames.append(self._open(TextBlock(text="")))
        return b"".join([*frames, event_frame(Ping())])

    def step(self, index: int, event: StepEvent) -> bytes:
        event = self._ledger.settle(event)
        done = event.finished
        text = self._text.push(event.tokens, None if done is None else done.finish_reason)
        content, calls = self._answer.push(text, done is not None)
        frames: list[bytes] = []
        if content:
            if not self._opened:
                frames.append(self._open(TextBlock(text="")))
            frames.append(
                event_frame(ContentBlockDelta(index=BLOCK, delta=TextDelta(text=content)))
            )
        for call in calls:
            if call.name is not None:
                opened = ToolUseBlock(id=new_id("toolu"), name=call.name, input={})
                frames.append(self._open(opened))
            if call.arguments:
                delta = InputJsonDelta(partial_json=call.arguments)
                frames.append(event_frame(ContentBlockDelta(index=BLOCK, delta=delta)))
        if done is not None:
            if not self._opened:
                frames.append(self._open(TextBlock(text="")))
            self._stop = stop_delta(done, self._options, called=self._answer.called)
        return b"".join(frames)

    def closing(self, failure: ErrorEvent | None, generated_tokens: int) -> bytes:
        if failure is not None or self._stop is None:
            failure = failure or INCOMPLETE
            status = anthropic_status(failure.error_type)
            return event_frame(anthropic_error(failure.message, status))
        usage = Usage(input_tokens=self._input_tokens, output_tokens=generated_tokens)
        return b"".join(
            [
                event_frame(ContentBlockStop(index=BLOCK)),
                event_frame(MessageDelta(delta=self._stop, usage=usage)),
                event_frame(MessageStop()),
            ]
        )

    def _open(self, block: OutputBlock) -> bytes:
        self._opened = True
        return event_frame(ContentBlockStart(index=BLOCK, content_block=block))
