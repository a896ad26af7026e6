"""OpenAI streams: SSE chunks for every choice of a request, then `data: [DONE]`.

The choices' channels are read together, so n choices stream interleaved as their
tokens come; what is due for a choice when a write goes out becomes one chunk. A choice
that fails ends the stream with OpenAI's error event (`{"error": {"message", "type",
...}}`, TGI's `error_type` beside it) and cancels the others; the stream always ends
with `data: [DONE]`. Leaving the generator early (client gone) cancels every choice.
The reading of the channels is router/http/event_stream.py's; this writes the chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from pydantic import BaseModel

from textgate.router.engine.channel import Channel, ErrorEvent, StepEvent
from textgate.router.generation.reasoning import ReasoningParser
from textgate.router.generation.result import TextLedger, visible_text
from textgate.router.generation.stop_text import StreamText, TextOptions
from textgate.router.http.delivery import StreamPacing
from textgate.router.http.errors import openai_error
from textgate.router.http.event_stream import UNPACED, OnEnd, event_stream
from textgate.router.http.sse import sse_frame
from textgate.router.openai.answer import AnswerStream
from textgate.router.openai.output import (
    ResponseMeta,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    usage,
)
from textgate.router.openai.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
    Usage,
)

DONE_FRAME = b"data: [DONE]\n\n"


class ChunkWriter(Protocol):
    """Turns one choice's events into chunks of one response kind (chat or text)."""

    def opening(self, index: int) -> BaseModel | None:
        """The chunk a choice starts with, if any."""

    def step(self, index: int, event: StepEvent) -> BaseModel | None:
        """The chunk for a step of a choice (None when it adds nothing)."""

    def usage(self, usage: Usage) -> BaseModel:
        """The last chunk: usage and no choices."""


def openai_frames(
    channels: Sequence[Channel],
    writer: ChunkWriter,
    prompt_tokens: int,
    include_usage: bool,
    on_end: OnEnd | None = None,
    pacing: StreamPacing = UNPACED,
) -> AsyncIterator[bytes]:
    """The SSE writes of a streamed response whose choice i reads `channels[i]`.

    Each write carries what is due (`deliveries`): a choice's steps in it become one
    chunk, as with vLLM's --stream-interval. `on_end` is not called when the client
    leaves first.
    """
    frames = ChunkFrames(writer, len(channels), prompt_tokens, include_usage)
    return event_stream(channels, frames, on_end, pacing)


class ChunkFrames:
    """A `ChunkWriter`'s chunks as the frames of an OpenAI stream: `data:` lines, the
    error or usage chunk last, then `data: [DONE]`."""

    def __init__(
        self, writer: ChunkWriter, num_choices: int, prompt_tokens: int, include_usage: bool
    ) -> None:
        self._writer = writer
        self._num_choices = num_choices
        self._prompt_tokens = prompt_tokens
        self._include_usage = include_usage

    def opening(self) -> bytes:
        openings = [self._writer.opening(index) for index in range(self._num_choices)]
        return b"".join(sse_frame(chunk) for chunk in openings if chunk is not None)

    def step(self, index: int, event: StepEvent) -> bytes:
        chunk = self._writer.step(index, event)
        return b"" if chunk is None else sse_frame(chunk)

    def closing(self, failure: ErrorEvent | None, generated_tokens: int) -> bytes:
        if failure is not None:
            return sse_frame(openai_error(failure.message, failure.error_type)) + DONE_FRAME
        if not self._include_usage:
            return DONE_FRAME
        last = self._writer.usage(usage(self._prompt_tokens, generated_tokens))
        return sse_frame(last) + DONE_FRAME


class ChatChunks:
    """`chat.completion.chunk`s: a role chunk per choice, content or tool-call deltas, the
    finish reason.

    A choice's deltas are the differences between successive readings of its text so
    far (router/generation/answer.py), the reading the non-streamed message is made of: joined,
    they are exactly that message.
    """

    def __init__(
        self,
        meta: ResponseMeta,
        num_choices: int,
        options: TextOptions,
        *,
        logprobs: bool,
        tools: bool = False,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self._meta = meta
        self._ledgers = [TextLedger() for _ in range(num_choices)]
        self._texts = [StreamText(options) for _ in range(num_choices)]
        self._logprobs = logprobs
        self._tools = tools
        # With tools, each choice's text is a tool call object, streamed as call deltas.
        self._answers = [AnswerStream(tools, reasoning) for _ in range(num_choices)]

    def opening(self, index: int) -> BaseModel | None:
        return self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=""))])

    def step(self, index: int, event: StepEvent) -> BaseModel | None:
        event = self._ledgers[index].settle(event)
        done = event.finished
        text = self._texts[index].push(event.tokens, None if done is None else done.finish_reason)
        logprobs = chat_logprobs(event.tokens, event.top_tokens) if self._logprobs else None
        reason = None if done is None else finish_reason(done.finish_reason)
        answer = self._answers[index]
        content, calls = answer.push(text, done is not None)
        thinking = answer.thinking or None
        delta = ChatDelta(
            content=(content or None) if self._tools or thinking else content,
            reasoning_content=thinking,
        )
        if calls:
            delta = ChatDelta(content=None, tool_calls=calls, reasoning_content=thinking)
        if answer.called and reason == "stop":
            reason = "tool_calls"
        quiet = not content and not calls and not thinking
        if quiet and done is None and not (logprobs and logprobs.content):
            return None
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
        return self._chunk([choice])

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> BaseModel:
        return ChatCompletionChunk(**self._meta.fields(), choices=choices, usage=usage)


class CompletionChunks:
    """`text_completion` chunks: the echoed prompt first (if asked), then text deltas."""

    def __init__(
        self,
        meta: ResponseMeta,
        prompts: Sequence[str],
        options: TextOptions,
        *,
        echo: bool,
        logprobs: bool,
    ) -> None:
        self._meta = meta
        self._prompts = prompts
        """The prompt of each choice."""
        self._ledgers = [TextLedger() for _ in prompts]
        self._texts = [StreamText(options) for _ in prompts]
        self._offsets = [len(p) if echo else 0 for p in prompts]
        """Where each choice's next token text starts (for logprobs' text_offset)."""
        self._echo = echo
        self._logprobs = logprobs

    def opening(self, index: int) -> BaseModel | None:
        if not self._echo:
            return None
        return self._chunk([CompletionChoice(index=index, text=self._prompts[index])])

    def step(self, index: int, event: StepEvent) -> BaseModel | None:
        event = self._ledgers[index].settle(event)
        done = event.finished
        text = self._texts[index].push(event.tokens, None if done is None else done.finish_reason)
        logprobs = None
        if self._logprobs:
            logprobs = completion_logprobs([], event.tokens, event.top_tokens, self._offsets[index])
            self._offsets[index] += len(visible_text(event.tokens))
        if not text and done is None and not (logprobs and logprobs.tokens):
            return None
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=None if done is None else finish_reason(done.finish_reason),
        )
        return self._chunk([choice])

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> BaseModel:
        return Completion(**self._meta.fields(), choices=choices, usage=usage)
