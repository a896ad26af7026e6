"""OpenAI-compatible HTTP bodies: /v1/chat/completions, /v1/completions, /v1/models, /chat_tokenize.

Requests follow the OpenAI API reference plus the extras vLLM and TGI accept
(`top_k`, `repetition_penalty`, `ignore_eos`, `min_tokens`, ...). Unknown fields are
ignored, as OpenAI-style servers do, so SDKs sending newer fields keep working.
Responses carry every key the `openai` SDK and `huggingface_hub` read, nulls included.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from textgate.router.generation.schemas import SimpleToken


class StreamOptions(BaseModel):
    """`stream_options` of a streamed request."""

    include_usage: bool = False
    """Send a last chunk with `usage` and no choices before `data: [DONE]`."""


class NullMeansUnset(BaseModel):
    """An OpenAI request body: unknown fields ignored, an explicit null read as unset."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        """Clients such as TGI's own send every unset field as an explicit null."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class SamplingRequest(NullMeansUnset):
    """The fields chat and text completions share."""

    model: str = ""
    """The served model's name, `tgi` or empty (`router.http.served_model`); others get 404."""
    max_tokens: int | None = None
    """Most tokens to generate."""
    temperature: float | None = None
    """>= 0; 0 is greedy decoding; unset samples at 1."""
    top_p: float | None = None
    """Nucleus sampling mass in (0, 1]."""
    n: int = 1
    """Independent choices per prompt."""
    stop: str | list[str] | None = None
    """Stop sequences; the returned text ends before the one that matched."""
    seed: int | None = None
    """Sampling seed; choice i of n uses seed + i."""
    presence_penalty: float | None = None
    """Penalty on every token present so far, in [-2, 2]."""
    frequency_penalty: float | None = None
    """Penalty proportional to a token's count so far, in [-2, 2]."""
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> value in [-100, 100] added to its logit."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Ignored."""
    top_k: int | None = None
    """vLLM/TGI extra: keep the k most likely tokens (0 or -1 disables)."""
    repetition_penalty: float | None = None
    """vLLM/TGI extra: CTRL-style repetition penalty, > 0."""
    ignore_eos: bool = False
    """vLLM extra: keep generating past the end-of-sequence token."""
    min_tokens: int | None = None
    """vLLM extra: suppress end-of-sequence until this many tokens were generated."""
    min_p: float | None = None
    """vLLM extra: keep tokens at least min_p times as likely as the likeliest, in [0, 1]
    (ignored when greedy)."""
    stop_token_ids: list[int] | None = None
    """vLLM extra: more tokens that end the answer (finish reason `stop`), even with
    `ignore_eos`; the token's text stays unless it is special."""
    include_stop_str_in_output: bool = False
    """vLLM extra: keep the matched stop sequence at the end of the text."""
    skip_special_tokens: bool = True
    """vLLM extra: false keeps special tokens' text (end of sequence, chat-template
    markers) in the answer."""
    truncate_prompt_tokens: int | None = None
    """vLLM extra (TGI's `truncate`): keep only the prompt's last this many tokens."""
    prompt_logprobs: int | None = None
    """vLLM extra: each prompt token's logprob and this many likeliest alternatives
    (`prompt_logprobs` of each completion choice, or of the chat answer)."""
    priority: int | None = None
    """vLLM extra: lower is admitted first (unset: 0); no better than the API key's
    `priority`."""
    timeout: float | None = None
    """textgate extra: seconds it may take from its arrival (docs/tenancy.md); unset: the
    `X-Request-Timeout` header's, else the API key's `timeout_s`."""


