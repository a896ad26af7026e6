"""Prometheus metrics under TGI's names, so TGI's Grafana dashboards and alerts work unchanged.

Beside them, the few vLLM-named series that the Gateway API Inference Extension's endpoint
picker and llm-d read to route between replicas (`vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`,
`vllm:lora_requests_info`; docs/scaling.md), from the same sources as the `tgi_*` ones.

Every app owns a `Metrics` with its own `CollectorRegistry` (tests build many apps in
one process). The HTTP handlers record per-request metrics (`request_*`), the engines
record per-step ones (`batch_*`, `queue_size`, `running_batch`) and expose their KV
cache, batch controller, adapters and cost per token through `watch_kv_cache`,
`watch_batch_controller`, `watch_adapters` and `watch_cost`, read at scrape time
(router/metrics_collectors.py).

`render()` writes the Prometheus text format the way TGI's exporter does: counters keep
their bare name (`tgi_request_count`, not `tgi_request_count_total`) and there are no
`_created` series. Duration histograms use TGI's buckets (geometric, 0.15 ms to ~20 min);
token-count histograms use 100 even steps up to the configured token limits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.utils import floatToGoString

from textgate.router.metrics_collectors import (
    AdapterCollector,
    AdapterStats,
    BatchControllerCollector,
    BatchControllerState,
    CostCollector,
    CostReport,
    KvCacheCollector,
    KvCacheStats,
)
from textgate.router.request_record import current_request

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))
BATCH_SIZE_BUCKETS = tuple(float(n) for n in range(1, 1025))
# TGI's `err` label values; other error types keep their own name.
FAILURE_LABELS = {"incomplete_generation": "incomplete"}
PREFILL, DECODE = "prefill", "decode"


class ShardTimes(Protocol):
    """What a Step's answer reports of its time."""

    @property
    def forward_ns(self) -> int: ...

    @property
    def decode_ns(self) -> int: ...


@dataclass(frozen=True)
class RequestTimings:
    """When a successful request was received, queued, started and ended (monotonic seconds)."""

    received_at: float
    queued_at: float
    started_at: float
    ended_at: float
    generated_tokens: int
    first_token_at: float | None = None
    """When its first generated token arrived; None: unknown, or it generated none."""


