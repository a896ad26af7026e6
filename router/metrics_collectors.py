"""What the metrics read from a paged engine at scrape time: its KV cache, batch controller,
LoRA adapters and cost per token, as Prometheus collectors (textgate's own series and the vLLM-named
ones routers read; router/metrics.py registers them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class BatchControllerState(Protocol):
    """A paged engine's batch controller, read at scrape time (`ControllerState`)."""

    @property
    def prefill_budget(self) -> int: ...

    @property
    def batch_limit(self) -> int: ...

    @property
    def target_itl_s(self) -> float | None: ...

    @property
    def utilization(self) -> float: ...

    @property
    def decode_step_latency_s(self) -> float: ...

    @property
    def mixed_step_latency_s(self) -> float: ...


@dataclass(frozen=True)
class KvCacheStats:
    """A paged engine's KV cache, read at scrape time."""

    num_used_blocks: int
    num_free_blocks: int
    block_size: int
    num_prefix_hit_tokens: int
    """Prompt tokens served from the prefix cache since the scheduler started."""
    num_prefix_query_tokens: int
    """Prompt tokens looked up in the prefix cache since the scheduler started."""
    num_preemptions: int
    """Requests whose blocks were taken back (recompute) since the scheduler started."""
    kv_tiers: KvTierStats | None = None
    """The host and disk KV tiers (--kv-offload-bytes / --kv-offload-dir); None: off."""


@dataclass(frozen=True)
class KvTierStats:
    """The KV tiers below the device cache, read at scrape time."""

    hit_tokens: Mapping[str, int]
    """Tier ("device", "host", "disk") -> prompt tokens its prefix hits served."""
    num_offloaded_blocks: int
    """Blocks copied from the device into the host tier."""
    num_restored_blocks: Mapping[str, int]
    """Tier ("host", "disk") -> blocks copied back into the device cache from it."""
    num_host_blocks: int
    """Blocks the host tier holds now."""
    num_disk_blocks: int
    """Blocks the disk tier holds now."""
    block_bytes: int
    """Bytes one block takes on a shard."""


@dataclass(frozen=True)
class AdapterStats:
    """A paged engine's LoRA adapters, read at scrape time."""

    max_loras: int
    """Most adapters resident at once (--max-loras); 0 where the model takes none."""
    num_running: Mapping[str, int]
    """Adapter -> its requests holding KV blocks (the scheduler's running ones)."""
    num_waiting: Mapping[str, int]
    """Adapter -> its requests waiting to be scheduled (new or preempted; those whose
    adapter waits for a slot too)."""
    resident: tuple[str, ...] | None = None
    """The adapters resident on the shards (`LoraResidency`); None: the engine keeps no
    residency."""
    num_loads: int = 0
    """Adapters made resident since startup (first uses and reloads after eviction)."""
    num_evictions: int = 0
    """Resident adapters evicted to make room for another since startup."""


@dataclass(frozen=True)
class CostRates:
    """Busy time attributed to input and output tokens, the tokens, and the cost per 1k
    tokens of each (None where no token of that kind was counted)."""

    input_busy_s: float
    output_busy_s: float
    num_input_tokens: int
    """Prompt tokens computed (prefix-cache hits are not)."""
    num_output_tokens: int
    """Tokens generated."""
    per_1k_input_tokens_usd: float | None
    per_1k_output_tokens_usd: float | None


@dataclass(frozen=True)
class CostReport:
    """A paged engine's cost per token (`engine.cost_meter.CostMeter`), read at scrape time."""

    device_hour_cost_usd: float
    """--device-hour-cost: what one hour of the serving group's devices costs."""
    window_s: float
    """Seconds of steps `window` and `tenants` cover."""
    window: CostRates
    """Every request's steps in the window."""
    lifetime: CostRates
    """Every step since startup."""
    tenants: Mapping[str, CostRates]
    """Named tenant -> its requests' share of the window (anonymous requests: none)."""
    tenants_lifetime: Mapping[str, CostRates]
    """Named tenant -> its share since startup."""