class ContentPart(BaseModel):
    """One part of a message's content; only `{"type": "text", "text": ...}` is supported."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """A message of `messages`; tool fields are passed through to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """Body of POST /v1/chat/completions (and /chat_tokenize)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    """The newer name of `max_tokens`; wins when both are set."""
    logprobs: bool = False
    """Return each generated token's logprob."""
    top_logprobs: int | None = None
    """Alternatives per token (needs `logprobs`)."""
    response_format: dict[str, Any] | None = None
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`: the answer is constrained to match."""
    tools: list[dict[str, Any]] | None = None
    """Functions the model may call (`{"type": "function", "function": {"name",
    "description", "parameters"}}`); see router/openai/tools.py."""
    tool_choice: str | dict[str, Any] | None = None
    """"auto" (default with tools), "required", "none", or `{"type": "function",
    "function": {"name": ...}}`."""
    add_generation_prompt: bool = True
    """vLLM extra: end the prompt with the template's assistant header."""
    continue_final_message: bool = False
    """vLLM extra: the last (assistant) message is a prefix the answer continues."""


class CompletionRequest(SamplingRequest):
    """Body of POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    """One prompt, or several (choices in prompt order, `n` per prompt); each a string or
    token ids."""
    max_tokens: int | None = 16
    """OpenAI's default for text completions; 0 with `echo` scores the prompt only (vLLM)."""
    echo: bool = False
    """Return the prompt before the completion."""
    best_of: int | None = None
    """Generate this many candidates per prompt and return the `n` most likely."""
    logprobs: int | None = None
    """Return logprobs with this many alternatives per token (0: the tokens' own)."""
    suffix: str | None = None
    """Not supported (must be unset)."""


class Usage(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    """A likely token at one position."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """A generated token's logprob and the most likely alternatives at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """`logprobs` of a chat choice or chunk."""

    content: list[TokenLogprob]


class ToolCallFunction(BaseModel):
    """The function a tool call calls."""

    name: str
    arguments: str
    """The arguments object as JSON text."""


class ToolCall(BaseModel):
    """One call of a tool in an answer."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class _OmitsWhenNone(BaseModel):
    """Leaves the `omit_when_none` fields out while they are null: what OpenAI has none of
    (`tool_calls`), what vLLM gives only when asked (`prompt_logprobs`)."""

    omit_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.omit_when_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class _OmitsNoToolCalls(_OmitsWhenNone):
    """Leaves `tool_calls` out when there are none, as OpenAI does."""

    omit_when_none: ClassVar[tuple[str, ...]] = ("tool_calls",)


class PromptLogprob(BaseModel):
    """One token at one prompt position in vLLM's `prompt_logprobs` (its `Logprob`)."""

    logprob: float
    rank: int | None
    """1 for the likeliest token at the position; null where it is not known."""
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's `prompt_logprobs`: per prompt token null (the first) or token id -> its logprob."""


class AssistantMessage(_OmitsNoToolCalls):
    """The answer of a chat choice: text, or tool calls (content null); with
    --reasoning-parser, the thinking before it (vLLM's `reasoning_content`)."""

    omit_when_none = ("tool_calls", "reasoning_content")

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(_OmitsWhenNone):
    """Body of a non-streamed /v1/chat/completions answer."""

    omit_when_none = ("prompt_logprobs",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM's, of the templated prompt, when asked (`prompt_logprobs`)."""


class ChatDelta(_OmitsNoToolCalls):
    """What a chunk adds to its choice; `role` is repeated on every chunk, as TGI does."""

    omit_when_none = ("tool_calls", "reasoning_content")

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    """With --reasoning-parser: what the thinking adds (vLLM's field)."""
    tool_calls: list[dict[str, Any]] | None = None
    """Tool-call deltas: the first of a call has its `index`, `id`, `type` and
    `function.name`, the next ones pieces of `function.arguments`."""


class ChatChunkChoice(BaseModel):
    """One choice of a chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions `logprobs`: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_OmitsWhenNone):
    """One choice of a text completion (or of one of its chunks)."""

    omit_when_none = ("prompt_logprobs",)

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM's, when asked (`prompt_logprobs`)."""


class Completion(BaseModel):
    """Body of a /v1/completions answer, and each event of its stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_OmitsWhenNone):
    """The served model, or one of its LoRA adapters, in /v1/models."""

    omit_when_none: ClassVar[tuple[str, ...]] = ("parent",)

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "textgate"
    parent: str | None = None
    """A LoRA adapter's base model (vLLM's field); absent for the base itself."""


class ModelList(BaseModel):
    """Body of GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ChatTokenizeResponse(BaseModel):
    """Body of POST /chat_tokenize (TGI's shape)."""

    tokenize_response: list[SimpleToken]
    templated_text: str
