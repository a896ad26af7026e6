"""The router's settings: built once by the launcher, passed as JSON, frozen and validated."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

# Tokens one step of paged shards on the CPU may compute when --max-batch-prefill-tokens is
# not given. Every running request waits for each step, and on a CPU a step costs about
# 0.5 ms per token of a small model: TGI's default (max_input_tokens + 50, ~4k) would stall
# every stream for seconds whenever prompts arrive. 256 gave the lowest time to first token
# at the same throughput as 512 on the default model (docs/benchmarks.md).
CPU_STEP_TOKENS = 256

# A request without a length generates at most this many tokens. TGI documents 100 for
# /generate and lets chat run to max_total_tokens; one bounded default on every route
# keeps a forgotten length from generating thousands of tokens on a CPU, while leaving
# a chat answer room to finish.
DEFAULT_MAX_NEW_TOKENS = 256


# Tokens a stream may leave unread before its request is cancelled. Kernel and proxy
# buffers hold more beyond it; this bounds what the router keeps per stuck client
# (~0.5 KB of Python objects per token) while letting a client that stalls for seconds
# catch up.
DEFAULT_MAX_STREAM_BUFFER = 2048


@dataclass(frozen=True)
class RouterConfig:
    """Every knob of the router process; field names follow TGI's launcher flags."""

    model_id: str
    """Model name shown by /info."""
    tokenizer_path: str
    """Local folder with tokenizer.json / tokenizer_config.json (loaded with AutoTokenizer)."""
    shard_uds_path: str = "/tmp/textgate-server"
    """Shard rank r listens on unix://{shard_uds_path}-{r}; the router dials rank 0 first."""
    hostname: str = "0.0.0.0"
    """Address the HTTP server binds."""
    port: int = 8080
    """Port the HTTP server binds."""
    max_concurrent_requests: int = 128
    """Requests in flight (validating, waiting or generating) before answering 429."""
    max_best_of: int = 2
    """Largest best_of a request may ask for."""
    max_stop_sequences: int = 4
    """Most stop sequences per request."""
    max_top_n_tokens: int = 5
    """Largest top_n_tokens a request may ask for."""
    max_input_tokens: int = 4095
    """Longest prompt in tokens (after truncation)."""
    max_total_tokens: int = 4096
    """Longest prompt + max_new_tokens of one request."""
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    """Tokens generated when a request gives no max_new_tokens / max_tokens (bounded by
    what max_total_tokens leaves)."""
    max_batch_prefill_tokens: int | None = None
    """Tokens one prefill (paged shards: one step) may compute; None = `with_prefill_default`."""
    max_batch_total_tokens: int | None = None
    """Tokens (prompt + budget) the running batch may hold; None = from Warmup or a default."""
    max_batch_size: int | None = None
    """Most requests in the running batch; None = unlimited."""
    waiting_served_ratio: float = 0.3
    """TGI's padded-batch admission ratio, kept for its flag and /info; the paged
    scheduler admits by its step budget and ignores it."""
    max_waiting_tokens: int = 20
    """Decode steps after which waiting requests join regardless of the ratio."""
    max_client_batch_size: int = 4
    """Most inputs in one client request (shown by /info)."""
    validation_workers: int = 2
    """Threads that tokenize and validate requests off the event loop."""
    prefix_caching: bool = True
    """Paged shards: share the KV blocks of identical prompt prefixes between requests."""
    kv_offload_bytes: int = 0
    """Bytes of host memory per shard for prefix-cache blocks evicted from the device cache
    (they come back on a prefix hit instead of being recomputed); 0 = no host tier."""
    kv_offload_dir: str | None = None
    """Directory of the disk KV tier, below the host tier (blocks survive a restart of the
    same model and KV layout); None = no disk tier. The router only reads whether it is set."""
    target_itl_ms: float | None = None
    """Paged shards: inter-token latency the batch controller keeps each step under; None =
    derived from the machine (`batch_controller` docstring), 0 = fixed budgets."""
    target_ttft_ms: float | None = None
    """Paged shards: time to first token the batch controller defends; None = 16 inter-token
    targets."""
    speculate: int = 0
    """`--speculate`: most tokens n-gram speculation proposes per sequence and step
    (router/engine/ngram_proposer.py, docs/speculative.md); 0 = off."""
    speculative_ngram: str = "1:3"
    """`--speculative-ngram` MIN:MAX: the n-gram lengths speculation matches, longest first."""
    speculative_model: str | None = None
    """`--speculative-model`: the shards' draft model guesses the drafts (router asks it,
    `Speculator.proposals`); None: n-gram drafts."""
    max_logit_bias: float = 100.0
    """`--max-logit-bias`: the largest `logit_bias` magnitude a request may set (OpenAI's
    100 by default)."""
    reasoning_parser: str | None = None
    """`--reasoning-parser`: reads a reasoning model's thinking apart from its answer
    (router/generation/reasoning.py); None: the text is all answer."""
    allow_runtime_lora_updating: bool = False
    """Serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: they are
    not routes, as in vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    stream_interval: int = 1
    """Tokens per SSE write after a stream's first (vLLM's --stream-interval); 1 = each
    token as soon as the client can take it."""
    max_stream_rate: float | None = None
    """Most tokens per second sent to one stream (a steady pace for UIs); None = unpaced."""
    max_stream_buffer: int = DEFAULT_MAX_STREAM_BUFFER
    """Tokens a stream may hold unread before its request is cancelled with an error event."""
    smooth_speculative_streams: bool = False
    """`--smooth-speculative-streams`: the tokens one step brings at once (speculation's
    accepted drafts) go out spread over the stream's recent step interval, not in a burst
    (router/http/delivery.py `smoothed_due`)."""
    api_key: str | None = None
    """When set, every route requires `Authorization: Bearer <api_key>`."""
    api_keys_file: str | None = None
    """YAML or JSON file of API keys, each of a tenant with optional limits
    (docs/tenancy.md); reloaded on SIGHUP. With `api_key` too, that key is the tenant
    "default"'s."""
    audit_log: str | None = None
    """File that gets one JSON line per finished request: tenant, route, model, tokens,
    status, latency (router/http/audit_log.py); None: no audit log."""
    audit_log_content: bool = False
    """Put each request's prompt and output text in its audit-log line too."""
    audit_log_max_bytes: int = 100 * 1024 * 1024
    """Size past which the audit log is rotated (5 old files are kept)."""
    cors_allow_origin: tuple[str, ...] = ()
    """Origins allowed by CORS; empty = no CORS headers."""
    payload_limit: int = 2_000_000
    """Largest request body in bytes."""
    json_output: bool = False
    """Log JSON lines instead of text."""
    otlp_endpoint: str | None = None
    """OpenTelemetry collector (OTLP/gRPC) the router's spans go to; None = no tracing."""
    otlp_service_name: str = "textgate"
    """The router's `service.name` in traces."""
    graceful_termination_timeout: float = 90.0
    """Seconds in-flight requests get to finish after SIGTERM (router/http/drain.py)."""
    shard_step_timeout: float = 600.0
    """Seconds one shard call (a step, a ClearCache) may take; a shard that takes
    longer is reported as hung and the step's requests fail (a generation error) instead of
    waiting forever."""
    header_timeout: float = 30.0
    """Seconds a connection has to deliver a request's headers (from its start or its
    previous response); a client slower than that (slow-loris) is disconnected."""
    body_timeout: float = 60.0
    """Seconds a request's whole body has to arrive once its headers have; else 408."""
    model_dtype: str | None = None
    """Dtype shown by /info; None = the shard's Info."""
    model_device_type: str | None = None
    """Device type shown by /info; None = the shard's Info."""
    device_hour_cost: float | None = None
    """`--device-hour-cost`: USD one hour of the serving group's devices costs; /metrics and
    /info then report cost per 1k input and output tokens (router/engine/cost_meter.py);
    None: no costs."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        for name in (
            "max_concurrent_requests",
            "max_best_of",
            "max_input_tokens",
            "max_total_tokens",
            "default_max_new_tokens",
            "max_client_batch_size",
            "validation_workers",
            "payload_limit",
            "audit_log_max_bytes",
        ):
            _require_positive(name, getattr(self, name))
        if self.target_itl_ms is not None and not self.target_itl_ms >= 0:
            raise ValueError(
                f"target_itl_ms must be >= 0 (0 = fixed budgets), got {self.target_itl_ms}"
            )
        if not 0 < self.max_logit_bias <= 100:
            raise ValueError(f"max_logit_bias must be > 0 and <= 100, got {self.max_logit_bias}")
        if self.target_ttft_ms is not None and not self.target_ttft_ms > 0:
            raise ValueError(f"target_ttft_ms must be > 0, got {self.target_ttft_ms}")
        for name in ("max_stop_sequences", "max_top_n_tokens", "max_waiting_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_batch_size", "max_batch_prefill_tokens"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        if self.speculate < 0:
            raise ValueError(f"speculate must be >= 0 (0 = off), got {self.speculate}")
        parse_ngram_range(self.speculative_ngram)
        self._check_streaming()
        if not self.graceful_termination_timeout >= 0:
            raise ValueError(
                f"graceful_termination_timeout must be >= 0, got {self.graceful_termination_timeout}"
            )
        for name in ("shard_step_timeout", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.device_hour_cost is not None and not (
            math.isfinite(self.device_hour_cost) and self.device_hour_cost > 0
        ):
            raise ValueError(f"device_hour_cost must be > 0, got {self.device_hour_cost}")
        if self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if (self.kv_offload_bytes or self.kv_offload_dir) and not self.prefix_caching:
            raise ValueError("kv_offload_bytes and kv_offload_dir need prefix_caching")
        if self.waiting_served_ratio < 0:
            raise ValueError(f"waiting_served_ratio must be >= 0, got {self.waiting_served_ratio}")
        self._check_token_limits()

    def _check_streaming(self) -> None:
        _require_positive("stream_interval", self.stream_interval)
        if self.max_stream_rate is not None and not self.max_stream_rate > 0:
            raise ValueError(f"max_stream_rate must be > 0, got {self.max_stream_rate}")
        if self.max_stream_buffer < self.stream_interval:
            raise ValueError(
                f"max_stream_buffer ({self.max_stream_buffer}) must be >= "
                f"stream_interval ({self.stream_interval})"
            )

    def _check_token_limits(self) -> None:
        if self.max_input_tokens >= self.max_total_tokens:
            raise ValueError(
                f"max_input_tokens ({self.max_input_tokens}) must be < "
                f"max_total_tokens ({self.max_total_tokens})"
            )
        total = self.max_batch_total_tokens
        prefill = self.max_batch_prefill_tokens or 0
        if total is not None and total < max(prefill, self.max_total_tokens):
            raise ValueError(
                f"max_batch_total_tokens ({total}) must be >= max_batch_prefill_tokens "
                f"({self.max_batch_prefill_tokens}) and >= max_total_tokens ({self.max_total_tokens})"
            )

    @classmethod
    def from_json(cls, text: str) -> RouterConfig:
        """Parse the launcher's `--config-json`; unknown keys are an error, not ignored."""
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"router config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("router config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown router config keys: {', '.join(unknown)}")
        if data.get("cors_allow_origin") is not None:
            data["cors_allow_origin"] = tuple(data["cors_allow_origin"])
        else:
            data.pop("cors_allow_origin", None)
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"router config: {exc}") from exc

    def with_prefill_default(self, *, device_type: str) -> RouterConfig:
        """This config with max_batch_prefill_tokens filled in when unset: CPU_STEP_TOKENS
        on the CPU, else TGI's max_input_tokens + 50."""
        if self.max_batch_prefill_tokens is not None:
            return self
        budget = CPU_STEP_TOKENS if device_type == "cpu" else self.max_input_tokens + 50
        return dataclasses.replace(self, max_batch_prefill_tokens=budget)

    @property
    def prefill_tokens(self) -> int:
        """max_batch_prefill_tokens, which the router resolves before building any batch."""
        if self.max_batch_prefill_tokens is None:
            raise RuntimeError("max_batch_prefill_tokens is unset: call with_prefill_default()")
        return self.max_batch_prefill_tokens

    @property
    def batch_total_tokens(self) -> int:
        """max_batch_total_tokens, or TGI's fallback when neither the flag nor the shards'
        Warmup gives a capacity."""
        if self.max_batch_total_tokens is not None:
            return self.max_batch_total_tokens
        return max(16_000, self.max_total_tokens, self.prefill_tokens)


def parse_ngram_range(text: str) -> tuple[int, int]:
    """`--speculative-ngram`'s MIN:MAX (or one N: MIN = MAX = N) as (min, max);
    ValueError naming the flag when it is not 1 <= MIN <= MAX."""
    head, sep, tail = text.partition(":")
    try:
        low, high = int(head), int(tail if sep else head)
    except ValueError:
        raise ValueError(f"--speculative-ngram must be MIN:MAX (e.g. 1:3), got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"--speculative-ngram needs 1 <= MIN <= MAX, got {text!r}")
    return low, high


def _require_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
