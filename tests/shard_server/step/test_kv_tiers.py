"""KvTierStore: blocks offloaded, overwritten and restored bit for bit (plain and quantized
caches), demoted to disk and found again by a new store, and a paged shard whose restored
prefix gives the token a full prefill gives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from textgate.proto import generate_pb2 as pb
from textgate.shard_server.loading.shard_loader import load_model
from textgate.shard_server.protocols.paged_model import CacheConfig
from textgate.shard_server.step.kv_cache import KVCache
from textgate.shard_server.step.kv_tiers import KvLayout, KvTierStore

OFFLOAD, RESTORE, DEMOTE = (
    pb.KV_TRANSFER_KIND_OFFLOAD,
    pb.KV_TRANSFER_KIND_RESTORE,
    pb.KV_TRANSFER_KIND_DEMOTE,
)


def random_cache(dtype: torch.dtype = torch.float32) -> KVCache:
    cache = KVCache.allocate(
        num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype
    )
    generator = torch.Generator().manual_seed(0)
    for tensors in (cache.key_caches, cache.value_caches, cache.key_scales or []):
        for tensor in tensors:
            tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    for tensor in cache.value_scales or []:
        tensor.copy_(torch.rand(tensor.shape, generator=generator))
    return cache


def block_of(cache: KVCache, block: int) -> list[torch.Tensor]:
    parts = [*cache.key_caches, *cache.value_caches]
    parts += [*(cache.key_scales or []), *(cache.value_scales or [])]
    return [part[block].clone() for part in parts]


def transfer(kind: int, block_hash: bytes, block_id: int = 0) -> pb.KvTransfer:
    return pb.KvTransfer(kind=kind, block_hash=block_hash, block_id=block_id)


def assert_same(left: list[torch.Tensor], right: list[torch.Tensor]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_offloaded_blocks_come_back_bit_for_bit_into_other_blocks(dtype: torch.dtype) -> None:
    cache = random_cache(dtype)
    expected = [block_of(cache, 1), block_of(cache, 4)]
    store = KvTierStore(torch.device("cpu"))
    store.apply([transfer(OFFLOAD, b"a", 1), transfer(OFFLOAD, b"b", 4)], cache)
    for tensors in (cache.key_caches, cache.value_caches):
        for tensor in tensors:
            tensor.zero_()  # the blocks are reused and overwritten
    store.apply([transfer(RESTORE, b"b", 0), transfer(RESTORE, b"a", 5)], cache)
    assert_same(block_of(cache, 5), expected[0])
    assert_same(block_of(cache, 0), expected[1])
    assert set(store.host) == {b"a", b"b"}  # a restore copies, the host keeps its block


def test_transfers_run_in_plan_order() -> None:
    """A block offloaded and then reused by a restore in the same step: the offload reads
    the old contents first."""
    cache = random_cache()
    old, other = block_of(cache, 2), block_of(cache, 3)
    store = KvTierStore(torch.device("cpu"))
    store.apply([transfer(OFFLOAD, b"b", 3)], cache)
    store.apply([transfer(OFFLOAD, b"a", 2), transfer(RESTORE, b"b", 2)], cache)
    assert_same(block_of(cache, 2), other)
    store.apply([transfer(RESTORE, b"a", 0)], cache)
    assert_same(block_of(cache, 0), old)


def test_demoted_blocks_survive_on_disk_for_a_new_store(tmp_path: Path) -> None:
    cache = random_cache()
    expected = block_of(cache, 1)
    store = KvTierStore(torch.device("cpu"), tmp_path / "tier")
    store.apply([transfer(OFFLOAD, b"\x01" * 32, 1), transfer(DEMOTE, b"\x01" * 32)], cache)
    assert not store.host
    store.flush()
    restarted = KvTierStore(torch.device("cpu"), tmp_path / "tier")
    assert restarted.disk_hashes() == [b"\x01" * 32]
    fresh = random_cache()
    restarted.apply([transfer(RESTORE, b"\x01" * 32, 3)], fresh)
    assert_same(block_of(fresh, 3), expected)


def test_without_a_disk_tier_a_demoted_block_is_gone() -> None:
    cache = random_cache()
    store = KvTierStore(torch.device("cpu"))
    store.apply([transfer(OFFLOAD, b"a", 1), transfer(DEMOTE, b"a")], cache)
    assert store.disk_hashes() == []
    with pytest.raises(RuntimeError, match="holds no block"):
        store.apply([transfer(RESTORE, b"a", 0)], cache)


def test_the_disk_folder_changes_with_the_kv_dtype_and_layout(tmp_path: Path) -> None:
    layout = KvLayout("org/model", "", "float32", 16, 30, 3, 64, 0, 1)
    names = {
        KvTierStore.folder(tmp_path, other).name
        for other in (
            layout,
            replace(layout, kv_dtype="bfloat16"),
            replace(layout, block_size=32),
            replace(layout, rank=1, world_size=2),
            replace(layout, quantize="int8"),
        )
    }
    assert len(names) == 5
    assert KvTierStore.folder(tmp_path, layout).name.startswith("model-float32-b16-r0of1-")


def test_a_paged_shard_restores_a_prefix_and_samples_the_same_token(
    tiny_model_dir: Path, request_factory: Callable[..., pb.Request], tmp_path: Path
) -> None:
    """Request 1 computes a 13-token prompt in blocks 0-3; its 3 full blocks are
    offloaded, then restored into blocks 8-10 for request 2, which computes only its last
    token there: greedy, the same next token."""
    config = CacheConfig(4, kv_offload_dir=str(tmp_path / "kv"))
    model = load_model(tiny_model_dir, "tiny", "float32", cache_config=config)
    warmup = model.warmup(pb.WarmupRequest(max_prefill_tokens=16))
    assert warmup.num_blocks >= 12 and list(warmup.kv_offload_disk_hashes) == []
    prompt = [(7 * i + 3) % 50 for i in range(13)]
    first = model.step(
        [request_factory(1, prompt, 1, temperature=0.0)],
        pb.StepPlan(
            scheduled=[
                pb.ScheduledRequest(
                    request_id=1,
                    token_ids=prompt,
                    start_position=0,
                    block_table=[0, 1, 2, 3],
                    produces_token=True,
                )
            ]
        ),
    )
    hashes = [bytes([i]) * 32 for i in range(3)]
    offload = [transfer(OFFLOAD, h, b) for b, h in enumerate(hashes)]
    demote = [transfer(DEMOTE, h) for h in hashes]
    model.step([], pb.StepPlan(kv_transfers=offload + demote))
    assert model.kv_tiers is not None
    model.kv_tiers.flush()
    assert sorted(model.kv_tiers.disk_hashes()) == hashes
    restore = [transfer(RESTORE, h, 8 + i) for i, h in enumerate(hashes)]
    second = model.step(
        [request_factory(2, prompt, 1, temperature=0.0)],
        pb.StepPlan(
            kv_transfers=restore,
            scheduled=[
                pb.ScheduledRequest(
                    request_id=2,
                    token_ids=prompt[12:],
                    start_position=12,
                    block_table=[8, 9, 10, 11],
                    produces_token=True,
                )
            ],
        ),
    )
    assert second.generations[0].tokens.ids == first.generations[0].tokens.ids
    assert second.generations[0].tokens.logprobs[0] == pytest.approx(
        first.generations[0].tokens.logprobs[0], abs=1e-5
    )
    assert model.kv_cache is not None
    assert_same(block_of(model.kv_cache, 8), block_of(model.kv_cache, 0))
    model.step([], pb.StepPlan(kv_transfers=offload[:1]))
    assert set(model.kv_tiers.host) == {hashes[0]}
    model.clear()  # ClearCache: the router no longer trusts the host pool
    assert not model.kv_tiers.host
