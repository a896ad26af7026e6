"""OpenAI Responses API bodies: the POST /v1/responses request, the response object, its
stream's typed events.

The request follows OpenAI's reference for what a stateless text server can serve;
unknown fields are ignored, as the other OpenAI bodies do, and what is known but not
served is refused by router/openai/responses_input.py. The response object carries every
field the `openai` SDK requires (`id`, `created_at`, `model`, `object`, `output`,
`parallel_tool_calls`, `tool_choice`, `tools`), nulls included.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from textgate.router.openai.schemas import NullMeansUnset

ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TextConfig(BaseModel):
    """`text`: the answer's format."""

    model_config = ConfigDict(extra="allow")

    format: dict[str, Any] = Field(default_factory=lambda: {"type": "text"})
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "name",
    "schema", "strict"}`: the answer is constrained to match (the grammar engine)."""


class ResponsesRequest(NullMeansUnset):
    """Body of POST /v1/responses."""

    model: str = ""
    """The served model's name, `tgi` or empty (`params.served_model`); others get 404."""
    input: str | list[dict[str, Any]]
    """A user message as text, or the conversation as items: messages (`role`, `content`
    as text or `input_text`/`output_text` parts), `function_call` and
    `function_call_output` items."""
    instructions: str | None = None
    """A system message before the input."""
    max_output_tokens: int | None = None
    """Most tokens to generate; past it the response is `incomplete`."""
    temperature: float | None = None
    """>= 0; 0 is greedy decoding; unset samples at 1."""
    top_p: float | None = None
    """Nucleus sampling mass in (0, 1]."""
    text: TextConfig = Field(default_factory=TextConfig)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    """Function tools, Responses' flat shape: `{"type": "function", "name", "description",
    "parameters"}`."""
    tool_choice: str | dict[str, Any] = "auto"
    """"auto", "required", "none" or `{"type": "function", "name": ...}`."""
    parallel_tool_calls: bool = True
    """Accepted; an answer makes at most one call."""
    stream: bool = False
    """Send the response as typed server-sent events."""
    store: bool = True
    """Accepted; nothing is stored (this server is stateless)."""
    previous_response_id: str | None = None
    """Refused: no response is stored to continue from."""
    conversation: Any = None
    """Refused: no conversation is stored."""
    background: bool = False
    """Refused when true: responses are answered on the request."""
    metadata: dict[str, str] | None = None
    """Echoed in the response."""
    user: str | None = None
    """Echoed in the response."""
    top_logprobs: int | None = None
    """Refused when above 0: logprobs are not returned on this route."""
    priority: int | None = None
    """vLLM extra: lower is admitted first (unset: 0); no better than the API key's
    `priority`."""
    timeout: float | None = None
    """textgate extra: seconds it may take from its arrival (docs/tenancy.md); unset: the
    `X-Request-Timeout` header's, else the API key's `timeout_s`."""


class OutputText(BaseModel):
    """A text content part of an output message."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """The assistant's text answer, an item of `output`."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(BaseModel):
    """A call of a function tool, an item of `output`; its result comes back as a
    `function_call_output` input item with the same `call_id`."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    """The arguments object as JSON text."""
    status: ItemStatus


class ReasoningText(BaseModel):
    """The thinking's text, the one content part of a reasoning item."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """What a reasoning model thought before answering (with --reasoning-parser), the
    first item of `output`; a client may send it back in `input`, where it is dropped (as
    chat templates drop earlier turns' thinking)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    """Always empty: no summary is made."""
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | FunctionCall | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of a response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    """Why a response is `incomplete`."""

    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a response `failed`."""

    code: str
    message: str


class ResponseObject(BaseModel):
    """The response: body of a non-streamed answer, and carried by the lifecycle events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    temperature: float | None
    top_p: float | None
    text: TextConfig
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    store: Literal[False] = False
    """Nothing is stored, whatever the request's `store`."""
    usage: ResponseUsage | None = None
    metadata: dict[str, str]
    user: str | None


class StreamEvent(BaseModel):
    """One typed event of a streamed response; `type` names it, as its SSE `event:` does.

    The writer numbers every event of a stream (`sequence_number`, from 0)."""

    type: str
    sequence_number: int = 0


class LifecycleEvent(StreamEvent):
    """`response.created`, `.in_progress`, `.completed`, `.incomplete`, `.failed`."""

    response: ResponseObject


class OutputItemEvent(StreamEvent):
    """`response.output_item.added` / `.done`."""

    output_index: int
    item: OutputItem


class ItemEvent(StreamEvent):
    """An event about one output item."""

    item_id: str
    output_index: int


class PartEvent(ItemEvent):
    """An event about one content part of an output message (there is one: index 0)."""

    content_index: int = 0


class ContentPartEvent(PartEvent):
    """`response.content_part.added` / `.done`."""

    part: OutputText | ReasoningText


class TextDeltaEvent(PartEvent):
    """`response.output_text.delta`: what the text adds."""

    type: str = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(PartEvent):
    """`response.output_text.done`: the whole text."""

    type: str = "response.output_text.done"
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningDeltaEvent(PartEvent):
    """`response.reasoning_text.delta`: what the thinking adds."""

    type: str = "response.reasoning_text.delta"
    delta: str


class ReasoningDoneEvent(PartEvent):
    """`response.reasoning_text.done`: the whole thinking."""

    type: str = "response.reasoning_text.done"
    text: str


class ArgumentsDeltaEvent(ItemEvent):
    """`response.function_call_arguments.delta`: what a call's arguments add."""

    type: str = "response.function_call_arguments.delta"
    delta: str


class ArgumentsDoneEvent(ItemEvent):
    """`response.function_call_arguments.done`: a call's whole arguments."""

    type: str = "response.function_call_arguments.done"
    name: str
    arguments: str


class ErrorStreamEvent(StreamEvent):
    """`error`: the stream failed (`code` is TGI's error type); `response.failed` follows."""

    type: str = "error"
    code: str
    message: str
    param: str | None = None