class Metrics:
    """TGI's metrics (and textgate's KV-cache ones, and vLLM-named ones for routers) in a
    registry of their own."""

    def __init__(self, max_input_tokens: int = 4095, max_total_tokens: int = 4096) -> None:
        """Token-count histograms get 100 even buckets up to the given limits (TGI's choice)."""
        self.registry = CollectorRegistry()
        self._kv_cache: KvCacheCollector | None = None
        self._batch_controller: BatchControllerCollector | None = None
        self._adapters: AdapterCollector | None = None
        self._cost: CostCollector | None = None
        self._define_request_metrics(max_input_tokens, max_total_tokens)
        self._define_batch_metrics()
        self._define_tenant_metrics()

    # ---- requests (HTTP handlers) ----

    def request_received(self) -> None:
        """A generation request arrived (counted before it is even parsed, as TGI does)."""
        self._request_count.inc()

    def request_validated(self, input_length: int, max_new_tokens: int) -> None:
        _note(input_tokens=input_length, max_new_tokens=max_new_tokens)
        self._input_length.observe(input_length)
        self._max_new_tokens.observe(max_new_tokens)

    def request_failed(self, error_type: str) -> None:
        """`error_type` is the one sent to the client (validation, overloaded, generation, ...)."""
        _note(error_type=error_type)
        self._request_failure.labels(err=FAILURE_LABELS.get(error_type, error_type)).inc()

    def request_succeeded(self, timings: RequestTimings) -> None:
        inference = max(timings.ended_at - timings.started_at, 0.0)
        _note(
            generated_tokens=timings.generated_tokens,
            queue_s=round(max(timings.started_at - timings.queued_at, 0.0), 4),
            inference_s=round(inference, 4),
        )
        self._request_success.inc()
        self._request_duration.observe(max(timings.ended_at - timings.received_at, 0.0))
        self._validation_duration.observe(max(timings.queued_at - timings.received_at, 0.0))
        self._queue_duration.observe(max(timings.started_at - timings.queued_at, 0.0))
        self._inference_duration.observe(inference)
        self._time_per_token.observe(inference / max(timings.generated_tokens, 1))
        self._generated_tokens.observe(timings.generated_tokens)
        record = current_request()
        if record is not None and record.tenant is not None:
            self._tenant_timings(record.tenant, timings)

    def _tenant_timings(self, tenant: str, timings: RequestTimings) -> None:
        """The queue time and time to first token of a request with `tenant`'s API key."""
        queued = max(timings.started_at - timings.queued_at, 0.0)
        self._tenant_queue_duration.labels(tenant=tenant).observe(queued)
        if timings.first_token_at is not None:
            ttft = max(timings.first_token_at - timings.received_at, 0.0)
            self._tenant_time_to_first_token.labels(tenant=tenant).observe(ttft)

    def request_cancelled(self, reason: str) -> None:
        """The router stopped a request before its end: its client left
        (`client_disconnected`) or read too slowly (`stream_buffer_overflow`)."""
        _note(cancelled=reason)
        self._request_cancelled.labels(reason=reason).inc()

    def adapter_request(self, adapter: str) -> None:
        """A request that runs on LoRA adapter `adapter` was admitted."""
        _note(adapter=adapter)
        self._adapter_requests.labels(adapter=adapter).inc()

    def adapter_tokens(self, tokens: Mapping[str, int]) -> None:
        """Tokens one step generated per LoRA adapter."""
        for adapter, count in tokens.items():
            self._adapter_tokens.labels(adapter=adapter).inc(count)

    # ---- tenants (API keys, router/http/tenants.py) ----

    def tenant_request(self, tenant: str) -> None:
        """A request with `tenant`'s API key arrived (counted before its quota is checked)."""
        _note(tenant=tenant)
        self._tenant_requests.labels(tenant=tenant).inc()

    def tenant_tokens(self, tenant: str, generated_tokens: int) -> None:
        """One of `tenant`'s requests ended having generated `generated_tokens`."""
        self._tenant_tokens.labels(tenant=tenant).inc(generated_tokens)

    def tenant_rate_limited(self, tenant: str, limit: str) -> None:
        """A 429 for `tenant` over `limit` (requests_per_minute, tokens_per_minute,
        max_concurrent)."""
        self._tenant_rate_limited.labels(tenant=tenant, limit=limit).inc()

    @contextlib.contextmanager
    def count_failures(self) -> Iterator[None]:
        """Count an exception carrying an `error_type` (ValidationError, ...) as a failure."""
        try:
            yield
        except Exception as exc:
            error_type = getattr(exc, "error_type", None)
            if isinstance(error_type, str):
                self.request_failed(error_type)
            raise

    # ---- steps (engines) ----

    def queue_size(self, num_waiting: int) -> None:
        self._queue_size.set(num_waiting)
        self._vllm_waiting.set(num_waiting)

    def running_batch(self, size: int, max_tokens: int) -> None:
        """The running batch after a step: its requests and their token budget."""
        self._batch_size.set(size)
        self._vllm_running.set(size)
        self._batch_max_tokens.set(max_tokens)

    def next_batch(self, size: int) -> None:
        """A new batch of `size` requests is about to be prefilled."""
        self._batch_next_size.observe(size)

    def batch_inference(
        self,
        method: str,
        duration_s: float,
        response: ShardTimes | None,
    ) -> None:
        """One step call (`method`) took `duration_s`; `response` is None if it failed."""
        self._inference_count.labels(method=method).inc()
        if response is None:
            return
        self._inference_success.labels(method=method).inc()
        self._batch_inference_duration.labels(method=method).observe(duration_s)
        self._forward_duration.labels(method=method).observe(response.forward_ns / 1e9)
        self._decode_duration.labels(method=method).observe(response.decode_ns / 1e9)

    def skipped_tokens(self, counts: Sequence[int]) -> None:
        """Each finished request's tokens beyond one per step (TGI's
        `tgi_request_skipped_tokens`: the decode steps speculation saved it)."""
        for count in counts:
            self._skipped_tokens.observe(count)

    def speculative_step(
        self, *, num_drafts: int, num_accepted: int, num_emitted: int, num_sequences: int
    ) -> None:
        """One step's speculation: drafts verified and accepted over `num_sequences`
        sequences, which got `num_emitted` tokens."""
        self._draft_tokens.inc(num_drafts)
        self._accepted_tokens.inc(num_accepted)
        self._verify_steps.inc(num_sequences)
        self._verified_tokens.inc(num_emitted)
        self._num_drafts += num_drafts
        self._num_accepted += num_accepted
        self._num_verify_steps += num_sequences
        self._num_verified_tokens += num_emitted
        self._acceptance_rate.set(self._num_accepted / max(self._num_drafts, 1))
        self._tokens_per_step.set(self._num_verified_tokens / max(self._num_verify_steps, 1))

    def batch_filtered(self, method: str, duration_s: float) -> None:
        """Routing a step's tokens to their requests (and dropping finished ones) took this long."""
        self._filter_duration.labels(method=method).observe(duration_s)

    def watch_kv_cache(self, stats: Callable[[], KvCacheStats]) -> None:
        """Export the paged KV cache: `stats` is called at every scrape."""
        if self._kv_cache is None:
            self._kv_cache = KvCacheCollector(stats)
            self.registry.register(self._kv_cache)
        else:
            self._kv_cache.stats = stats

    def watch_batch_controller(self, state: Callable[[], BatchControllerState]) -> None:
        """Export the paged engine's batch controller: `state` is called at every scrape."""
        if self._batch_controller is None:
            self._batch_controller = BatchControllerCollector(state)
            self.registry.register(self._batch_controller)
        else:
            self._batch_controller.state = state

    def watch_adapters(self, stats: Callable[[], AdapterStats]) -> None:
        """Export the LoRA adapters in use as vLLM does (`vllm:lora_requests_info`): `stats`
        is called at every scrape; nothing is exported while it reports `max_loras` 0."""
        if self._adapters is None:
            self._adapters = AdapterCollector(stats)
            self.registry.register(self._adapters)
        else:
            self._adapters.stats = stats

    def watch_cost(self, report: Callable[[], CostReport]) -> None:
        """Export cost per token (--device-hour-cost): `report` is called at every scrape."""
        if self._cost is None:
            self._cost = CostCollector(report)
            self.registry.register(self._cost)
        else:
            self._cost.report = report

    # ---- exposition ----

    def render(self) -> bytes:
        """The Prometheus text format, with TGI's series names."""
        return render(self.registry)

    def _define_request_metrics(self, max_input_tokens: int, max_total_tokens: int) -> None:
        r = self.registry
        self._request_count = Counter("tgi_request_count", "Total number of requests", registry=r)
        self._request_success = Counter(
            "tgi_request_success", "Number of successful requests", registry=r
        )
        self._request_failure = Counter(
            "tgi_request_failure", "Failed requests per error kind", ["err"], registry=r
        )
        self._request_cancelled = Counter(
            "textgate_request_cancelled",
            "Requests stopped before their end, per reason (client gone, stream overflow)",
            ["reason"],
            registry=r,
        )
        self._adapter_requests = Counter(
            "textgate_request_adapter_count",
            "Requests admitted per LoRA adapter (the base model's are not counted)",
            ["adapter"],
            registry=r,
        )
        self._adapter_tokens = Counter(
            "textgate_request_adapter_generated_tokens",
            "Tokens generated per LoRA adapter",
            ["adapter"],
            registry=r,
        )
        self._request_duration = _seconds("tgi_request_duration", "End-to-end request time", r)
        self._validation_duration = _seconds(
            "tgi_request_validation_duration", "Time spent validating the request", r
        )
        self._queue_duration = _seconds(
            "tgi_request_queue_duration", "Time spent in the queue per request", r
        )
        self._inference_duration = _seconds(
            "tgi_request_inference_duration", "Request inference duration", r
        )
        self._time_per_token = _seconds(
            "tgi_request_mean_time_per_token_duration", "Mean time per token per request", r
        )
        self._input_length = _tokens(
            "tgi_request_input_length", "Input token length per request", max_input_tokens, r
        )
        self._generated_tokens = _tokens(
            "tgi_request_generated_tokens", "Generated tokens per request", max_total_tokens, r
        )
        self._max_new_tokens = _tokens(
            "tgi_request_max_new_tokens", "Maximum new tokens per request", max_total_tokens, r
        )
        self._skipped_tokens = _tokens(
            "tgi_request_skipped_tokens",
            "Speculated tokens accepted per request (tokens beyond one per step)",
            max_total_tokens,
            r,
        )
        self._define_speculation_metrics()

    def _define_speculation_metrics(self) -> None:
        r = self.registry
        self._draft_tokens = Counter(
            "textgate_speculative_draft_tokens",
            "Speculated (draft) tokens the shards verified",
            registry=r,
        )
        self._accepted_tokens = Counter(
            "textgate_speculative_accepted_tokens",
            "Speculated tokens the shards accepted",
            registry=r,
        )
        self._verify_steps = Counter(
            "textgate_speculative_verify_steps",
            "Sequence-steps that verified speculated tokens",
            registry=r,
        )
        self._verified_tokens = Counter(
            "textgate_speculative_emitted_tokens",
            "Tokens those sequence-steps produced (accepted drafts plus the model's own)",
            registry=r,
        )
        self._acceptance_rate = Gauge(
            "textgate_speculative_acceptance_rate",
            "Accepted over verified speculated tokens since start",
            registry=r,
        )
        self._tokens_per_step = Gauge(
            "textgate_speculative_tokens_per_step",
            "Tokens per sequence-step that verified speculated tokens, since start",
            registry=r,
        )
        self._num_drafts = self._num_accepted = 0
        self._num_verify_steps = self._num_verified_tokens = 0

    def _define_batch_metrics(self) -> None:
        r = self.registry
        self._queue_size = Gauge("tgi_queue_size", "Current queue size", registry=r)
        self._batch_size = Gauge("tgi_batch_current_size", "Current batch size", registry=r)
        self._batch_max_tokens = Gauge(
            "tgi_batch_current_max_tokens", "Maximum tokens for the current batch", registry=r
        )
        self._batch_next_size = Histogram(
            "tgi_batch_next_size",
            "Batch size of the next batch",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self._inference_count = Counter(
            "tgi_batch_inference_count", "Inference calls per method", ["method"], registry=r
        )
        self._inference_success = Counter(
            "tgi_batch_inference_success",
            "Successful inference calls per method",
            ["method"],
            registry=r,
        )
        self._batch_inference_duration = _seconds(
            "tgi_batch_inference_duration", "Batch inference duration", r, ["method"]
        )
        self._forward_duration = _seconds(
            "tgi_batch_forward_duration", "Batch forward duration per method", r, ["method"]
        )
        self._decode_duration = _seconds(
            "tgi_batch_decode_duration", "Time spent decoding a batch per method", r, ["method"]
        )
        self._filter_duration = _seconds(
            "tgi_batch_filter_duration",
            "Time spent filtering batches and sending generated tokens per method",
            r,
            ["method"],
        )
        # TGI's dashboards read it; a paged step concatenates no batches, so it stays empty.
        self._concat_duration = _seconds(
            "tgi_batch_concat_duration", "Time spent concatenating batches", r, ["method"]
        )
        # vLLM's names, read by the endpoint picker's queue and running-requests scorers.
        self._vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled", registry=r
        )
        self._vllm_running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch", registry=r
        )

    def _define_tenant_metrics(self) -> None:
        r = self.registry
        self._tenant_requests = Counter(
            "textgate_tenant_request_count", "Requests per tenant (API key)", ["tenant"], registry=r
        )
        self._tenant_tokens = Counter(
            "textgate_tenant_generated_tokens",
            "Tokens generated per tenant (API key)",
            ["tenant"],
            registry=r,
        )
        self._tenant_rate_limited = Counter(
            "textgate_tenant_rate_limited",
            "Requests answered 429 per tenant and the limit they were over",
            ["tenant", "limit"],
            registry=r,
        )
        self._tenant_queue_duration = _seconds(
            "textgate_tenant_request_queue_duration",
            "Time spent in the queue per request, per tenant (API key)",
            r,
            ["tenant"],
        )
        self._tenant_time_to_first_token = _seconds(
            "textgate_tenant_request_time_to_first_token",
            "Time from a request's arrival to its first generated token, per tenant (API key)",
            r,
            ["tenant"],
        )


