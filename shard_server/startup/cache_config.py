"""`CacheConfig`: how a paged shard sizes its KV cache and decode graphs at warmup."""

from __future__ import annotations

from dataclasses import dataclass

from textgate.kernels.kv_quant import KV_CACHE_DTYPES
from textgate.shard_server.step.cuda_graphs import DEFAULT_CUDA_GRAPHS


@dataclass(frozen=True)
class CacheConfig:
    """How the shard sizes its KV cache at warmup."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int = 1 << 30
    """Bytes of KV cache on CPU."""
    cuda_memory_fraction: float = 0.9
    """Share of the GPU memory left free after loading that the cache may take."""
    kv_cache_dtype: str = "auto"
    """KV element dtype: auto (the model's), int8, fp8 / fp8_e4m3 (kernels/kv_quant.py)."""
    cuda_graphs: tuple[int, ...] = DEFAULT_CUDA_GRAPHS
    """Decode batch sizes captured as CUDA graphs at warmup (empty: none; ignored on CPU)."""
    kv_offload_dir: str | None = None
    """Root of the disk KV tier (--kv-offload-dir); None: host tier only."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.cuda_memory_fraction <= 1:
            raise ValueError("cuda_memory_fraction must lie in (0, 1]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown KV cache dtype {self.kv_cache_dtype!r}; expected one of: "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if any(size < 1 for size in self.cuda_graphs):
            raise ValueError(f"cuda_graphs sizes must be positive, got {self.cuda_graphs}")
