"""Paged KV-cache block allocator with prefix caching.

The router owns the bookkeeping of the KV cache; shards own the tensors and write
wherever the router's block tables and slot mappings point. A pool of `num_blocks`
blocks of `block_size` tokens each is shared by all requests.

Prefix caching: once a *full* block has been computed, it is published under a chain
hash (the hash of its parent block's hash and its own token ids), so a later request
whose prompt starts with the same tokens reuses the block instead of recomputing it.
Shared blocks carry a reference count; when the last request releases a published
block it is kept, contents intact, in an LRU of evictable blocks and only evicted when
a fresh block is needed and no never-used block is left.

KV tiers (`kv_tiers.KvTierIndex`, optional): an evicted cached block is offloaded to the
host (then disk) tier instead of dropped, and a prompt block that misses the device cache
but is in a tier is restored into a fresh block, which is published at once: the shards
run the step's transfers before it writes or reads any KV, so its contents are in place
by the time anything reads them.

Invariants (checked by `check_invariants`, asserted by the tests):
- every block is in exactly one state: free (no hash, ref 0), used (ref > 0) or
  cached-evictable (hash, ref 0), so free + used + cached-evictable == num_blocks;
- a block's reference count equals the number of live tables that hold it, and a
  block is in two tables only when it was shared through the prefix cache (it has a hash);
- a request never writes into a block it shares: hits stop before the prompt's last
  token, so the first token a request computes lies after its last shared block;
- freeing a request returns each of its blocks exactly once.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence

from textgate.router.engine.kv_tiers import KvTier, KvTierIndex

BlockHash = bytes
"""Chain hash of a full block: identifies the block's tokens *and* everything before them."""

