"""The one place that builds the engine for the shards and sizes it from the router's config.

The shards get a `PagedEngine` over a scheduler with exactly the KV blocks their Warmup
reported, its batch controller seeded with the steps they timed there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from textgate.proto import generate_pb2 as pb
from textgate.router.config import RouterConfig, parse_ngram_range
from textgate.router.engine.batch_controller import BatchController, StartupSteps
from textgate.router.engine.channel import Channel
from textgate.router.engine.cost_meter import CostMeter
from textgate.router.engine.kv_tiers import KvTierIndex
from textgate.router.engine.lora_registry import LoraRegistry
from textgate.router.engine.lora_residency import LoraResidency
from textgate.router.engine.paged_engine import PagedEngine
from textgate.router.engine.request import ValidRequest
from textgate.router.engine.scheduler import Scheduler, SchedulerConfig
from textgate.router.engine.shard_calls import ShardCalls
from textgate.router.engine.speculation import SpeculationConfig
from textgate.router.metrics import Metrics
from textgate.router.shard_client import ShardedClient

log = logging.getLogger("textgate.router")


class Engine(Protocol):
    """What the handlers and the server need from the engine (`PagedEngine` implements it)."""

    shard_calls: ShardCalls
    """Its calls to the shards (their deadline is `shard_calls.timeout_s`)."""
    adapters: LoraRegistry
    """The LoRA adapters the shards hold (requests are checked and salted by it)."""
    residency: LoraResidency | None
    """Which of them are resident (--max-loras); None: no limit."""
    cost: CostMeter | None
    """Cost per token (--device-hour-cost); None without a price."""

    @property
    def num_active(self) -> int: ...

    def num_active_on(self, adapter_id: str) -> int: ...

    def submit(self, requests: Sequence[ValidRequest]) -> list[Channel]: ...

    async def close(self) -> None: ...


DEFAULT_MAX_NUM_SEQS = 256
"""Running requests of a paged engine when max_batch_size is unset."""


def make_engine(
    config: RouterConfig,
    shards: ShardedClient,
    info: pb.InfoResponse,
    warmup: pb.WarmupResponse,
    *,
    metrics: Metrics | None = None,
) -> Engine:
    """The PagedEngine for the shards Info and Warmup described.

    `config` is resolved (`server.resolve_config`); `metrics` (the app's) gets the
    engine's step metrics.
    """
    if info.block_size == 0:
        raise RuntimeError(
            "the shards reported no KV-cache block size: a shard of a textgate older than "
            "its router (the padded protocol is gone); restart them from one install"
        )
    if warmup.num_blocks == 0:
        raise RuntimeError("the paged shards reported no KV-cache blocks at warmup")
    paged = scheduler_config(config, info.block_size, warmup.num_blocks)
    controller = BatchController(paged.controller_config(), startup=startup_steps(warmup))
    tiers = kv_tier_index(config, info, warmup)
    scheduler = Scheduler(paged, controller, kv_tiers=tiers)
    if tiers is not None:
        log.info(
            "KV tiers: host %d blocks (%d bytes each)%s",
            tiers.num_host_blocks,
            tiers.block_bytes,
            f", disk {config.kv_offload_dir} ({tiers.num_disk_blocks} blocks found)"
            if tiers.disk
            else "",
        )
    log.info("Batch controller: %s", describe_controller(paged, controller.target_itl_s))
    if paged.speculation is not None:
        spec = paged.speculation
        log.info(
            "Speculation: n-gram, up to %d drafts per sequence and step, %d- to %d-grams",
            spec.num_tokens,
            spec.min_ngram,
            spec.max_ngram,
        )
    adapters = LoraRegistry(info.lora_adapters)
    return PagedEngine(
        shards,
        scheduler,
        config.max_concurrent_requests,
        metrics=metrics,
        adapters=adapters,
        max_loras=info.max_loras,
        residency=LoraResidency(info.max_loras, info.resident_lora_adapters)
        if info.max_loras
        else None,
        cost=CostMeter(config.device_hour_cost) if config.device_hour_cost else None,
    )


def scheduler_config(config: RouterConfig, block_size: int, num_blocks: int) -> SchedulerConfig:
    """The paged scheduler's budgets: the router's flags over the shards' KV blocks; the batch
    controller adapts within them unless `target_itl_ms` is 0."""
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=config.prefill_tokens,
        max_num_seqs=min(config.max_batch_size or DEFAULT_MAX_NUM_SEQS, config.prefill_tokens),
        enable_prefix_caching=config.prefix_caching,
        # target_itl_ms: None = the controller derives it, 0 = fixed budgets.
        adaptive=config.target_itl_ms != 0,
        target_itl_s=config.target_itl_ms / 1000 if config.target_itl_ms else None,
        target_ttft_s=config.target_ttft_ms / 1000 if config.target_ttft_ms else None,
        max_waiting_steps=config.max_waiting_tokens,
        speculation=speculation_config(config),
    )


def kv_tier_index(
    config: RouterConfig, info: pb.InfoResponse, warmup: pb.WarmupResponse
) -> KvTierIndex | None:
    """The host and disk KV tiers' index (--kv-offload-bytes, --kv-offload-dir), the host
    pool counted in the shards' blocks, the disk tier seeded with what they found there;
    None when neither flag is set."""
    if not config.kv_offload_bytes and not config.kv_offload_dir:
        return None
    block_bytes = info.kv_cache_bytes_per_token * info.block_size
    if block_bytes == 0:
        raise RuntimeError("the shards reported no KV bytes per token: no KV tier can be sized")
    num_host_blocks = config.kv_offload_bytes // block_bytes
    if config.kv_offload_bytes and num_host_blocks == 0:
        raise ValueError(
            f"--kv-offload-bytes {config.kv_offload_bytes} holds no KV block "
            f"({block_bytes} bytes each on this model)"
        )
    return KvTierIndex(
        num_host_blocks,
        block_bytes=block_bytes,
        disk=config.kv_offload_dir is not None,
        disk_hashes=warmup.kv_offload_disk_hashes,
    )


def speculation_config(config: RouterConfig) -> SpeculationConfig | None:
    """--speculate and --speculative-ngram as the scheduler's; None when speculation is off."""
    if config.speculate == 0:
        return None
    min_ngram, max_ngram = parse_ngram_range(config.speculative_ngram)
    draft_model = config.speculative_model is not None
    return SpeculationConfig(config.speculate, min_ngram, max_ngram, draft_model)


def startup_steps(warmup: pb.WarmupResponse) -> StartupSteps | None:
    """The steps paged shards timed at warmup, in seconds: the batch controller's prior
    (None where they timed none)."""
    if not warmup.decode_timings:
        return None
    rate, chunk = warmup.prefill_tokens_per_s, warmup.prefill_chunk_tokens
    return StartupSteps(
        decode_s={t.batch_size: t.step_ms / 1e3 for t in warmup.decode_timings},
        prefill_tokens=chunk if rate > 0 else 0,
        prefill_s=chunk / rate if rate > 0 else 0.0,
    )


def describe_controller(config: SchedulerConfig, start_target_s: float | None = None) -> str:
    """One line for the startup log: how step budgets are chosen (`start_target_s`: where a
    derived target starts, when the startup measurement seeds it)."""
    if not config.adaptive:
        return f"fixed budgets ({config.max_num_batched_tokens} tokens, {config.max_num_seqs} requests per step)"
    if config.target_itl_s is not None:
        target = f"{config.target_itl_s * 1e3:.1f} ms"
    elif start_target_s is not None:
        target = f"derived from measured steps, {start_target_s * 1e3:.1f} ms at startup"
    else:
        target = "derived from the first steps"
    return (
        f"adaptive, inter-token latency target {target}, prefill share "
        f"{config.controller_config().min_prefill_tokens}-{config.max_num_batched_tokens} "
        f"tokens, batch limit up to {config.max_num_seqs}"
    )
