"""Anthropic's stream of one answer: typed SSE events (`event:` lines), in Anthropic's order.

    message_start        the message with no content yet, the prompt's usage
    content_block_start  a block: text (at once, without tools or a reasoning parser),
                         or thinking, text or tool_use once the text says which
    ping
    content_block_delta  thinking_delta, text_delta, or input_json_delta (the call's
                         input JSON text)
    content_block_stop   when the next block starts, or the answer ends
    message_delta        stop_reason, stop_sequence, usage
    message_stop

With --reasoning-parser the thinking is block 0 and the answer block 1. A failure ends
the stream with an `error` event (Anthropic's error body). The deltas are the
differences between successive readings of the text so far (router/generation/reasoning.py,
then router/generation/answer.py), the reading the non-streamed answer is made of:
joined, they are exactly that answer's thinking, text or call input.
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
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from textgate.router.engine.channel import ErrorEvent, StepEvent
from textgate.router.generation.answer import AnswerDiff
from textgate.router.generation.reasoning import ReasoningDiff, ReasoningParser
from textgate.router.generation.result import INCOMPLETE, TextLedger
from textgate.router.generation.stop_text import StreamText, TextOptions
from textgate.router.http.errors import anthropic_error, anthropic_status
from textgate.router.http.sse import sse_frame


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
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self._message_id = message_id
        self._model = model
        self._input_tokens = input_tokens
        self._options = options
        self._tools = tools
        self._reasoning = reasoning
        self._ledger = TextLedger()
        self._text = StreamText(options)
        self._thinking = ReasoningDiff(reasoning)
        self._answer = AnswerDiff(tools)
        self._block = -1
        """The open block's index (-1: none opened yet)."""
        self._kind: str | None = None
        """The open block's type."""
        self._stop: StopDelta | None = None

    def opening(self) -> bytes:
        message = MessageResponse(
            id=self._message_id,
            model=self._model,
            content=[],
            stop_reason=None,
            usage=Usage(input_tokens=self._input_tokens, output_tokens=0),
        )
        # Without tools or thinking the answer is text: its block opens at once, as
        # Anthropic's does.
        frames = [event_frame(MessageStart(message=message))]
        if not self._tools and self._reasoning is None:
            frames.append(self._open(TextBlock(text="")))
        return b"".join([*frames, event_frame(Ping())])

    def step(self, index: int, event: StepEvent) -> bytes:
        event = self._ledger.settle(event)
        done = event.finished
        text = self._text.push(event.tokens, None if done is None else done.finish_reason)
        thinking, rest = self._thinking.push(text, done is not None)
        content, calls = self._answer.push(rest, done is not None)
        frames: list[bytes] = []
        if thinking:
            if self._kind != "thinking":
                frames.append(self._open(ThinkingBlock(thinking="")))
            frames.append(self._delta(ThinkingDelta(thinking=thinking)))
        if content:
            if self._kind != "text":
                frames.append(self._open(TextBlock(text="")))
            frames.append(self._delta(TextDelta(text=content)))
        for call in calls:
            if call.name is not None:
                opened = ToolUseBlock(id=new_id("toolu"), name=call.name, input={})
                frames.append(self._open(opened))
            if call.arguments:
                frames.append(self._delta(InputJsonDelta(partial_json=call.arguments)))
        if done is not None:
            if self._kind is None:
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
                event_frame(ContentBlockStop(index=self._block)),
                event_frame(MessageDelta(delta=self._stop, usage=usage)),
                event_frame(MessageStop()),
            ]
        )

    def _open(self, block: OutputBlock) -> bytes:
        """Start `block`, after stopping the one open before it."""
        frames = [] if self._kind is None else [event_frame(ContentBlockStop(index=self._block))]
        self._block += 1
        self._kind = block.type
        frames.append(event_frame(ContentBlockStart(index=self._block, content_block=block)))
        return b"".join(frames)

    def _delta(self, delta: TextDelta | InputJsonDelta | ThinkingDelta) -> bytes:
        return event_frame(ContentBlockDelta(index=self._block, delta=delta))
