"""The paged KV cache: fixed-size blocks of key/value slots, per layer.

Layout per layer: K and V are each [num_blocks, block_size, num_kv_heads, head_dim]
(vLLM / flash-attention's paged layout). A token lives in one slot,
slot = block_id * block_size + offset, so writing a step's new tokens is one indexed
copy into the flattened [num_blocks * block_size, num_kv_heads, head_dim] view, and
reading a sequence's keys is one gather of its block table's rows.
Which blocks a sequence owns is decided by the router's block allocator; this module
only stores and hands out the tensors.

A quantized cache (`--kv-cache-dtype int8|fp8`) keeps int8 or float8 e4m3 K/V of the same
shape plus float32 scales [num_blocks, block_size, num_kv_heads] beside them, one per
token and kv head (layout and reference ops: kernels/kv_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from textgate.kernels import kv_quant
from textgate.kernels.cpu_attention import store_quantized


@dataclass
class KVCache:
    """Per-layer key and value block tensors (and their scales when quantized)."""

    key_caches: list[Tensor]
    value_caches: list[Tensor]
    block_size: int
    #: Per-layer [num_blocks, block_size, H_kv] float32 scales; None when unquantized.
    key_scales: list[Tensor] | None = None
    value_scales: list[Tensor] | None = None

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
        """Zeroed caches of element `dtype` (int8 / float8_e4m3fn: quantized, with scales).

        Unwritten slots must be finite (masked keys still meet the matmul): zeros with
        zero scales dequantize to zeros.
        """
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> list[Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

        if not kv_quant.is_quantized(dtype):
            return cls(zeros(shape, dtype), zeros(shape, dtype), block_size)
        return cls(
            zeros(shape, dtype),
            zeros(shape, dtype),
            block_size,
            zeros(shape[:-1], torch.float32),
            zeros(shape[:-1], torch.float32),
        )

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Memory one block takes over all layers, K and V and their scales (to size num_blocks)."""
        per_head = head_dim * torch.empty((), dtype=dtype).element_size()
        if kv_quant.is_quantized(dtype):
            per_head += 4  # its float32 scale
        return 2 * num_layers * block_size * num_kv_heads * per_head

    @property
    def dtype(self) -> torch.dtype:
        """The caches' element dtype (int8 or float8_e4m3fn when quantized)."""
        return self.key_caches[0].dtype

    @property
    def quantized(self) -> bool:
        return self.key_scales is not None

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

    def layer_scales(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """(key_scales, value_scales) of one layer, each [num_blocks, block_size, H_kv];
        (None, None) when the cache is not quantized."""
        if self.key_scales is None or self.value_scales is None:
            return None, None
        return self.key_scales[layer], self.value_scales[layer]

    def store(self, layer: int, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
        """Write new tokens' key/value [T, H_kv, D] into slots slot_mapping [T] of `layer`.

        Every slot must be valid (0 ≤ slot < num_slots); padding tokens need a slot of
        their own (e.g. a reserved scratch block) rather than -1. A quantized cache
        quantizes each token's head vectors as it stores them (kv_quant.store_kv; on the
        CPU one C pass, cpu_attention.store_quantized, writes the same bits).
        """
        key_cache, value_cache = self.layer(layer)
        key_scales, value_scales = self.layer_scales(layer)
        if key_scales is not None and value_scales is not None:
            for cache, scales, x in (
                (key_cache, key_scales, key),
                (value_cache, value_scales, value),
            ):
                if not store_quantized(cache, scales, x, slot_mapping):
                    kv_quant.store_kv(cache, scales, x, slot_mapping)
            return
        slots = slot_mapping.long()
        heads, dim = key_cache.shape[2], key_cache.shape[3]
        key_cache.view(-1, heads, dim).index_copy_(0, slots, key.to(key_cache.dtype))
        value_cache.view(-1, heads, dim).index_copy_(0, slots, value.to(value_cache.dtype))
