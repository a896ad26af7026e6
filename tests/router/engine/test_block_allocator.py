"""BlockAllocator: tables, growth, freeing, prefix caching, LRU eviction, invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from textgate.router.engine.block_allocator import BlockAllocator, hash_block


def make(num_blocks: int = 8, block_size: int = 4, prefix: bool = True) -> BlockAllocator:
    return BlockAllocator(num_blocks, block_size, enable_prefix_caching=prefix)


def run_prefill(allocator: BlockAllocator, request_id: int, tokens: list[int]) -> int | None:
    """Allocate for the prompt, then publish it as if one step computed all of it."""
    num_cached = allocator.allocate(request_id, tokens, len(tokens))
    if num_cached is not None:
        allocator.cache_blocks(request_id, tokens, len(tokens))
    allocator.check_invariants()
    return num_cached


def test_hash_is_stable_sha256_over_parent_and_little_endian_uint32() -> None:
    # Pinned digest: the hash must not change between processes or releases.
    assert hash_block(b"", [1, 2, 3, 4]).hex() == (
        "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
    )
    first = hash_block(b"", [1, 2])
    assert hash_block(first, [3, 4]) != hash_block(b"", [3, 4])
    assert hash_block(b"", [1, 2]) != hash_block(b"", [2, 1])


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 1)])
def test_rejects_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="must be at least 1"):
        BlockAllocator(num_blocks, block_size)


def test_allocate_covers_tokens_and_maps_slots() -> None:
    allocator = make()
    assert allocator.allocate(7, [1, 2, 3, 4, 5], num_tokens=9) == 0
    table = allocator.block_table(7)
    assert len(table) == 3
    assert allocator.slot_mapping(7, 3, 6) == (
        table[0] * 4 + 3,
        table[1] * 4 + 0,
        table[1] * 4 + 1,
    )
    assert allocator.num_used_blocks == 3
    assert allocator.num_free_blocks == 5
    assert allocator.usage == pytest.approx(3 / 8)
    allocator.check_invariants()


def test_allocate_rejects_duplicate_and_bad_sizes() -> None:
    allocator = make()
    allocator.allocate(1, [1], 1)
    with pytest.raises(ValueError, match="already has a block table"):
        allocator.allocate(1, [1], 1)
    with pytest.raises(ValueError, match="len\\(token_ids\\)"):
        allocator.allocate(2, [1, 2, 3], 2)
    with pytest.raises(ValueError, match="len\\(token_ids\\)"):
        allocator.allocate(3, [], 4)


def test_allocate_is_all_or_nothing_when_the_pool_is_short() -> None:
    allocator = make(num_blocks=4)
    assert allocator.allocate(1, [1] * 8, 8) == 0
    assert allocator.allocate(2, [2] * 9, 9) is None
    assert not allocator.has_table(2)
    assert allocator.num_free_blocks == 2
    allocator.check_invariants()


def test_grow_adds_a_block_only_when_crossing_a_boundary() -> None:
    allocator = make(num_blocks=3)
    allocator.allocate(1, [1, 2, 3, 4], 4)
    assert allocator.grow(1, 4)
    assert len(allocator.block_table(1)) == 1
    assert allocator.grow(1, 5)
    assert len(allocator.block_table(1)) == 2
    assert allocator.grow(1, 12)
    assert not allocator.grow(1, 13)
    assert len(allocator.block_table(1)) == 3
    allocator.check_invariants()


def test_free_returns_every_block_exactly_once() -> None:
    allocator = make(prefix=False)
    allocator.allocate(1, [1] * 6, 10)
    allocator.allocate(2, [2] * 3, 3)
    allocator.free(1)
    allocator.free(1)  # a second free is a no-op, not a double return
    allocator.free(2)
    allocator.check_invariants()
    assert allocator.num_free_blocks == 8
    assert allocator.num_used_blocks == 0


def test_prefix_hit_shares_blocks_and_reports_computed_tokens() -> None:
    allocator = make()
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    assert run_prefill(allocator, 1, prompt) == 0
    num_cached = allocator.allocate(2, [*prompt[:8], 99, 98], 12)
    assert num_cached == 8
    assert allocator.block_table(2)[:2] == allocator.block_table(1)[:2]
    assert allocator.block_table(2)[2] != allocator.block_table(1)[2]
    assert allocator.num_prefix_query_tokens == 20
    assert allocator.num_prefix_hit_tokens == 8
    assert allocator.prefix_hit_rate == pytest.approx(0.4)
    allocator.check_invariants()
    # A shared block is freed only when its last holder lets go.
    allocator.free(1)
    assert allocator.num_used_blocks == 3
    allocator.check_invariants()


def test_prefix_hit_stops_at_the_first_mismatch() -> None:
    allocator = make()
    run_prefill(allocator, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert allocator.allocate(2, [1, 2, 3, 4, 0, 6, 7, 8, 9], 9) == 4
    # Same second block, different first block: the chain hash makes it a miss.
    assert allocator.allocate(3, [0, 2, 3, 4, 5, 6, 7, 8, 9], 9) == 0


def test_prefix_hit_never_covers_the_last_token() -> None:
    allocator = make()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # exactly two blocks
    run_prefill(allocator, 1, prompt)
    # The last token must be recomputed for its logits, so the second block is not shared.
    assert allocator.allocate(2, prompt, 8) == 4
    assert allocator.allocate(3, prompt[:4], 4) == 0


def test_blocks_are_published_only_once_computed() -> None:
    allocator = make(num_blocks=12)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    allocator.allocate(1, prompt, 9)
    assert allocator.allocate(2, prompt, 9) == 0
    allocator.cache_blocks(1, prompt, 5)  # a first chunk: only block 0 is full and computed
    assert allocator.allocate(3, prompt, 9) == 4
    allocator.cache_blocks(1, prompt, 9)
    assert allocator.allocate(4, prompt, 9) == 8
    allocator.check_invariants()


def test_released_blocks_stay_cached_and_are_hit_later() -> None:
    allocator = make()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run_prefill(allocator, 1, prompt)
    allocator.free(1)
    assert allocator.num_evictable_blocks == 2
    assert allocator.num_free_blocks == 8
    assert allocator.allocate(2, prompt, 9) == 8
    assert allocator.num_evictable_blocks == 0
    allocator.check_invariants()


def test_never_used_blocks_are_taken_before_evicting_cached_ones() -> None:
    allocator = make(num_blocks=4)
    run_prefill(allocator, 1, [1, 2, 3, 4, 5])
    allocator.free(1)  # block of [1..4] cached, the partial block free again
    allocator.allocate(2, [7] * 12, 12)  # exactly the 3 never-cached blocks
    allocator.free(2)
    assert allocator.allocate(3, [1, 2, 3, 4, 5], 5) == 4


def test_eviction_is_lru_and_tail_blocks_go_first() -> None:
    allocator = make(num_blocks=6, block_size=2)
    a = [1, 2, 3, 4, 0]
    b = [5, 6, 7, 8, 0]
    run_prefill(allocator, 1, a[:4])
    run_prefill(allocator, 2, b[:4])
    allocator.free(1)
    allocator.free(2)
    # Released order (oldest first): a's tail, a's head, b's tail, b's head.
    assert allocator.num_evictable_blocks == 4
    # Three fresh blocks: the two never-used ones, then one eviction: a's tail.
    allocator.allocate(3, [9] * 6, 6)
    assert allocator.num_evictable_blocks == 3
    allocator.free(3)  # unpublished blocks go back to the free list
    assert allocator.allocate(4, b, 5) == 4  # b untouched
    assert allocator.allocate(5, a, 5) == 2  # a's head still cached, its tail is gone
    allocator.check_invariants()


def test_a_hit_refreshes_the_block_in_the_lru() -> None:
    allocator = make(num_blocks=3, block_size=2)
    run_prefill(allocator, 1, [1, 2])
    allocator.free(1)
    run_prefill(allocator, 2, [3, 4])
    allocator.free(2)
    # Hitting [1, 2] again makes it the most recently released block.
    assert allocator.allocate(3, [1, 2, 0], 3) == 2
    allocator.free(3)
    allocator.allocate(4, [0], 3)  # the free block, then evicts [3, 4], the least recent
    allocator.free(4)
    assert allocator.allocate(5, [3, 4, 0], 3) == 0
    allocator.free(5)
    assert allocator.allocate(6, [1, 2, 0], 3) == 2
    allocator.check_invariants()


def test_a_block_computed_twice_stays_private() -> None:
    allocator = make()
    prompt = [1, 2, 3, 4, 5]
    allocator.allocate(1, prompt, 5)
    allocator.allocate(2, prompt, 5)
    allocator.cache_blocks(1, prompt, 5)
    allocator.cache_blocks(2, prompt, 5)  # same hash already published by request 1
    allocator.check_invariants()
    allocator.free(2)
    assert allocator.num_evictable_blocks == 0  # request 2's copy went back to the free list
    assert allocator.allocate(3, prompt, 5) == 4
    assert allocator.block_table(3)[0] == allocator.block_table(1)[0]


def test_hit_on_a_block_in_use_counts_toward_the_pool_correctly() -> None:
    allocator = make(num_blocks=3)
    prompt = [1, 2, 3, 4, 5]
    run_prefill(allocator, 1, prompt)  # 2 blocks, one published
    # 1 shared + 1 fresh fits in the single remaining block.
    assert allocator.allocate(2, prompt, 5) == 4
    assert allocator.num_free_blocks == 0
    allocator.free(1)
    allocator.free(2)
    # The published block is evictable now; reviving it takes it out of the free capacity,
    # so 1 hit + 3 fresh blocks do not fit in a pool of 3.
    assert allocator.allocate(3, prompt, 13) is None
    allocator.check_invariants()
    assert allocator.allocate(3, prompt, 12) == 4
    assert allocator.num_free_blocks == 0
    allocator.check_invariants()


def test_disabled_prefix_caching_never_hits_nor_counts() -> None:
    allocator = make(prefix=False)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert run_prefill(allocator, 1, prompt) == 0
    allocator.free(1)
    assert allocator.num_evictable_blocks == 0
    assert run_prefill(allocator, 2, prompt) == 0
    assert allocator.num_prefix_query_tokens == 0
    assert allocator.prefix_hit_rate == 0.0


def test_reset_prefix_cache_frees_evictable_blocks_and_keeps_live_ones() -> None:
    allocator = make()
    run_prefill(allocator, 1, [1, 2, 3, 4, 5])
    run_prefill(allocator, 2, [6, 7, 8, 9, 10])
    allocator.free(1)
    allocator.reset_prefix_cache()
    allocator.check_invariants()
    assert allocator.num_evictable_blocks == 0
    assert allocator.allocate(3, [1, 2, 3, 4, 5], 5) == 0
    assert allocator.allocate(4, [6, 7, 8, 9, 10], 5) == 4


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / grow / publish / free sequences keep every invariant."""

    tables = Bundle("tables")

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.integers(1, 4),
        prefix=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, prefix: bool) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size, prefix)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(
        target=tables,
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12),
        extra=st.integers(0, 6),
    )
    def allocate(self, prompt: list[int], extra: int) -> int:
        request_id = self.next_id
        self.next_id += 1
        free_before = self.allocator.num_free_blocks
        num_cached = self.allocator.allocate(request_id, prompt, len(prompt) + extra)
        if num_cached is None:
            assert self.allocator.num_free_blocks == free_before
            return -1
        assert num_cached % self.allocator.block_size == 0
        assert num_cached < len(prompt)
        self.tokens[request_id] = prompt
        return request_id

    @rule(request_id=tables, num_tokens=st.integers(0, 8))
    def publish(self, request_id: int, num_tokens: int) -> None:
        if request_id in self.tokens:
            prompt = self.tokens[request_id]
            self.allocator.cache_blocks(request_id, prompt, min(num_tokens, len(prompt)))

    @rule(request_id=tables, more=st.integers(1, 6))
    def grow(self, request_id: int, more: int) -> None:
        if request_id in self.tokens:
            size = len(self.allocator.block_table(request_id)) * self.allocator.block_size
            before = self.allocator.block_table(request_id)
            if not self.allocator.grow(request_id, size + more):
                assert self.allocator.block_table(request_id) == before

    @rule(request_id=consumes(tables))
    def free(self, request_id: int) -> None:
        self.tokens.pop(request_id, None)
        self.allocator.free(request_id)

    @invariant()
    def consistent(self) -> None:
        self.allocator.check_invariants()

    def teardown(self) -> None:
        for request_id in list(self.tokens):
            self.allocator.free(request_id)
        self.allocator.check_invariants()
        assert self.allocator.num_free_blocks == self.allocator.num_blocks
        assert self.allocator.num_used_blocks == 0


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, database=None
)
TestAllocatorMachine = AllocatorMachine.TestCase
