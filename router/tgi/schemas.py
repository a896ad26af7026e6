"""TGI's HTTP bodies as pydantic models; `model_dump(mode="json")` gives TGI's exact JSON.

Field names, defaults and nulls follow text-generation-inference's router: optional
response fields TGI leaves out (`details` when not asked for, empty `top_tokens`,
`best_of_sequences` without best_of) are left out here too, not sent as null.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_serializer
from pydantic import SerializerFunctionWrapHandler as Handler

from textgate.router.engine.channel import FinishReason
from textgate.router.metrics_collectors import CostRates, CostReport


class _Response(BaseModel):
    """A response body that leaves out the fields TGI omits when they are null or empty."""

    model_config = ConfigDict(frozen=True)
    _omit_if_empty: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_empty(self, handler: Handler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self._omit_if_empty:
            if data.get(name) in (None, []):
                data.pop(name, None)
        return data


class Token(_Response):
    """A generated token (also used for top-n alternatives)."""

    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(_Response):
    """A prompt token; the first one has no logprob (null)."""

    id: int
    text: str
    logprob: float | None


class BestOfSequence(_Response):
    """One of the best_of candidates that was not chosen."""

    _omit_if_empty = frozenset({"top_tokens"})

    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] = Field(default_factory=list)


class SpeculationDetails(_Response):
    """textgate's own (TGI has no such field): what speculative decoding did for one
    request (docs/speculative.md)."""

    draft_tokens: int
    """Proposed tokens (drafts) the model verified for it."""
    accepted_tokens: int
    """Of those, the ones accepted: tokens it got without a decode step of their own."""

    @classmethod
    def of(cls, num_drafts: int, num_accepted: int) -> SpeculationDetails | None:
        """The details of a request that had drafts verified; None for one that had none."""
        return cls(draft_tokens=num_drafts, accepted_tokens=num_accepted) if num_drafts else None


class Details(_Response):
    """`details` of a /generate response."""

    _omit_if_empty = frozenset({"best_of_sequences", "top_tokens", "speculation"})

    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    best_of_sequences: list[BestOfSequence] | None = None
    top_tokens: list[list[Token]] = Field(default_factory=list)
    speculation: SpeculationDetails | None = None
    """Left out when no draft was verified for the request (always without --speculate)."""


class GenerateResponse(_Response):
    """Body of a /generate answer."""

    _omit_if_empty = frozenset({"details"})

    generated_text: str
    details: Details | None = None


class StreamDetails(_Response):
    """`details` of the last /generate_stream event."""

    _omit_if_empty = frozenset({"speculation"})

    finish_reason: FinishReason
    generated_tokens: int
    seed: int | None
    input_length: int
    speculation: SpeculationDetails | None = None
    """As in `Details`."""


class StreamResponse(_Response):
    """One /generate_stream event: a token; the last one also carries the whole text."""

    _omit_if_empty = frozenset({"top_tokens"})

    index: int
    token: Token
    top_tokens: list[Token] = Field(default_factory=list)
    generated_text: str | None = None
    details: StreamDetails | None = None


class CostRatesInfo(_Response):
    """Busy device seconds attributed to input and output tokens, the tokens counted, and
    USD per 1k tokens of each (null without any token of that kind)."""

    input_busy_seconds: float
    output_busy_seconds: float
    input_tokens: int
    output_tokens: int
    per_1k_input_tokens_usd: float | None
    per_1k_output_tokens_usd: float | None

    @classmethod
    def from_rates(cls, rates: CostRates) -> CostRatesInfo:
        return cls(
            input_busy_seconds=rates.input_busy_s,
            output_busy_seconds=rates.output_busy_s,
            input_tokens=rates.num_input_tokens,
            output_tokens=rates.num_output_tokens,
            per_1k_input_tokens_usd=rates.per_1k_input_tokens_usd,
            per_1k_output_tokens_usd=rates.per_1k_output_tokens_usd,
        )


class CostInfo(_Response):
    """textgate's cost per token (--device-hour-cost; docs/scaling.md, "Cost per token")."""

    device_hour_cost_usd: float
    window_seconds: float
    #: the steps of the last `window_seconds`: the live costs.
    window: CostRatesInfo
    #: every step since startup.
    lifetime: CostRatesInfo
    #: named tenant -> its requests' share of the window (anonymous requests count only
    #: in `window` and `lifetime`).
    tenants: dict[str, CostRatesInfo]

    @classmethod
    def from_report(cls, report: CostReport) -> CostInfo:
        return cls(
            device_hour_cost_usd=report.device_hour_cost_usd,
            window_seconds=report.window_s,
            window=CostRatesInfo.from_rates(report.window),
            lifetime=CostRatesInfo.from_rates(report.lifetime),
            tenants={
                name: CostRatesInfo.from_rates(rates) for name, rates in report.tenants.items()
            },
        )


class Info(_Response):
    """Body of GET /info (TGI's fields across versions: `max_input_length` is the old name)."""

    model_id: str
    model_sha: str | None = None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str | None = None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_input_length: int
    max_total_tokens: int
    waiting_served_ratio: float
    max_batch_total_tokens: int
    max_waiting_tokens: int
    max_batch_size: int | None
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None = None
    docker_label: str | None = None
    #: textgate's: the weight quantization method (`--quantize`, or the checkpoint's own);
    #: None when the weights are unquantized.
    quantize: str | None = None
    #: textgate's: bytes of weights resident on each shard (rank 0's count), as loaded.
    model_weight_bytes: int | None = None
    #: textgate's: the KV cache's element dtype (`--kv-cache-dtype`: the weights' dtype,
    #: int8 or fp8_e4m3) and the bytes one token takes in it on each shard (scales
    #: included); None without a paged cache.
    kv_cache_dtype: str | None = None
    kv_cache_bytes_per_token: int | None = None
    #: textgate's: the attention backend the shards run (`--attention` resolved: flash,
    #: triton, torch or cpu); None when the shards did not say.
    attention_backend: str | None = None
    #: textgate's: how the shards run the model and why ("native LlamaForCausalLM",
    #: "transformers Olmo2ForCausalLM on the paged engine (no native class)", ...).
    model_implementation: str | None = None
    #: textgate's: the LoRA adapters loaded (--lora-adapters, /v1/load_lora_adapter), by id;
    #: None without any.
    lora_adapters: list[str] | None = None
    #: textgate's: most LoRA adapters loaded at once (--max-loras); None where the model
    #: takes none.
    max_loras: int | None = None
    #: textgate's: highest LoRA rank an adapter may have (--max-lora-rank); None where the
    #: model takes none.
    max_lora_rank: int | None = None
    #: textgate's: on a CPU, what each kernel runs on here (the C kernels' instruction-set
    #: level, the int8 kernel, torch's int4 layout, ...; docs/hardware.md); None on a GPU.
    cpu_kernels: dict[str, str] | None = None
    #: textgate's: the startup report (the machine, the dtype and the budgets derived from
    #: the shards' measured step, with their sources; docs/autoconfig.md); None when the
    #: shards measured nothing.
    autoconfig: dict[str, Any] | None = None
    #: textgate's: cost per 1k input and output tokens from measured busy time
    #: (--device-hour-cost); None without the flag.
    cost: CostInfo | None = None
