"""engine.factory: how the router's flags become the paged scheduler's config."""

from __future__ import annotations

import pytest

from textgate.proto import generate_pb2 as pb
from textgate.router.config import RouterConfig
from textgate.router.engine.factory import describe_controller, kv_tier_index, scheduler_config


def router_config(**overrides: object) -> RouterConfig:
    values: dict[str, object] = {
        "model_id": "m",
        "tokenizer_path": "t",
        "max_batch_prefill_tokens": 256,
        "max_waiting_tokens": 7,
    }
    values.update(overrides)
    return RouterConfig(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("target_itl_ms", "adaptive", "target_itl_s", "described"),
    [
        (None, True, None, "adaptive, inter-token latency target derived from the first steps"),
        (80.0, True, 0.08, "adaptive, inter-token latency target 80.0 ms"),
        (0.0, False, None, "fixed budgets (256 tokens, 256 requests per step)"),
    ],
)
def test_target_itl_ms_picks_the_controller_mode(
    target_itl_ms: float | None, adaptive: bool, target_itl_s: float | None, described: str
) -> None:
    config = scheduler_config(router_config(target_itl_ms=target_itl_ms), 16, 100)
    assert (config.adaptive, config.target_itl_s) == (adaptive, target_itl_s)
    assert config.max_waiting_steps == 7
    assert describe_controller(config).startswith(described)


def test_kv_tier_index_counts_host_blocks_and_seeds_the_disk_tier() -> None:
    info = pb.InfoResponse(block_size=16, kv_cache_bytes_per_token=100)
    warmup = pb.WarmupResponse(kv_offload_disk_hashes=[b"a", b"b"])
    assert kv_tier_index(router_config(), info, warmup) is None
    tiers = kv_tier_index(router_config(kv_offload_bytes=3_300), info, warmup)
    assert tiers is not None and tiers.num_host_blocks == 2 and tiers.num_disk_blocks == 0
    tiers = kv_tier_index(router_config(kv_offload_dir="/tmp/kv"), info, warmup)
    assert tiers is not None and tiers.num_host_blocks == 0 and tiers.num_disk_blocks == 2
    with pytest.raises(ValueError, match="holds no KV block"):
        kv_tier_index(router_config(kv_offload_bytes=1_000), info, warmup)


def test_kv_offload_needs_prefix_caching() -> None:
    with pytest.raises(ValueError, match="need prefix_caching"):
        router_config(kv_offload_bytes=1 << 20, prefix_caching=False)
