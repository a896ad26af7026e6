"""Paged attention on the CPU through a small C kernel (cpu_attention.c), SDPA elsewhere.

`SdpaAttentionBackend` gathers every sequence's keys into a padded copy and runs one
batched SDPA per layer; for a decode step of many short sequences most of that time is
per-matrix overhead (measured on 2 cores, SmolLM2 shapes, 32 sequences: ~370 µs of SDPA
plus ~55 µs of gathers per layer, against ~160-230 µs for the kernel). The kernel reads
keys and values in place through the block tables, one (sequence, kv head, row chunk)
per work item on torch's OpenMP threads. Long prompt chunks stay on SDPA (see
`CpuAttentionBackend`).

The kernel is built on first use (kernels/cpu_build.py). Without a compiler, or for
tensors it does not handle (not on the CPU, not float32/bfloat16), the backend runs the
SDPA reference instead, so it is correct everywhere. Quantized caches (int8, fp8 e4m3 with
per-token scales, kernels/kv_quant.py) are read in place by the kernel, as they are stored.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
from torch import Tensor

from textgate.kernels import cpu_build, cpu_layers, kv_quant
from textgate.kernels.attention import AttentionBackend, AttentionMetadata
from textgate.kernels.sdpa import SdpaAttentionBackend, SdpaPlan, SeqGroup

SUPPORTED_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: The kernel's kv_kind for each quantized cache dtype (0: the cache is in the query's dtype).
QUANTIZED_KV_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2}


@dataclass
class KernelBatch:
    """The sequences the kernel attends in one step, as contiguous int64 arrays."""

    query_starts: Tensor  # [Bk] first row of each sequence in the step's query
    query_lens: Tensor  # [Bk]
    seq_lens: Tensor  # [Bk]
    block_tables: Tensor  # [Bk, max_blocks]
    max_seq_len: int

    def kernel_args(self) -> tuple[int, ...]:
        """The batch as the C kernels take it: the four arrays' addresses, then the number
        of sequences and of blocks per table."""
        arrays = (self.query_starts, self.query_lens, self.seq_lens, self.block_tables)
        return (*(a.data_ptr() for a in arrays), *self.block_tables.shape)


@dataclass
class CpuPlan:
    """Per-step state: who runs on the kernel, who on SDPA (built only if it is needed)."""

    metadata: AttentionMetadata
    kernel: KernelBatch | None
    sdpa_groups: list[SeqGroup]
    _fallback: SdpaPlan | None = field(default=None, repr=False)


class CpuAttentionBackend(AttentionBackend[CpuPlan]):
    """The C kernel for CPU tensors in float32/bfloat16 (caches in the query's dtype, int8
    or fp8 e4m3); the SDPA reference otherwise.

    Within a step, the kernel takes the decodes (with speculation's drafts: queries of at
    most `kernel_max_query_len` rows) and every sequence of at most `kernel_max_seq_len`
    tokens; longer prompt chunks go to SDPA, whose matmuls beat the
    kernel's per-row loops once a chunk has many rows over a long prefix (measured, bf16,
    2 cores: 4 chunks of 32 rows over 512 cached tokens 2.7 ms against SDPA's 1.5 ms;
    decodes over 100 tokens 0.23 ms against 0.46 ms, over 2,000 tokens 1.1 against 2.7).
    """

    kernel_max_seq_len = 96
    kernel_max_query_len = 8
    """Queries of at most this many rows run on the kernel at any length: a decode and the
    drafts speculation verifies with it (on SDPA, one such row sent the whole step off
    the fused decoder stack)."""
    supports_quantized_kv = True

    def __init__(self) -> None:
        self._sdpa = SdpaAttentionBackend()

    def prepare(self, metadata: AttentionMetadata) -> CpuPlan:
        query_lens = metadata.query_lens()
        on_kernel = (query_lens <= self.kernel_max_query_len) | (
            metadata.seq_lens <= self.kernel_max_seq_len
        )
        kernel = self._kernel_batch(metadata, on_kernel) if bool(on_kernel.any()) else None
        groups = []
        if not bool(on_kernel.all()):
            on_sdpa = ~on_kernel
            max_q = int(query_lens[on_sdpa].max())
            max_k = int(metadata.seq_lens[on_sdpa].max())
            groups.append(self._sdpa.group(metadata, on_sdpa, max_q, max_k))
        return CpuPlan(metadata, kernel, groups)

    @staticmethod
    def _kernel_batch(metadata: AttentionMetadata, member: Tensor) -> KernelBatch:
        def pick(tensor: Tensor) -> Tensor:
            return tensor[member].to(torch.int64).contiguous()

        seq_lens = pick(metadata.seq_lens)
        return KernelBatch(
            query_starts=pick(metadata.query_start_loc[:-1]),
            query_lens=pick(metadata.query_lens()),
            seq_lens=seq_lens,
            block_tables=pick(metadata.block_tables.clamp(min=0)),
            max_seq_len=int(seq_lens.max()),
        )

    def forward(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        plan: CpuPlan,
        *,
        scale: float,
        sliding_window: int | None = None,
        key_scales: Tensor | None = None,
        value_scales: Tensor | None = None,
    ) -> Tensor:
        scales = (key_scales, value_scales)
        runs_kernel = self._runs_kernel(query, key_cache, value_cache, scales)
        library = cpu_build.load_library() if runs_kernel else None
        if library is None:
            if plan._fallback is None:
                plan._fallback = self._sdpa.prepare(plan.metadata)
            return self._sdpa.forward(
                query,
                key_cache,
                value_cache,
                plan._fallback,
                scale=scale,
                sliding_window=sliding_window,
                key_scales=key_scales,
                value_scales=value_scales,
            )
        query = query.contiguous()
        out = torch.empty_like(query)  # [T, H_q, D]; each row written by exactly one of the two
        self._sdpa.attend_groups(
            query, key_cache, value_cache, plan.sdpa_groups, out, scale, sliding_window, scales
        )
        if plan.kernel is not None:
            self._run_kernel(
                library,
                query,
                (key_cache, value_cache),
                scales,
                out,
                plan.kernel,
                scale,
                sliding_window,
            )
        return out

    @staticmethod
    def _run_kernel(
        library: ctypes.CDLL,
        query: Tensor,
        caches: tuple[Tensor, Tensor],
        scales: tuple[Tensor | None, Tensor | None],
        out: Tensor,
        batch: KernelBatch,
        scale: float,
        sliding_window: int | None,
    ) -> None:
        key_cache, value_cache = caches
        key_scales, value_scales = scales
        _, block_size, kv_heads, head_dim = key_cache.shape
        failed = library.textgate_paged_attention(
            query.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            out.data_ptr(),
            *batch.kernel_args(),
            query.shape[1],
            kv_heads,
            head_dim,
            block_size,
            batch.max_seq_len,
            scale,
            sliding_window or 0,
            SUPPORTED_DTYPES[query.dtype],
            None if key_scales is None else key_scales.data_ptr(),
            None if value_scales is None else value_scales.data_ptr(),
            QUANTIZED_KV_KINDS.get(key_cache.dtype, 0),
        )
        if failed:
            raise MemoryError("CPU attention kernel: out of memory for its scratch space")

    @staticmethod
    def _runs_kernel(
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        scales: tuple[Tensor | None, Tensor | None],
    ) -> bool:
        """Whether the kernel handles these tensors (else SDPA does)."""
        if key_cache.dtype in QUANTIZED_KV_KINDS:
            readable = all(
                s is not None
                and s.dtype == torch.float32
                and s.is_contiguous()
                and s.shape == key_cache.shape[:-1]
                for s in scales
            )
        else:
            readable = key_cache.dtype == query.dtype and all(s is None for s in scales)
        return (
            readable
            and query.device.type == "cpu"
            and query.dtype in SUPPORTED_DTYPES
            and key_cache.dtype == value_cache.dtype
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and query.shape[1] % key_cache.shape[2] == 0
            and query.shape[2] == key_cache.shape[3]
        )


def store_quantized(cache: Tensor, scales: Tensor, x: Tensor, slot_mapping: Tensor) -> bool:
    """kv_quant.store_kv (quantize x [T, H_kv, D], write slots slot_mapping [T] of cache and
    scales) in one C pass, writing the same bits; False, having written nothing, where the
    kernel does not apply (no compiler, not on the CPU, x not float32/bfloat16)."""
    x = x.contiguous()  # the model's keys and values are strided views of its qkv output
    if not (
        cache.device.type == x.device.type == slot_mapping.device.type == "cpu"
        and cache.dtype in QUANTIZED_KV_KINDS
        and x.dtype in SUPPORTED_DTYPES
        and scales.dtype == torch.float32
        and slot_mapping.dtype == torch.int64
        and all(t.is_contiguous() for t in (cache, scales, x, slot_mapping))
    ):
        return False
    library = cpu_build.load_library()
    if library is None:
        return False
    num_tokens, heads, dim = x.shape
    library.textgate_store_kv_quantized(
        x.data_ptr(),
        slot_mapping.data_ptr(),
        cache.data_ptr(),
        scales.data_ptr(),
        num_tokens,
        heads,
        dim,
        SUPPORTED_DTYPES[x.dtype],
        QUANTIZED_KV_KINDS[cache.dtype],
    )
    return True


def rotary_and_store_quantized(
    qkv: Tensor,
    cos: Tensor,
    sin_signed: Tensor,
    caches: tuple[Tensor, Tensor],
    scales: tuple[Tensor | None, Tensor | None],
    slot_mapping: Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> Tensor | None:
    """cpu_layers.rotary_and_store for a quantized cache: the fused rotary writes this step's
    keys and values [T, H_kv, D] to a scratch copy, which store_quantized then quantizes into
    the caches at `slot_mapping`; returns the rotated queries [T, H_q, D]. None where either
    C kernel does not apply (the caller then runs the PyTorch reference)."""
    key_cache, value_cache = caches
    key_scales, value_scales = scales
    if key_scales is None or value_scales is None or key_cache.dtype not in QUANTIZED_KV_KINDS:
        return None
    num_tokens, head_dim = qkv.shape[0], key_cache.shape[-1]
    scratch = qkv.new_empty(2, num_tokens, num_kv_heads, head_dim)  # keys, values
    rows = torch.arange(num_tokens)
    query = cpu_layers.rotary_and_store(
        qkv, cos, sin_signed, scratch[0], scratch[1], rows, num_heads, num_kv_heads
    )
    if query is None:
        return None
    for cache, cache_scales, x in (
        (key_cache, key_scales, scratch[0]),
        (value_cache, value_scales, scratch[1]),
    ):
        if not store_quantized(cache, cache_scales, x, slot_mapping):
            kv_quant.store_kv(cache, cache_scales, x, slot_mapping)
    return query
