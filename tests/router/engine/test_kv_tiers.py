"""KvTierIndex and the allocator's use of it: evicted prefix blocks offloaded, restored on
a hit, demoted to disk, and a simulated shard that runs the transfers in plan order."""

from __future__ import annotations

import random

import pytest

from textgate.router.engine.block_allocator import BlockAllocator, hash_block
from textgate.router.engine.kv_tiers import KvTier, KvTierIndex, KvTransfer, TransferKind

BLOCK = 4


def chain(tokens: list[int]) -> list[bytes]:
    """The chain hashes of the full blocks of `tokens`."""
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        hashes.append(hash_block(hashes[-1] if hashes else b"", tokens[start : start + BLOCK]))
    return hashes


class FakeShard:
    """What a shard holds, as each block's hash: device blocks, host pool, disk files."""

    def __init__(self, num_blocks: int, disk: bool) -> None:
        self.device: list[bytes | None] = [None] * num_blocks
        self.host: dict[bytes, bytes] = {}
        self.disk: dict[bytes, bytes] | None = {} if disk else None

    def run(self, transfers: tuple[KvTransfer, ...]) -> None:
        for t in transfers:
            if t.kind is TransferKind.OFFLOAD:
                assert self.device[t.block_id] == t.block_hash, "offloaded a block it overwrote"
                self.host[t.block_hash] = t.block_hash
            elif t.kind is TransferKind.RESTORE:
                source = self.host.get(t.block_hash)
                if source is None and self.disk is not None:
                    source = self.disk.get(t.block_hash)
                assert source == t.block_hash, "restored a block no tier holds"
                self.device[t.block_id] = source
            else:
                content = self.host.pop(t.block_hash)
                if self.disk is not None:
                    self.disk[t.block_hash] = content


