"""The "triton" attention backend: paged attention for GPUs without flash-attn.

Two programs (kernels/triton/attention_kernels.py), both reading K/V in place through
the block tables, both GQA aware (one program serves all query heads of a kv head):
- decode (every sequence has one new token): program (sequence, kv head, split); a long
  context is split over several programs (split-K) whose partial softmaxes a second,
  small program merges, so a batch of a few sequences still fills the GPU;
- varlen prefill (any step with a longer query run, including decodes mixed into it,
  prefix-cached and chunked prefills): program (tile of new tokens, kv head), causal
  within the new tokens, over the cached prefix.

Keys are read BLOCK_N (`kv_tile`, 64) tokens at a time whatever the cache's block size;
head dims are padded to a power of two. float16 / bfloat16 / float32 queries; caches in the query's
dtype, or int8 / float8 e4m3 with per-slot scales (kernels/kv_quant.py), dequantized
in the kernel. The step's tiles are built on the device: `prepare` never syncs.
The SDPA backend (kernels/sdpa.py) is its reference.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field

import torch
from torch import Tensor

from textgate.kernels import kv_quant
from textgate.kernels.attention import AttentionBackend, AttentionMetadata
from textgate.kernels.triton import interpreting, next_power_of_2, unavailable_reason

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _programs() -> types.ModuleType:
    from textgate.kernels.triton import attention_kernels

    return attention_kernels


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class TritonPlan:
    """Per-step state: the metadata and, per tile height, the prefill tiles."""

    metadata: AttentionMetadata
    #: [num_tiles] (sequence, first new token) of each prefill tile, per BLOCK_Q.
    _tiles: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)

    @property
    def decode(self) -> bool:
        return self.metadata.max_seqlen_q == 1

    def tiles(self, block_q: int) -> tuple[Tensor, Tensor]:
        """(tile_seq, tile_first) [num_tiles]: BLOCK_Q new tokens per tile, every sequence's
        tiles in order. num_tiles is an upper bound known on the host (T // BLOCK_Q + B);
        the tiles past the last real one have tile_seq == B and return at once."""
        if block_q not in self._tiles:
            md = self.metadata
            per_seq = (md.query_lens() + block_q - 1) // block_q  # [B]
            ends = per_seq.cumsum(0)  # [B]
            ids = torch.arange(md.num_tokens // block_q + md.num_seqs, device=ends.device)
            seq = torch.searchsorted(ends, ids, right=True)  # [num_tiles], B past the end
            starts = (ends - per_seq)[seq.clamp(max=md.num_seqs - 1)]
            self._tiles[block_q] = (seq, (ids - starts) * block_q)
        return self._tiles[block_q]


class TritonAttentionBackend(AttentionBackend[TritonPlan]):
    """Paged attention in Triton (CUDA, or any device under TRITON_INTERPRET=1).

    `block_rows`: query rows (tokens × heads of a group) per prefill program; `kv_tile`:
    keys per loop iteration (a power of two >= 16);
    `partition_size`: the fewest tokens a decode split covers; `max_splits`: the most
    splits of one sequence; `target_programs`: decode programs that fill the device
    (None: twice the GPU's multiprocessors). Tests shrink them to reach every path.
    """

    supports_quantized_kv = True
    #: Nothing is read back to the host: `prepare` builds its tiles on the device and a
    #: decode's split count comes from max_seqlen_k (a captured step's is its table's width).
    supports_cuda_graphs = True

    def __init__(
        self,
        *,
        block_rows: int = 64,
        kv_tile: int = 64,
        partition_size: int = 512,
        max_splits: int = 64,
        target_programs: int | None = None,
    ) -> None:
        if kv_tile < 16 or kv_tile & (kv_tile - 1):
            raise ValueError(f"kv_tile must be a power of two >= 16, got {kv_tile}")
        self.block_rows = block_rows
        self.kv_tile = kv_tile
        self.partition_size = partition_size
        self.max_splits = max_splits
        self.target_programs = target_programs

    @staticmethod
    def unavailable_reason(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
        """Why the backend cannot serve a model on `device` in `dtype`; None when it can."""
        reason = unavailable_reason(device)
        if reason is None and dtype not in FLOAT_DTYPES:
            reason = f"the kernels compute in float16/bfloat16/float32, not {dtype}"
        if reason is None and block_size < 1:
            reason = f"a block holds at least one token (--block-size {block_size})"
        return reason

    def prepare(self, metadata: AttentionMetadata) -> TritonPlan:
        return TritonPlan(metadata)

    def forward(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        plan: TritonPlan,
        *,
        scale: float,
        sliding_window: int | None = None,
        key_scales: Tensor | None = None,
        value_scales: Tensor | None = None,
    ) -> Tensor:
        _check_inputs(query, key_cache, value_cache, key_scales, value_scales)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty_like(query)
        launch = _Launch(
            query, key_cache, value_cache, key_scales, value_scales, scale, sliding_window or 0
        )
        if plan.decode:
            self._decode(launch, plan.metadata, out)
        else:
            self._prefill(launch, plan, out)
        return out

    def num_splits(self, max_seqlen_k: int, programs: int, device: torch.device) -> tuple[int, int]:
        """(splits, tokens per split: a multiple of kv_tile) of a decode step whose longest
        sequence has `max_seqlen_k` tokens and that runs `programs` (sequence, kv head) pairs."""
        tiles = -(-max_seqlen_k // self.kv_tile)
        if max_seqlen_k <= self.partition_size:
            return 1, tiles * self.kv_tile
        target = self.target_programs
        if target is None:
            target = 2 * _multiprocessors(device) if device.type == "cuda" else 128
        splits = min(-(-max_seqlen_k // self.partition_size), -(-target // programs))
        splits = max(1, min(splits, self.max_splits))
        tiles_per_split = -(-tiles // splits)
        return -(-tiles // tiles_per_split), tiles_per_split * self.kv_tile

    def _decode(self, launch: _Launch, md: AttentionMetadata, out: Tensor) -> None:
        programs = _programs()
        num_seqs, heads = launch.query.shape[0], launch.query.shape[1]
        kv_heads = launch.key_cache.shape[2]
        splits, tokens_per_split = self.num_splits(
            md.max_seqlen_k, num_seqs * kv_heads, launch.query.device
        )
        # tl.dot needs 16 rows: a group of fewer query heads is padded (masked rows).
        block_g = max(16, next_power_of_2(launch.group))
        f32 = {"dtype": torch.float32, "device": out.device}
        if splits > 1:
            part_acc = torch.empty(num_seqs, heads, splits, launch.block_d, **f32)
            part_max = torch.empty(num_seqs, heads, splits, **f32)
            part_sum = torch.empty(num_seqs, heads, splits, **f32)
        else:
            part_acc = part_max = part_sum = out  # not read: the kernel writes `out`
        programs.paged_decode_kernel[(num_seqs, kv_heads, splits)](
            launch.query, launch.key_cache, launch.value_cache, launch.key_scales,
            launch.value_scales, md.block_tables, md.seq_lens,
            out, part_acc, part_max, part_sum,
            launch.qk_scale, launch.window, tokens_per_split,
            *launch.query.stride()[:2], *launch.cache_strides, *launch.scale_strides,
            md.block_tables.stride(0), *out.stride()[:2],
            GROUP=launch.group, BLOCK_G=block_g, HEAD_DIM=launch.head_dim,
            BLOCK_D=launch.block_d, BLOCK_SIZE=launch.block_size, BLOCK_N=self.kv_tile,
            SPLIT=splits > 1,
            QUANTIZED=launch.quantized, USE_WINDOW=launch.window > 0, UPCAST=launch.upcast,
        )  # fmt: skip
        if splits > 1:
            programs.paged_decode_reduce_kernel[(num_seqs, heads)](
                part_acc, part_max, part_sum, out, *out.stride()[:2], heads, splits,
                BLOCK_S=next_power_of_2(splits),
                HEAD_DIM=launch.head_dim, BLOCK_D=launch.block_d,
            )  # fmt: skip

    def _prefill(self, launch: _Launch, plan: TritonPlan, out: Tensor) -> None:
        md = plan.metadata
        block_g = next_power_of_2(launch.group)
        # At least 16 rows per program (tl.dot), else block_rows of them.
        block_q = max(1, 16 // block_g, self.block_rows // block_g)
        tile_seq, tile_first = plan.tiles(block_q)
        kv_heads = launch.key_cache.shape[2]
        _programs().paged_prefill_kernel[(tile_seq.shape[0], kv_heads)](
            launch.query, launch.key_cache, launch.value_cache, launch.key_scales,
            launch.value_scales, md.block_tables, md.seq_lens, md.query_start_loc,
            tile_seq, tile_first, out,
            launch.qk_scale, launch.window, md.num_seqs,
            *launch.query.stride()[:2], *launch.cache_strides, *launch.scale_strides,
            md.block_tables.stride(0), *out.stride()[:2],
            GROUP=launch.group, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_DIM=launch.head_dim,
            BLOCK_D=launch.block_d, BLOCK_SIZE=launch.block_size, BLOCK_N=self.kv_tile,
            QUANTIZED=launch.quantized, USE_WINDOW=launch.window > 0, UPCAST=launch.upcast,
        )  # fmt: skip


class _Launch:
    """The arguments one layer's launch shares between the programs."""

    def __init__(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        key_scales: Tensor | None,
        value_scales: Tensor | None,
        scale: float,
        window: int,
    ) -> None:
        self.query, self.key_cache, self.value_cache = query, key_cache, value_cache
        self.window = window  # in tokens; 0: no sliding window
        self.quantized = key_scales is not None
        # Unquantized: the scale pointers are never read; any tensor stands in.
        self.key_scales = key_scales if key_scales is not None else key_cache
        self.value_scales = value_scales if value_scales is not None else value_cache
        self.scale_strides = self.key_scales.stride()[:2] if self.quantized else (0, 0)
        _, self.block_size, kv_heads, self.head_dim = key_cache.shape
        self.group = query.shape[1] // kv_heads
        self.block_d = max(16, next_power_of_2(self.head_dim))
        self.cache_strides = key_cache.stride()[:3]
        self.qk_scale = scale * _programs().LOG2E
        # The interpreter's bfloat16 dot is wrong; float32 wants an exact (not tf32) dot.
        self.upcast = interpreting() or query.dtype == torch.float32


def _check_inputs(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    key_scales: Tensor | None,
    value_scales: Tensor | None,
) -> None:
    """Clear errors for what the kernels do not take (instead of wrong results)."""
    reason = unavailable_reason(query.device)
    if reason is not None:
        raise RuntimeError(f"triton attention cannot run: {reason}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"triton attention: query dtype {query.dtype} is not float16/bfloat16/float32"
        )
    _, _, kv_heads, head_dim = key_cache.shape
    if query.shape[1] % kv_heads or query.shape[2] != head_dim:
        raise ValueError(
            f"query heads {tuple(query.shape[1:])} do not fit the cache's "
            f"({kv_heads} kv heads of dim {head_dim})"
        )
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError("key and value caches differ in shape or layout")
    if key_cache.stride(-1) != 1:
        raise ValueError("triton attention needs caches contiguous in head_dim")
    quantized = kv_quant.is_quantized(key_cache.dtype)
    if quantized != (key_scales is not None and value_scales is not None):
        raise ValueError(
            f"a {key_cache.dtype} cache needs its scales"
            if quantized
            else "scales were given for an unquantized cache"
        )
    if quantized:
        assert key_scales is not None and value_scales is not None
        if key_scales.shape != key_cache.shape[:3] or not key_scales.is_contiguous():
            raise ValueError("key/value scales must be contiguous [num_blocks, block_size, H_kv]")
        if value_scales.stride() != key_scales.stride() or key_scales.dtype != torch.float32:
            raise ValueError("key/value scales must be float32 and laid out alike")
    elif key_cache.dtype != query.dtype:
        raise ValueError(f"cache dtype {key_cache.dtype} differs from the query's {query.dtype}")
