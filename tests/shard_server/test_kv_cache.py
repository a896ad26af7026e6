from __future__ import annotations

import torch

from textgate.shard_server.kv_cache import KVCache


def _cache(**overrides) -> KVCache:
    args = dict(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=5)
    return KVCache.allocate(**{**args, **overrides}, dtype=torch.float32)


def test_allocates_zeroed_paged_layout():
    cache = _cache()
    assert (cache.num_layers, cache.num_blocks, cache.num_slots) == (2, 6, 24)
    assert cache.key_caches[1].shape == (6, 4, 3, 5)
    assert all(not t.any() for t in cache.key_caches + cache.value_caches)


def test_store_writes_slot_block_and_offset():
    cache = _cache()
    key, value = torch.randn(3, 3, 5), torch.randn(3, 3, 5)
    cache.store(1, key, value, torch.tensor([0, 9, 23]))  # (0, 0), (2, 1), (5, 3)
    key_cache, value_cache = cache.layer(1)
    torch.testing.assert_close(key_cache[0, 0], key[0])
    torch.testing.assert_close(key_cache[2, 1], key[1])
    torch.testing.assert_close(value_cache[5, 3], value[2])
    assert not cache.key_caches[0].any()
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 3


def test_store_casts_to_the_cache_dtype():
    cache = _cache(num_layers=1)
    cache.key_caches[0] = cache.key_caches[0].bfloat16()
    cache.value_caches[0] = cache.value_caches[0].bfloat16()
    cache.store(0, torch.ones(1, 3, 5), torch.ones(1, 3, 5), torch.tensor([4], dtype=torch.int32))
    assert cache.key_caches[0][1, 0].eq(1).all()


def test_bytes_per_block_counts_keys_and_values_of_all_layers():
    size = KVCache.bytes_per_block(
        num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16
    )
    assert size == 2 * 30 * 16 * 3 * 64 * 2
