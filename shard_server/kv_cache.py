"""The paged KV cache: fixed-size blocks of key/value slots, per layer.

Layout per layer: K and V are each [num_blocks, block_size, num_kv_heads, head_dim]
(vLLM / flash-attention's paged layout). A token lives in one slot,
slot = block_id * block_size + offset, so writing a step's new tokens is one indexed
copy into the flattened [num_blocks * block_size, num_kv_heads, head_dim] view, and
reading a sequence's keys is one gather of its block table's rows.
Which blocks a sequence owns is decided by the router's block allocator; this module
only stores and hands out the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    """Per-layer key and value block tensors."""

    key_caches: list[Tensor]
    value_caches: list[Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """Zeroed caches (unwritten slots must be finite: masked keys still meet the matmul)."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            block_size,
        )

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one block takes over all layers, K and V (to size num_blocks)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    @property
    def num_layers(self) -> int:
        return len(self.key_caches)

    @property
    def num_blocks(self) -> int:
        return self.key_caches[0].shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """(key_cache, value_cache) of one layer, each [num_blocks, block_size, H_kv, D]."""
        return self.key_caches[layer], self.value_caches[layer]

    def store(self, layer: int, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
        """Write new tokens' key/value [T, H_kv, D] into slots slot_mapping [T] of `layer`.

        Every slot must be valid (0 ≤ slot < num_slots); padding tokens need a slot of
        their own (e.g. a reserved scratch block) rather than -1.
        """
        key_cache, value_cache = self.layer(layer)
        slots = slot_mapping.long()
        heads, dim = key_cache.shape[2], key_cache.shape[3]
        key_cache.view(-1, heads, dim).index_copy_(0, slots, key.to(key_cache.dtype))
        value_cache.view(-1, heads, dim).index_copy_(0, slots, value.to(value_cache.dtype))
