"""Shapes of the OpenAI-compatible routes, `/v1/chat/completions` and `/v1/completions`.

Fields follow the OpenAI API reference and TGI's OpenAPI schema. Fields that servers
disagree on (`system_fingerprint`, `usage`, `logprobs`) are optional so the client reads
answers from TGI, textgate and OpenAI-like servers alike. `ChatComplete`, `Choice` and
`ChatCompletionComplete` are the `text_generation` 0.7.0 names.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator


class FunctionCall(BaseModel):
    """The function a tool call invokes; `arguments` is JSON text (TGI may send an object)."""

    name: str | None = None
    arguments: str | dict[str, Any] | None = None
    description: str | None = None


class ToolCall(BaseModel):
    """A tool call in an assistant message."""

    id: str | int | None = None
    type: str = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message, sent in `messages` and returned as a choice's `message`."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    """Text, or OpenAI content parts (`[{"type": "text", "text": ...}]`)."""
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Tool(BaseModel):
    """A tool the model may call: `{"type": "function", "function": {name, description, parameters}}`."""

    type: str = "function"
    function: dict[str, Any]


class TopLogprob(BaseModel):
    """An alternative token at one position."""

    token: str
    logprob: float


class TokenLogprob(BaseModel):
    """Logprob of a generated token and its most likely alternatives."""

    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    """Per-token logprobs of a chat choice."""

    content: list[TokenLogprob] | None = None


class Usage(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionChoice(BaseModel):
    """One answer of a non-streamed chat completion."""

    index: int
    message: Message
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    """Answer of `chat` (`object == "chat.completion"`)."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None


class DeltaFunction(BaseModel):
    """A piece of a streamed tool call's function."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call."""

    index: int = 0
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class ChoiceDelta(BaseModel):
    """What a chunk adds to a choice."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _single_tool_call_as_list(cls, value: Any) -> Any:
        # TGI streams one tool call as an object where OpenAI streams a list.
        return [value] if isinstance(value, dict) else value


class ChatCompletionChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: ChoiceDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion (`object == "chat.completion.chunk"`)."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None
    """Only on the last chunk, when `stream_options.include_usage` was asked for."""


class CompletionChoice(BaseModel):
    """One choice of a text completion (streamed or not)."""

    index: int
    text: str
    logprobs: Any = None
    """OpenAI sends an object, TGI a list of floats; kept as received."""
    finish_reason: str | None = None


class Completion(BaseModel):
    """Answer of `completion`, and each event of `completion_stream` (`object == "text_completion"`)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


# Names used by the `text_generation` 0.7.0 client.
ChatComplete = ChatCompletion
ChatCompletionComplete = ChatCompletionChoice
Choice = ChatCompletionChunkChoice