class KvCacheCollector(Collector):
    """textgate's own KV-cache metrics, read from the engine at every scrape."""

    def __init__(self, stats: Callable[[], KvCacheStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        total = s.num_used_blocks + s.num_free_blocks
        yield GaugeMetricFamily(
            "textgate_kv_cache_blocks_used", "KV-cache blocks held by requests", s.num_used_blocks
        )
        yield GaugeMetricFamily(
            "textgate_kv_cache_blocks_free",
            "KV-cache blocks free (including evictable prefix-cache blocks)",
            s.num_free_blocks,
        )
        yield GaugeMetricFamily(
            "textgate_kv_cache_usage",
            "Fraction of KV-cache blocks in use",
            s.num_used_blocks / total if total else 0.0,
        )
        yield GaugeMetricFamily(
            "textgate_kv_cache_block_size", "Tokens per KV-cache block", s.block_size
        )
        yield CounterMetricFamily(
            "textgate_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            s.num_prefix_hit_tokens,
        )
        yield CounterMetricFamily(
            "textgate_prefix_cache_query_tokens",
            "Prompt tokens looked up in the prefix cache",
            s.num_prefix_query_tokens,
        )
        yield CounterMetricFamily(
            "textgate_preemptions", "Requests preempted to free KV blocks", s.num_preemptions
        )
        if s.kv_tiers is not None:
            yield from _kv_tier_metrics(s.kv_tiers)
        # vLLM's: the fraction of the pool held by requests (evictable prefix-cache blocks
        # count as free, as in vLLM's BlockPool.get_usage), 0..1 despite the name.
        yield GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 = full",
            s.num_used_blocks / total if total else 0.0,
        )
        config = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV-cache layout, in labels (value 1)",
            labels=["block_size", "num_gpu_blocks"],
        )
        config.add_metric([str(s.block_size), str(total)], 1.0)
        yield config


def _kv_tier_metrics(t: KvTierStats) -> Iterable[Metric]:
    hits = CounterMetricFamily(
        "textgate_prefix_cache_tier_hit_tokens",
        "Prompt tokens served from the prefix cache, by the tier that held them",
        labels=["tier"],
    )
    for tier, count in t.hit_tokens.items():
        hits.add_metric([tier], count)
    yield hits
    yield CounterMetricFamily(
        "textgate_kv_offload_blocks",
        "Prefix-cache blocks copied from the device into the host tier on eviction",
        t.num_offloaded_blocks,
    )
    restored = CounterMetricFamily(
        "textgate_kv_restore_blocks",
        "Prefix-cache blocks copied back into the device cache, by tier",
        labels=["tier"],
    )
    for tier, count in t.num_restored_blocks.items():
        restored.add_metric([tier], count)
    yield restored
    yield GaugeMetricFamily(
        "textgate_kv_offload_host_bytes",
        "Bytes the host KV tier holds on each shard",
        t.num_host_blocks * t.block_bytes,
    )
    yield GaugeMetricFamily(
        "textgate_kv_offload_disk_blocks", "Blocks the disk KV tier holds", t.num_disk_blocks
    )


class BatchControllerCollector(Collector):
    """The adaptive batch controller's choices and measurements, read at every scrape."""

    def __init__(self, state: Callable[[], BatchControllerState]) -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        s = self.state()
        yield GaugeMetricFamily(
            "textgate_scheduler_prefill_budget",
            "Prompt tokens a step may compute beside its decodes",
            s.prefill_budget,
        )
        yield GaugeMetricFamily(
            "textgate_scheduler_batch_limit",
            "Most running requests before waiting ones stop joining",
            s.batch_limit,
        )
        yield GaugeMetricFamily(
            "textgate_scheduler_itl_target_seconds",
            "Inter-token latency target of the batch controller (0: fixed budgets or not derived yet)",
            s.target_itl_s or 0.0,
        )
        yield GaugeMetricFamily(
            "textgate_scheduler_utilization",
            "Busy fraction of the device over the last second (0 when idle)",
            s.utilization,
        )
        latency = GaugeMetricFamily(
            "textgate_scheduler_step_latency_seconds",
            "Moving average of step latency: decode-only steps, and steps with prompt tokens",
            labels=["kind"],
        )
        latency.add_metric(["decode"], s.decode_step_latency_s)
        latency.add_metric(["mixed"], s.mixed_step_latency_s)
        yield latency


