"""Anthropic Messages HTTP bodies: the request, the message answer, the stream's events.

Requests follow Anthropic's API reference; fields this server has no use for
(`metadata`, `cache_control`, `service_tier`, ...) are accepted and ignored, as the
SDKs send them. Content blocks are read as their `type` says (router/anthropic/prompt.py
refuses the ones it cannot serve), so a client sending a newer block type gets a clear
400 rather than a parse error.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(BaseModel):
    """One block of a message's content: `text`, `tool_use` or `tool_result` are served."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    """`text` blocks."""
    id: str | None = None
    """`tool_use` blocks: the call's id."""
    name: str | None = None
    """`tool_use` blocks: the tool called."""
    input: dict[str, Any] | None = None
    """`tool_use` blocks: the call's arguments."""
    tool_use_id: str | None = None
    """`tool_result` blocks: the call answered."""
    content: str | list[ContentBlock] | None = None
    """`tool_result` blocks: the result, as text or text blocks."""
    is_error: bool = False
    """`tool_result` blocks: the tool failed (said so to the model)."""


class InputMessage(_Body):
    """One turn of `messages`."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolSpec(_Body):
    """A client tool: its name, what it does, and its input's JSON schema."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None
    """Absent or "custom": Anthropic's server tools (web search, bash, ...) are refused."""


class ToolChoice(_Body):
    """`{"type": "auto" | "any" | "tool" | "none", "name": ...}`."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """The tool to call, with type "tool"."""
    disable_parallel_tool_use: bool = False
    """Ignored: an answer holds at most one call."""


class CountTokensRequest(_Body):
    """Body of POST /v1/messages/count_tokens: what the prompt is made of."""

    model: str = ""
    """The served model's name, `tgi` or empty (`router.http.served_model`); others 404."""
    messages: list[InputMessage]
    system: str | list[ContentBlock] | None = None
    """The system prompt: text, or text blocks."""
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """Body of POST /v1/messages."""

    max_tokens: int
    """Most tokens to generate (required, as in Anthropic's API)."""
    stop_sequences: list[str] | None = None
    """The answer ends before the first of these it generates (`stop_reason` "stop_sequence")."""
    stream: bool = False
    temperature: float | None = None
    """In [0, 1]; 0 is greedy decoding; unset samples at 1."""
    top_p: float | None = None
    """Nucleus sampling mass in (0, 1]."""
    top_k: int | None = None
    """Keep the k most likely tokens (> 0)."""
    metadata: dict[str, Any] | None = None
    """Ignored."""
    thinking: dict[str, Any] | None = None
    """Accepted and ignored (`{"type": "enabled", "budget_tokens": N}`): whether the model
    thinks is its own and its template's doing; --reasoning-parser reads the thinking out."""
    timeout: float | None = None
    """textgate extra: seconds it may take from its arrival (the `timeout` of
    docs/tenancy.md); unset: the `X-Request-Timeout` header's, else the API key's."""


class TextBlock(BaseModel):
    """A text answer."""

    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    """A tool call: its id (`toolu_…`), the tool, and its arguments."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    """What a reasoning model thought before answering (with --reasoning-parser). Its
    `signature` is empty: nothing here signs thinking, and a block sent back in a later
    turn is dropped from the prompt whatever it carries."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


OutputBlock = TextBlock | ToolUseBlock | ThinkingBlock

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    """Token counts: the templated prompt's and the generated ones."""

    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    """The answer of POST /v1/messages (and the `message` of a stream's `message_start`)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    """The stop sequence that ended the answer, with `stop_reason` "stop_sequence"."""
    usage: Usage


class TokenCount(BaseModel):
    """The answer of POST /v1/messages/count_tokens."""

    input_tokens: int


class MessageStart(BaseModel):
    """The first event: the message, with no content yet."""

    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class ContentBlockStart(BaseModel):
    """A content block opens (text empty, a tool_use's input {})."""

    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock


class TextDelta(BaseModel):
    """Text the open text block adds."""

    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    """Input JSON text the open tool_use block adds."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str
    """The next piece of the call's `input` JSON text."""


class ThinkingDelta(BaseModel):
    """Thinking the open thinking block adds."""

    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class ContentBlockDelta(BaseModel):
    """What the open block adds."""

    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStop(BaseModel):
    """The block is complete."""

    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    """Why the answer ended."""

    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDelta(BaseModel):
    """The answer ended: why, and its usage."""

    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: Usage
    """Cumulative: the prompt's tokens and every generated one."""


class MessageStop(BaseModel):
    """The last event."""

    type: Literal["message_stop"] = "message_stop"


class Ping(BaseModel):
    """Sent once after `message_start`, as Anthropic does."""

    type: Literal["ping"] = "ping"
