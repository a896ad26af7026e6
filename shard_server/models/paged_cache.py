"""What every model on the paged engine does with its KV cache: make one, pick its dtype."""

from __future__ import annotations

from typing import Any

import torch

from textgate.kernels import kv_quant
from textgate.kernels.attention import AttentionBackend
from textgate.shard_server.step.kv_cache import KVCache


class PagedCacheOwner:
    """Mixed into a paged model that sets `num_layers`, `num_kv_heads` (this rank's),
    `head_dim`, `device`, `attention_backend` and `kv_cache_dtype`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    device: torch.device
    attention_backend: AttentionBackend[Any]
    kv_cache_dtype: torch.dtype
    """Element dtype of the caches `allocate_kv_cache` makes (int8 / fp8: quantized)."""

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """A zeroed paged cache sized for this model, of elements `kv_cache_dtype`."""
        return KVCache.allocate(
            num_layers=self.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_cache_dtype,
            device=self.device,
        )

    def set_kv_cache_dtype(self, dtype: torch.dtype) -> None:
        """Make later caches of elements `dtype`; a quantized one needs a backend that reads it."""
        if kv_quant.is_quantized(dtype) and not self.attention_backend.supports_quantized_kv:
            raise ValueError(
                f"attention backend {type(self.attention_backend).__name__} cannot read a "
                f"{kv_quant.kv_dtype_name(dtype)} KV cache; use --kv-cache-dtype auto or "
                "another attention backend"
            )
        self.kv_cache_dtype = dtype