class AdapterCollector(Collector):
    """vLLM's LoRA info gauge: which adapters have requests running and waiting, in labels.

    As in vLLM, each label lists adapter names comma-separated and the value is the time
    (Unix seconds) the labels describe, here the scrape, so a reader keeps the newest series.
    """

    def __init__(self, stats: Callable[[], AdapterStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        if s.max_loras == 0:
            return
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters with requests running and waiting (value: when, Unix seconds)",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric(
            [str(s.max_loras), _adapter_names(s.num_running), _adapter_names(s.num_waiting)],
            time.time(),
        )
        yield info
        if s.resident is None:
            return
        yield GaugeMetricFamily(
            "textgate_lora_resident_adapters",
            "LoRA adapters resident on the shards (at most --max-loras)",
            len(s.resident),
        )
        yield CounterMetricFamily(
            "textgate_lora_loads",
            "LoRA adapters made resident (a first use, or a reload after an eviction)",
            s.num_loads,
        )
        yield CounterMetricFamily(
            "textgate_lora_evictions",
            "Resident LoRA adapters evicted to make room for another (their host copy kept)",
            s.num_evictions,
        )


def _adapter_names(counts: Mapping[str, int]) -> str:
    return ",".join(sorted(name for name, count in counts.items() if count > 0))


class CostCollector(Collector):
    """Cost per 1k input and output tokens over the recent window, overall and per tenant,
    and the busy time, tokens and cost behind them since startup (--device-hour-cost)."""

    def __init__(self, report: Callable[[], CostReport]) -> None:
        self.report = report

    def collect(self) -> Iterable[Metric]:
        r = self.report()
        yield GaugeMetricFamily(
            "textgate_device_hour_cost_usd",
            "What one hour of the serving group's devices costs (--device-hour-cost)",
            r.device_hour_cost_usd,
        )
        yield GaugeMetricFamily(
            "textgate_cost_window_seconds", "Seconds of steps the cost gauges cover", r.window_s
        )
        for kind in ("input", "output"):
            overall = GaugeMetricFamily(
                f"textgate_cost_per_1k_{kind}_tokens_usd",
                f"USD per 1k {kind} tokens: device-hour cost x busy hours attributed to "
                f"{kind} tokens / {kind} tokens, over the window (absent without any)",
            )
            value = _per_1k(r.window, kind)
            if value is not None:
                overall.add_metric([], value)
            yield overall
            tenants = GaugeMetricFamily(
                f"textgate_tenant_cost_per_1k_{kind}_tokens_usd",
                f"USD per 1k {kind} tokens of each tenant's requests, over the window",
                labels=["tenant"],
            )
            for tenant, rates in r.tenants.items():
                value = _per_1k(rates, kind)
                if value is not None:
                    tenants.add_metric([tenant], value)
            yield tenants
        busy = CounterMetricFamily(
            "textgate_cost_busy_seconds",
            "Busy device seconds attributed to input (prompt) and output (generated) tokens",
            labels=["kind"],
        )
        busy.add_metric(["input"], r.lifetime.input_busy_s)
        busy.add_metric(["output"], r.lifetime.output_busy_s)
        yield busy
        tokens = CounterMetricFamily(
            "textgate_cost_tokens",
            "Tokens the busy seconds bought: prompt tokens computed, tokens generated",
            labels=["kind"],
        )
        tokens.add_metric(["input"], r.lifetime.num_input_tokens)
        tokens.add_metric(["output"], r.lifetime.num_output_tokens)
        yield tokens
        spent = CounterMetricFamily(
            "textgate_tenant_cost_usd",
            "USD of busy device time attributed to each tenant's requests",
            labels=["tenant"],
        )
        for tenant, rates in r.tenants_lifetime.items():
            busy_s = rates.input_busy_s + rates.output_busy_s
            spent.add_metric([tenant], r.device_hour_cost_usd * busy_s / 3600.0)
        yield spent


def _per_1k(rates: CostRates, kind: str) -> float | None:
    return rates.per_1k_input_tokens_usd if kind == "input" else rates.per_1k_output_tokens_usd