def _seconds(
    name: str, documentation: str, registry: CollectorRegistry, labels: Iterable[str] = ()
) -> Histogram:
    return Histogram(name, documentation, labels, buckets=DURATION_BUCKETS, registry=registry)


def _tokens(name: str, documentation: str, limit: int, registry: CollectorRegistry) -> Histogram:
    buckets = sorted({limit / 100 * (k + 1) for k in range(100)})
    return Histogram(name, documentation, buckets=buckets, registry=registry)


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text format (0.0.4) with counters under their bare family name, like TGI."""
    lines: list[str] = []
    for family in registry.collect():
        kind = "untyped" if family.type == "unknown" else family.type
        lines.append(f"# HELP {family.name} {_escape_help(family.documentation)}")
        lines.append(f"# TYPE {family.name} {kind}")
        for sample in family.samples:
            if sample.name == family.name + "_created":
                continue
            name = family.name if sample.name == family.name + "_total" else sample.name
            lines.append(f"{name}{_labels(sample.labels)} {floatToGoString(sample.value)}")
    return ("\n".join(lines) + "\n").encode()


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    pairs = ",".join(f'{key}="{_escape_label(value)}"' for key, value in sorted(labels.items()))
    return "{" + pairs + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _note(**facts: Any) -> None:
    """Put what a request did into its access-log record (`router.request_record`), when it has one."""
    record = current_request()
    if record is not None:
        for name, value in facts.items():
            setattr(record, name, value)
