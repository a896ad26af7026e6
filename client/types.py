"""TGI's request parameters and `/generate`, `/generate_stream` answer shapes (pydantic v2).

Field names, nesting and optionality follow TGI's OpenAPI schema and the `text_generation`
0.7.0 client, so code written against that client reads these objects unchanged.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, Field


class GrammarType(str, Enum):
    """Kind of constraint a `Grammar` puts on the generated text."""

    Json = "json"
    Regex = "regex"


class Grammar(BaseModel):
    """Constrained generation: a JSON schema (`dict` or `str`) or a regular expression."""

    type: GrammarType
    value: str | dict[str, Any]


class Parameters(BaseModel):
    """Generation parameters sent as `parameters` to `/generate` and `/generate_stream`.

    Value ranges are checked by `textgate.client.payloads.check_parameters`.
    """

    do_sample: bool = False
    """Sample from the distribution instead of taking the most likely token."""
    max_new_tokens: int | None = 20
    """Most tokens to generate (None: the server's default)."""
    repetition_penalty: float | None = None
    """Penalty on tokens already present (1.0: none)."""
    frequency_penalty: float | None = None
    """Penalty growing with how often a token already appeared (0.0: none, in [-2, 2])."""
    return_full_text: bool = False
    """Prepend the prompt to `generated_text`."""
    stop: list[str] = Field(default_factory=list)
    """Stop when any of these strings is generated (`stop_sequences` in the client methods)."""
    seed: int | None = None
    """Sampling seed."""
    temperature: float | None = None
    """Logits are divided by it before sampling (> 0)."""
    top_k: int | None = None
    """Keep only the k most likely tokens."""
    top_p: float | None = None
    """Keep the smallest set of tokens whose probabilities reach `top_p` (0 < p < 1)."""
    truncate: int | None = None
    """Keep only the last `truncate` tokens of the prompt."""
    typical_p: float | None = None
    """Typical decoding mass (0 < p < 1)."""
    best_of: int | None = None
    """Sample this many sequences and return the one with the highest logprob."""
    watermark: bool = False
    """Watermark the output (Kirchenbauer et al. 2023)."""
    details: bool = True
    """Return `details` (finish reason, tokens, seed); the client always asks for them."""
    decoder_input_details: bool = False
    """Return the prompt tokens with their logprobs in `details.prefill`."""
    top_n_tokens: int | None = None
    """Return the n most likely tokens at each step."""
    grammar: Grammar | None = None
    """Constrain the output to a JSON schema or a regex."""
    ignore_eos: bool | None = None
    """Keep generating past the end-of-sequence token (textgate extension)."""
    min_new_tokens: int | None = None
    """Generate at least this many tokens before eos may stop (textgate extension)."""


class InputToken(BaseModel):
    """A prompt token; the first one has no logprob."""

    id: int
    text: str
    logprob: float | None = None


class Token(BaseModel):
    """A generated token; `special` tokens (eos, ...) are usually skipped when joining text."""

    id: int
    text: str
    logprob: float | None = None
    special: bool


class FinishReason(str, Enum):
    """Why a generation stopped."""

    Length = "length"
    EndOfSequenceToken = "eos_token"
    StopSequence = "stop_sequence"


class BestOfSequence(BaseModel):
    """One of the other `best_of` candidates."""

    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[InputToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class Details(BaseModel):
    """Details of a `/generate` answer."""

    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    prefill: list[InputToken]
    """Prompt tokens; empty unless `decoder_input_details` was asked for."""
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None
    """Per step, the `top_n_tokens` most likely tokens."""
    best_of_sequences: list[BestOfSequence] | None = None


class Response(BaseModel):
    """Answer of `generate`."""

    generated_text: str
    details: Details


class StreamDetails(BaseModel):
    """Details carried by the final event of a stream."""

    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None = None
    input_length: int | None = None


class StreamResponse(BaseModel):
    """One event of `generate_stream`: a token; the last one also has the full text and details."""

    index: int | None = None
    token: Token
    top_tokens: list[Token] | None = None
    generated_text: str | None = None
    details: StreamDetails | None = None

    @property
    def is_final(self) -> bool:
        """True for the event that ends the stream."""
        return self.generated_text is not None or self.details is not None
