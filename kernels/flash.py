"""The "flash" attention backend: an adapter over the `flash-attn` package (CUDA only).

Maps a step's `AttentionMetadata` onto flash-attention 2's paged entry points:
- a decode step (one new token per sequence): `flash_attn_with_kvcache(q [B, 1, H, D],
  k_cache, v_cache, cache_seqlens=seq_lens, block_table=...)`;
- any other step (prefill, chunked or prefix-cached prefill, decodes mixed in):
  `flash_attn_varlen_func(q [T, H, D], k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, block_table=...)`, with cu_seqlens_k the running sum of
  the sequences' total lengths.
Both read the caches in our layout ([num_blocks, block_size, H_kv, D], flash-attention's
paged layout) through int32 block tables, with causal=True, whose mask flash-attention
aligns to the bottom right (the new tokens are the last of each sequence's keys): the
same rule as ours. A sliding window w (keys at positions > p - w) is window_size=(w - 1, 0).

flash-attn 2 needs block sizes that are multiples of 256 for a paged cache, float16 or
bfloat16, and reads no quantized cache: choose `--attention triton` otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from dataclasses import dataclass

import torch
from torch import Tensor

from textgate.kernels.attention import AttentionBackend, AttentionMetadata

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@dataclass
class FlashPlan:
    """The step's metadata in flash-attention's dtypes (int32), built once per step."""

    decode: bool
    cu_seqlens_q: Tensor  # [B+1] int32
    cu_seqlens_k: Tensor  # [B+1] int32
    seq_lens: Tensor  # [B] int32
    block_table: Tensor  # [B, max_blocks] int32, padding clamped to block 0
    max_seqlen_q: int
    max_seqlen_k: int


class FlashAttentionBackend(AttentionBackend[FlashPlan]):
    """flash-attn's varlen and kv-cache kernels over the paged cache (see the module doc)."""

    #: `prepare` only converts tensors on the device; nothing is read back to the host.
    supports_cuda_graphs = True
    #: flash-attn 2 reads a paged cache only in pages of a multiple of this many slots.
    page_size_multiple = 256

    def __init__(self) -> None:
        self._flash: types.ModuleType | None = None

    @staticmethod
    def unavailable_reason(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
        """Why the backend cannot serve a model on `device` in `dtype`; None when it can."""
        if torch.device(device).type != "cuda":
            return "flash-attn runs on CUDA GPUs only"
        if not flash_attn_installed():
            return "the 'flash-attn' package is not installed"
        if dtype not in FLASH_DTYPES:
            return f"flash-attn computes in float16/bfloat16, not {dtype}"
        multiple = FlashAttentionBackend.page_size_multiple
        if block_size % multiple:
            return f"flash-attn's paged cache needs a block size that is a multiple of {multiple} (--block-size {block_size})"
        return None

    def prepare(self, metadata: AttentionMetadata) -> FlashPlan:
        seq_lens = metadata.seq_lens.to(torch.int32)
        cu_seqlens_k = torch.zeros(metadata.num_seqs + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_seqlens_k[1:])
        return FlashPlan(
            decode=metadata.max_seqlen_q == 1,
            cu_seqlens_q=metadata.query_start_loc.to(torch.int32),
            cu_seqlens_k=cu_seqlens_k,
            seq_lens=seq_lens,
            block_table=metadata.block_tables.clamp(min=0).to(torch.int32),
            max_seqlen_q=metadata.max_seqlen_q,
            max_seqlen_k=metadata.max_seqlen_k,
        )

    def forward(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        plan: FlashPlan,
        *,
        scale: float,
        sliding_window: int | None = None,
        key_scales: Tensor | None = None,
        value_scales: Tensor | None = None,
    ) -> Tensor:
        if key_scales is not None or value_scales is not None:
            raise ValueError("flash-attn reads no quantized KV cache; use --attention triton")
        if query.dtype not in FLASH_DTYPES or key_cache.dtype != query.dtype:
            raise ValueError(
                f"flash-attn needs float16/bfloat16 queries and caches (got {query.dtype}, "
                f"{key_cache.dtype})"
            )
        block_size = key_cache.shape[1]
        if block_size % self.page_size_multiple:
            raise ValueError(
                f"flash-attn's paged cache needs a block size that is a multiple of "
                f"{self.page_size_multiple}, got {block_size}"
            )
        flash = self._module()
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        if plan.decode:
            out = flash.flash_attn_with_kvcache(
                query.unsqueeze(1),  # [B, 1, H_q, D]
                key_cache,
                value_cache,
                cache_seqlens=plan.seq_lens,
                block_table=plan.block_table,
                softmax_scale=scale,
                causal=True,
                window_size=window,
            )  # [B, 1, H_q, D]
            return out.squeeze(1)
        return flash.flash_attn_varlen_func(
            query,
            key_cache,
            value_cache,
            cu_seqlens_q=plan.cu_seqlens_q,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            block_table=plan.block_table,
        )  # [T, H_q, D]

    def _module(self) -> types.ModuleType:
        if self._flash is None:
            try:
                self._flash = importlib.import_module("flash_attn")
            except ImportError as error:
                raise RuntimeError(
                    "--attention flash needs the 'flash-attn' package (pip install flash-attn)"
                ) from error
        return self._flash