_ROOT_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chain hash of one full block given its parent's hash (`b""` for the first block).

    SHA-256 rather than Python's `hash()` of a tuple: a collision would silently hand
    one user's KV cache to another request, so the hash must be collision-resistant
    even against crafted prompts, and it must be stable across processes and restarts
    (`hash()` of str/bytes is salted per process). Hashing a block of uint32 token ids
    costs about a microsecond, which is nothing next to the forward pass it saves.
    """
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def _root_hash(salt: str) -> BlockHash:
    """The hash a request's first block chains from: b"" unsalted, else the salt's own."""
    return hashlib.sha256(b"salt:" + salt.encode()).digest() if salt else _ROOT_HASH


class BlockAllocator:
    """A fixed pool of KV blocks handed out to requests as block tables.

    Request ids are the router's ids (`Request.id` in the gRPC contract). Methods that
    may run out of blocks (`allocate`, `grow`) are all-or-nothing: when they fail,
    nothing changed.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_tiers: KvTierIndex | None = None,
    ):
        """`kv_tiers`: where evicted cached blocks go and prefix hits may come back from
        (None: an evicted block is dropped, as without --kv-offload-bytes)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Never-used (or hash-dropped) blocks; handed out before any cached block is evicted.
        self._free: deque[int] = deque(range(num_blocks))
        # Published blocks no request holds, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[int, list[int]] = {}
        # Chain hashes of each request's leading full blocks, hit or published so far.
        self._request_hashes: dict[int, list[BlockHash]] = {}
        self._request_roots: dict[int, BlockHash] = {}
        self.kv_tiers = kv_tiers if enable_prefix_caching else None
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_prefix_hit_tokens_by_tier = dict.fromkeys(KvTier, 0)
        """Of `num_prefix_hit_tokens`, those found on the device and restored from each tier."""

    # ---- capacity and metrics ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can get: never-used plus cached-evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        """Published blocks no request holds; kept for prefix hits until needed."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one live request."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by live requests (0.0 to 1.0)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens looked up."""
        if self.num_prefix_query_tokens == 0:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ---- request lifecycle ----

    def allocate(
        self, request_id: int, token_ids: Sequence[int], num_tokens: int, salt: str = ""
    ) -> int | None:
        """Give a new request a block table covering `num_tokens` tokens.

        `salt` names what else the request's KV depends on (a LoRA adapter): its blocks
        chain from a root of their own, so only requests with the same salt share them.

        `token_ids` are the tokens known now (prompt, plus generated ones on a
        recompute); `num_tokens` >= len(token_ids) adds room for decoding. Leading full
        blocks found in the prefix cache are shared instead of allocated. Returns how
        many tokens are already computed (a multiple of block_size, always less than
        len(token_ids) so the last token is recomputed for its logits), or None when
        the pool cannot hold the request now. Blocks restored from a KV tier count as
        computed: the next step's transfers copy them in.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already has a block table")
        if not 1 <= len(token_ids) <= num_tokens:
            raise ValueError(
                f"need 1 <= len(token_ids) <= num_tokens, got {len(token_ids)}, {num_tokens}"
            )
        root = _root_hash(salt)
        hits, hashes = self._match_prefix(token_ids, root)
        device_hits = [block for block in hits if block is not None]
        num_fresh = self.num_blocks_for(num_tokens) - len(device_hits)
        num_revived = sum(1 for block in device_hits if self._ref_counts[block] == 0)
        if num_fresh > self.num_free_blocks - num_revived:
            return None
        for block in device_hits:
            self._acquire_cached(block)
        table = [self._restored(h) if b is None else b for b, h in zip(hits, hashes, strict=True)]
        num_fresh -= len(table) - len(device_hits)
        self._tables[request_id] = table + [self._take_fresh() for _ in range(num_fresh)]
        self._request_hashes[request_id] = hashes
        self._request_roots[request_id] = root
        num_computed = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += len(token_ids)
            self.num_prefix_hit_tokens += num_computed
            self.num_prefix_hit_tokens_by_tier[KvTier.DEVICE] += len(device_hits) * self.block_size
        return num_computed

    def grow(self, request_id: int, num_tokens: int) -> bool:
        """Extend a request's table to cover `num_tokens` tokens; False if blocks ran out."""
        table = self._tables[request_id]
        num_fresh = self.num_blocks_for(num_tokens) - len(table)
        if num_fresh > self.num_free_blocks:
            return False
        table.extend(self._take_fresh() for _ in range(num_fresh))
        return True

    def cache_blocks(
        self, request_id: int, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Publish the request's full blocks among its first `num_computed_tokens` tokens.

        Call only once the step that computed them has finished: a block is offered to
        other requests only when its KV is really in the cache. A block whose hash is
        already published (two requests computed the same prefix at once) stays private
        and returns to the free list when released.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        hashes = self._request_hashes[request_id]
        for index in range(len(hashes), num_computed_tokens // self.block_size):
            parent = hashes[-1] if hashes else self._request_roots[request_id]
            block_hash = hash_block(parent, self._block_tokens(token_ids, index))
            hashes.append(block_hash)
            block = table[index]
            if block_hash not in self._cached and self._block_hashes[block] is None:
                self._cached[block_hash] = block
                self._block_hashes[block] = block_hash

    def free(self, request_id: int) -> None:
        """Release a finished, aborted or preempted request's blocks (no-op if it has none)."""
        table = self._tables.pop(request_id, None)
        self._request_hashes.pop(request_id, None)
        self._request_roots.pop(request_id, None)
        if table is None:
            return
        # Tail first: a prompt's last blocks are the least likely to be shared, so they
        # should be the first ones evicted.
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            if self._block_hashes[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    def reset_prefix_cache(self) -> None:
        """Drop every evictable cached block (ClearCache); they become free at once.

        Blocks held by live requests stay published: their contents are valid and
        other holders may share them.
        """
        for block in self._evictable:
            block_hash = self._block_hashes[block]
            assert block_hash is not None
            del self._cached[block_hash]
            self._block_hashes[block] = None
        self._free.extend(self._evictable)
        self._evictable.clear()

    # ---- views for the scheduler ----

    def has_table(self, request_id: int) -> bool:
        """Whether the request holds blocks."""
        return request_id in self._tables

    def block_table(self, request_id: int) -> tuple[int, ...]:
        """The request's block ids, in token order."""
        return tuple(self._tables[request_id])

    def slot_mapping(self, request_id: int, start: int, end: int) -> tuple[int, ...]:
        """KV slot (block_id * block_size + offset) of each token position in [start, end)."""
        table = self._tables[request_id]
        size = self.block_size
        return tuple(table[pos // size] * size + pos % size for pos in range(start, end))

    # ---- internals ----

    def _match_prefix(
        self, token_ids: Sequence[int], root: BlockHash
    ) -> tuple[list[int | None], list[BlockHash]]:
        """Cached blocks equal to the leading full blocks, never including the last token:
        a device block, or None where a KV tier holds the block instead."""
        if not self.enable_prefix_caching:
            return [], []
        hits: list[int | None] = []
        hashes: list[BlockHash] = []
        parent = root
        tiers = self.kv_tiers
        for index in range((len(token_ids) - 1) // self.block_size):
            block_hash = hash_block(parent, self._block_tokens(token_ids, index))
            block = self._cached.get(block_hash)
            if block is None and (tiers is None or tiers.tier_of(block_hash) is None):
                break
            hits.append(block)
            hashes.append(block_hash)
            parent = block_hash
        return hits, hashes

    def _block_tokens(self, token_ids: Sequence[int], index: int) -> Sequence[int]:
        return token_ids[index * self.block_size : (index + 1) * self.block_size]

    def _restored(self, block_hash: BlockHash) -> int:
        """A fresh block, published under `block_hash`, that the next step fills from its
        KV tier."""
        assert self.kv_tiers is not None
        block = self._take_fresh()
        tier = self.kv_tiers.restore(block_hash, block)
        self.num_prefix_hit_tokens_by_tier[tier] += self.block_size
        self._cached[block_hash] = block
        self._block_hashes[block] = block_hash
        return block

    def _acquire_cached(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1

    def _take_fresh(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            block_hash = self._block_hashes[block]
            assert block_hash is not None
            del self._cached[block_hash]
            self._block_hashes[block] = None
            if self.kv_tiers is not None:
                self.kv_tiers.offload(block, block_hash)
        self._ref_counts[block] = 1
        return block

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests and debugging)."""
        holders = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {request_id} holds a block twice"
            for block in table:
                holders[block] += 1
        assert holders == self._ref_counts, "reference counts differ from table membership"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        evictable = set(self._evictable)
        used = {block for block, count in enumerate(self._ref_counts) if count > 0}
        assert not (free & evictable or free & used or evictable & used), "a block has two states"
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "a block was lost"
        for block, count in enumerate(self._ref_counts):
            block_hash = self._block_hashes[block]
            assert count <= 1 or block_hash is not None, f"block {block} shared without a hash"
            assert block not in free or block_hash is None, f"free block {block} has a hash"
            assert block not in evictable or block_hash is not None, (
                f"evictable block {block} has no hash"
            )
            if block_hash is not None:
                assert self._cached.get(block_hash) == block, f"block {block} not under its hash"
        assert len(self._cached) == sum(h is not None for h in self._block_hashes)