def prefill(allocator: BlockAllocator, shard: FakeShard, request_id: int, tokens: list[int]) -> int:
    """One step that admits and computes the whole prompt, as the scheduler plans it."""
    num_cached = allocator.allocate(request_id, tokens, len(tokens))
    assert num_cached is not None
    assert allocator.kv_tiers is not None
    shard.run(allocator.kv_tiers.take_transfers())
    table = allocator.block_table(request_id)
    hashes = chain(tokens)
    for index, block in enumerate(table[: num_cached // BLOCK]):
        assert shard.device[block] == hashes[index], "a prefix hit reads the wrong KV"
    for index in range(num_cached // BLOCK, len(table)):
        shard.device[table[index]] = hashes[index] if index < len(hashes) else b"partial"
    allocator.cache_blocks(request_id, tokens, len(tokens))
    allocator.check_invariants()
    return num_cached


def test_an_evicted_prefix_comes_back_from_the_host_tier() -> None:
    tiers = KvTierIndex(8)
    allocator = BlockAllocator(4, BLOCK, kv_tiers=tiers)
    shard = FakeShard(4, disk=False)
    prompt = list(range(13))  # 3 full blocks + 1 token
    assert prefill(allocator, shard, 1, prompt) == 0
    allocator.free(1)
    assert prefill(allocator, shard, 2, [100 + t for t in range(13)]) == 0  # evicts all 3
    allocator.free(2)
    assert tiers.num_offloaded_blocks == 3 and tiers.num_host_used == 3
    assert prefill(allocator, shard, 3, prompt) == 12
    assert allocator.num_prefix_hit_tokens_by_tier[KvTier.HOST] == 12
    assert tiers.num_restored_blocks[KvTier.HOST] == 3


def test_without_tiers_an_evicted_prefix_is_recomputed() -> None:
    allocator = BlockAllocator(4, BLOCK)
    prompt = list(range(13))
    allocator.allocate(1, prompt, 13)
    allocator.cache_blocks(1, prompt, 13)
    allocator.free(1)
    allocator.allocate(2, [100 + t for t in range(13)], 13)
    allocator.free(2)
    assert allocator.allocate(3, prompt, 13) == 0


def test_a_full_host_tier_demotes_to_disk_and_disk_hits_restore() -> None:
    tiers = KvTierIndex(1, disk=True)
    allocator = BlockAllocator(4, BLOCK, kv_tiers=tiers)
    shard = FakeShard(4, disk=True)
    prompt = list(range(13))
    prefill(allocator, shard, 1, prompt)
    allocator.free(1)
    prefill(allocator, shard, 2, [100 + t for t in range(13)])
    allocator.free(2)
    assert tiers.num_host_used == 1 and tiers.num_disk_blocks == 2
    assert shard.disk is not None and len(shard.disk) == 2
    assert prefill(allocator, shard, 3, prompt) == 12
    hits = allocator.num_prefix_hit_tokens_by_tier
    assert hits[KvTier.HOST] + hits[KvTier.DISK] == 12 and hits[KvTier.DISK] >= 4


def test_a_block_restored_from_the_host_is_not_copied_there_again() -> None:
    tiers = KvTierIndex(8)
    allocator = BlockAllocator(4, BLOCK, kv_tiers=tiers)
    shard = FakeShard(4, disk=False)
    prompt, other = list(range(13)), [100 + t for t in range(13)]
    for request_id, tokens in enumerate([prompt, other, prompt, other], start=1):
        prefill(allocator, shard, request_id, tokens)
        allocator.free(request_id)
    # Each prompt's 3 blocks were copied once; later evictions found them in the pool.
    assert tiers.num_offloaded_blocks == 6


def test_the_disk_tier_starts_with_what_the_shards_found() -> None:
    prompt = list(range(9))
    tiers = KvTierIndex(0, disk=True, disk_hashes=chain(prompt))
    allocator = BlockAllocator(4, BLOCK, kv_tiers=tiers)
    shard = FakeShard(4, disk=True)
    assert shard.disk is not None
    shard.disk.update({h: h for h in chain(prompt)})
    assert prefill(allocator, shard, 1, prompt) == 8
    assert tiers.num_restored_blocks[KvTier.DISK] == 2


def test_forget_host_drops_the_host_tier_and_unconfirmed_demotions() -> None:
    tiers = KvTierIndex(1, disk=True)
    tiers.offload(0, b"a")
    tiers.offload(1, b"b")
    tiers.take_transfers()  # demotes a
    assert tiers.tier_of(b"a") is KvTier.DISK and tiers.tier_of(b"b") is KvTier.HOST
    tiers.forget_host()
    assert tiers.tier_of(b"a") is None and tiers.tier_of(b"b") is None


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="host blocks or a disk tier"):
        KvTierIndex(0)
    with pytest.raises(ValueError, match=">= 0"):
        KvTierIndex(-1, disk=True)
    with pytest.raises(KeyError, match="in no KV tier"):
        KvTierIndex(2).restore(b"x", 0)


@pytest.mark.parametrize("disk", [False, True])
def test_random_workloads_keep_every_hit_right(disk: bool) -> None:
    """Shared prefixes, a small device pool and a smaller host pool: whatever the order of
    offloads, restores and demotions, every hit reads the KV of its own tokens."""
    rng = random.Random(7)
    tiers = KvTierIndex(3, disk=disk)
    allocator = BlockAllocator(10, BLOCK, kv_tiers=tiers)
    shard = FakeShard(10, disk=disk)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    live: list[int] = []
    for request_id in range(300):
        tokens = [*rng.choice(prefixes)[: rng.randrange(4, 13)], rng.randrange(50)]
        while allocator.num_free_blocks < allocator.num_blocks_for(len(tokens)) and live:
            allocator.free(live.pop(0))
        prefill(allocator, shard, request_id, tokens)
        assert set(shard.host) == {h for h in shard.host if tiers.tier_of(h) is KvTier.HOST}
        assert len(shard.host) == tiers.num_host_used <= 3
        live.append(request_id)
        if len(live) > 2:
            allocator.free(live.pop(rng.randrange(len(live))))
    assert sum(tiers.num_restored_blocks.values()) > 0
