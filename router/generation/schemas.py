"""The canonical generation request: TGI's body shape, which every API maps onto.

TGI's `/generate` body is the richest request any of the APIs speak, so it is the one the
router validates: the OpenAI routes translate their bodies into a `GenerateRequest`
(`router/openai/params.py`), and `validation.Validator` turns it into the engine's
`ValidRequest`. Field names and defaults are TGI's, so its JSON is read as TGI reads it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class GenerateParameters(BaseModel):
    """The `parameters` of a /generate or /generate_stream body (TGI names and defaults)."""

    best_of: int | None = None
    """Generate this many sequences and return the one with the highest logprob sum."""
    decoder_input_details: bool = False
    """Return the prompt tokens with their logprobs in `details.prefill`."""
    details: bool = False
    """Return `details` (finish reason, tokens, seed)."""
    do_sample: bool = False
    """Sample instead of greedy decoding."""
    frequency_penalty: float | None = None
    """Penalty proportional to a token's count so far, in [-2, 2]."""
    presence_penalty: float | None = None
    """Penalty on every token present so far, in [-2, 2] (OpenAI's; not in TGI)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value in [-100, 100] added to its logit (OpenAI's; not in TGI)."""
    max_new_tokens: int | None = None
    """Most tokens to generate; None: up to max_total_tokens - prompt tokens."""
    repetition_penalty: float | None = None
    """CTRL-style penalty on tokens already present; 1.0 disables."""
    return_full_text: bool | None = None
    """Prepend the prompt to the generated text."""
    seed: int | None = None
    """Sampling seed; random when unset."""
    stop: list[str] = Field(default_factory=list)
    """Stop when the generated text ends with one of these."""
    temperature: float | None = None
    """Softmax temperature, > 0."""
    top_k: int | None = None
    """Keep the k most likely tokens, > 0."""
    top_n_tokens: int | None = None
    """Return this many most likely alternatives for every generated token."""
    top_p: float | None = None
    """Nucleus sampling mass, in (0, 1)."""
    truncate: int | None = None
    """Keep only the last `truncate` prompt tokens."""
    typical_p: float | None = None
    """Typical decoding mass, in (0, 1)."""
    watermark: bool = False
    """Kirchenbauer et al. watermark; not implemented, so setting it is rejected."""
    adapter_id: str | None = None
    """LoRA adapter to run with (one of --lora-adapters, listed in /info); None: the base."""
    grammar: Any = None
    """Structured output: `{"type": "json", "value": <JSON schema>}` or `{"type": "regex",
    "value": "..."}` (router/generation/grammar.py); the text is constrained to match it."""
    ignore_eos: bool = False
    """Keep generating after the end-of-sequence token (benchmarking)."""
    min_new_tokens: int | None = None
    """End-of-sequence is suppressed until this many tokens were generated (benchmarking)."""
    min_p: float | None = None
    """Keep tokens at least min_p times as likely as the likeliest, in [0, 1] (vLLM's; not
    in TGI)."""
    stop_token_ids: list[int] | None = None
    """More end-of-sequence tokens for this request, even with `ignore_eos` (vLLM's; not
    in TGI)."""
    skip_special_tokens: bool = True
    """Leave special tokens (end of sequence, chat-template markers) out of the text; false
    keeps their text in it, and the tokens then all show `special: false` (vLLM's; not in
    TGI)."""
    priority: int | None = None
    """Lower is admitted first; no better than the API key's `priority`. Unset: 0, or the
    key's `priority` when that is worse (vLLM's; not in TGI)."""
    timeout: float | None = None
    """Seconds the request may take from its arrival, > 0: still queued past it, it fails
    with a `timeout` error; running, it ends with what it has (finish reason `length`).
    Unset: the `X-Request-Timeout` header's, else the API key's `timeout_s` (not in TGI)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _null_stop_is_empty(cls, value: Any) -> Any:
        return [] if value is None else value


class GenerateRequest(BaseModel):
    """Body of POST /generate and /generate_stream."""

    inputs: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    add_special_tokens: bool = True
    """Let the tokenizer add its special tokens (e.g. BOS) to the prompt."""
    stream: bool = False
    """Only read by the compat route `/`."""


class SimpleToken(BaseModel):
    """One prompt token of a /tokenize answer: id, text, and its character span in the prompt."""

    model_config = ConfigDict(frozen=True)

    id: int
    text: str
    start: int
    stop: int
