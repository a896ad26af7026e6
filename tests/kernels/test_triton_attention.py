"""The "triton" attention backend against the SDPA reference on random paged caches.

Runs on CUDA (`-m gpu`) or on CPU tensors in triton's interpreter (tests/kernels/conftest.py
sets TRITON_INTERPRET=1 without a GPU); shapes stay tiny because the interpreter is slow.
"""

from __future__ import annotations

import math

import pytest
import torch

from textgate.kernels import kv_quant
from textgate.kernels.attention import AttentionMetadata, SdpaAttentionBackend
from textgate.kernels.triton.attention import TritonAttentionBackend

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


class Case:
    """A random step: sequences with `query_lens` new tokens after `context_lens` cached
    ones, their blocks scattered over a cache of random keys and values."""

    def __init__(
        self,
        query_lens: list[int],
        context_lens: list[int],
        *,
        block_size: int,
        heads: int,
        kv_heads: int,
        dim: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
        counts = [math.ceil(length / block_size) for length in lengths]
        num_blocks = sum(counts) + 3
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [[ids.pop() for _ in range(count)] for count in counts]
        self.metadata = AttentionMetadata.build(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            block_size=block_size,
            device=device,
        )
        shape = (num_blocks, block_size, kv_heads, dim)
        self.key_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        self.value_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        num_tokens = sum(query_lens)
        self.query = torch.randn(num_tokens, heads, dim, generator=gen).to(dtype).to(device)
        self.scale = dim**-0.5

    def reference(self, window: int | None = None, key_cache=None, value_cache=None):
        """SDPA in float32 on the CPU over the same (rounded) values: [T, H_q, D]."""
        cpu = AttentionMetadata(
            **{
                name: getattr(self.metadata, name).cpu()
                for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")
            },
            max_seqlen_q=self.metadata.max_seqlen_q,
            max_seqlen_k=self.metadata.max_seqlen_k,
        )
        sdpa = SdpaAttentionBackend()
        keys = self.key_cache if key_cache is None else key_cache
        values = self.value_cache if value_cache is None else value_cache
        return sdpa.forward(
            self.query.float().cpu(),
            keys.float().cpu(),
            values.float().cpu(),
            sdpa.prepare(cpu),
            scale=self.scale,
            sliding_window=window,
        )

    def run(self, backend: TritonAttentionBackend, window: int | None = None, **scales):
        plan = backend.prepare(self.metadata)
        out = backend.forward(
            self.query,
            self.key_cache,
            self.value_cache,
            plan,
            scale=self.scale,
            sliding_window=window,
            **scales,
        )
        assert out.shape == self.query.shape and out.dtype == self.query.dtype
        return out.float().cpu()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "dtype"),
    [
        (16, 4, 4, torch.float32),
        (32, 4, 2, torch.float16),
        (64, 8, 2, torch.bfloat16),
        (16, 4, 1, torch.bfloat16),
    ],
)
def test_decode_matches_sdpa(triton_device, block_size, heads, kv_heads, dtype):
    # Ragged lengths: partial last blocks, a one-token sequence, one exactly a block long.
    case = Case(
        [1, 1, 1, 1],
        [0, 20, block_size - 1, 2 * block_size + 5],
        block_size=block_size,
        heads=heads,
        kv_heads=kv_heads,
        dtype=dtype,
        device=triton_device,
    )
    out = case.run(TritonAttentionBackend())
    assert_close(out, case.reference(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_k_merges_partitions(triton_device, dtype):
    # 16-token partitions over up to 83 keys: up to 6 splits, some sequences end before
    # the last split (it sees no key and must weigh nothing).
    case = Case(
        [1, 1, 1],
        [82, 40, 3],
        block_size=16,
        heads=4,
        kv_heads=2,
        dtype=dtype,
        device=triton_device,
        seed=1,
    )
    backend = TritonAttentionBackend(kv_tile=16, partition_size=16, target_programs=1024)
    assert backend.num_splits(83, 6, torch.device(triton_device)) == (6, 16)
    assert_close(case.run(backend), case.reference(), dtype)


def test_split_count_fills_the_device_and_respects_limits():
    backend = TritonAttentionBackend(partition_size=512, max_splits=8, target_programs=64)
    cpu = torch.device("cpu")
    assert backend.num_splits(512, 4, cpu) == (1, 512)  # short: no split
    assert backend.num_splits(4096, 4, cpu) == (8, 512)  # long, few programs: max_splits
    assert backend.num_splits(4096, 64, cpu) == (1, 4096)  # the batch fills the device
    assert backend.num_splits(2000, 16, cpu) == (4, 512)  # 32 tiles of 64: 4 × 8 (last short)
    assert TritonAttentionBackend(kv_tile=16).num_splits(1000, 1, cpu) == (2, 512)
    with pytest.raises(ValueError, match="kv_tile must be a power of two"):
        TritonAttentionBackend(kv_tile=24)


@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "dtype", "dim"),
    [
        (16, 4, 2, torch.float32, 16),
        (32, 2, 2, torch.float16, 16),
        (64, 8, 2, torch.bfloat16, 16),
        (16, 6, 2, torch.float32, 12),  # group of 3 (padded to 4), head dim 12 (padded to 16)
    ],
)
def test_prefill_and_mixed_steps_match_sdpa(triton_device, block_size, heads, kv_heads, dtype, dim):
    # A whole prompt, a chunk after a cached prefix (chunked / prefix-cached prefill), a
    # decode and a chunk starting mid-block, in one step.
    case = Case(
        [9, 13, 1, 5],
        [0, block_size + 3, 30, 7],
        block_size=block_size,
        heads=heads,
        kv_heads=kv_heads,
        dim=dim,
        dtype=dtype,
        device=triton_device,
        seed=2,
    )
    # 16 rows per program: several tiles per sequence.
    out = case.run(TritonAttentionBackend(block_rows=16))
    assert_close(out, case.reference(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_verification_steps_match_sdpa(triton_device, dtype):
    # Speculation's verification: decodes with 1 + k drafts (k = 4, 2, 0) after long
    # contexts, one crossing a block boundary, beside a plain decode and a prompt chunk.
    case = Case(
        [5, 3, 1, 1, 6],
        [37, 15, 22, 9, 16],
        block_size=16,
        heads=4,
        kv_heads=2,
        dtype=dtype,
        device=triton_device,
        seed=5,
    )
    out = case.run(TritonAttentionBackend(block_rows=16))
    assert_close(out, case.reference(), dtype)


@pytest.mark.parametrize(("block_size", "kv_tile"), [(8, 16), (24, 64)])
def test_any_block_size_under_tiles_that_span_blocks(triton_device, block_size, kv_tile):
    # Blocks smaller than a tile and of no power of two: each key's block is looked up.
    case = Case(
        [1, 6, 3],
        [29, 11, 0],
        block_size=block_size,
        heads=4,
        kv_heads=2,
        dtype=torch.float16,
        device=triton_device,
        seed=5,
    )
    backend = TritonAttentionBackend(kv_tile=kv_tile, block_rows=16)
    assert_close(case.run(backend), case.reference(), torch.float16)
    decode = Case([1, 1], [40, 9], block_size=block_size, heads=4, kv_heads=2, seed=6,
                  device=triton_device)  # fmt: skip
    backend = TritonAttentionBackend(kv_tile=16, partition_size=16, target_programs=1024)
    assert_close(decode.run(backend), decode.reference(), torch.float32)


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_sliding_window_matches_sdpa(triton_device, step):
    query_lens, context_lens = ([1, 1], [44, 7]) if step == "decode" else ([12, 6], [30, 0])
    case = Case(
        query_lens,
        context_lens,
        block_size=16,
        heads=4,
        kv_heads=2,
        device=triton_device,
        seed=3,
    )
    backend = TritonAttentionBackend(
        block_rows=16, kv_tile=16, partition_size=16, target_programs=1024
    )
    assert_close(case.run(backend, window=9), case.reference(window=9), torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_quantized_cache_matches_sdpa_over_its_dequantized_values(triton_device, kv_dtype, step):
    query_lens, context_lens = ([1, 1, 1], [35, 16, 2]) if step == "decode" else ([7, 1], [20, 9])
    case = Case(
        query_lens,
        context_lens,
        block_size=16,
        heads=4,
        kv_heads=2,
        dtype=torch.bfloat16,
        device=triton_device,
        seed=4,
    )
    keys, key_scales = kv_quant.quantize_kv(case.key_cache, kv_dtype)
    values, value_scales = kv_quant.quantize_kv(case.value_cache, kv_dtype)
    reference = case.reference(
        key_cache=kv_quant.dequantize_kv(keys, key_scales, torch.bfloat16),
        value_cache=kv_quant.dequantize_kv(values, value_scales, torch.bfloat16),
    )
    case.key_cache, case.value_cache = keys, values
    backend = TritonAttentionBackend(
        block_rows=16, kv_tile=16, partition_size=16, target_programs=1024
    )
    out = case.run(backend, key_scales=key_scales, value_scales=value_scales)
    assert_close(out, reference, torch.bfloat16)


def test_rejects_what_it_cannot_run(triton_device, monkeypatch):
    backend = TritonAttentionBackend()

    def run(case: Case, **scales):
        return case.run(backend, **scales)

    case = Case([1], [5], block_size=16, heads=2, kv_heads=1, device=triton_device)
    with pytest.raises(ValueError, match=r"cache dtype torch\.float16 differs"):
        case.key_cache = case.value_cache = case.key_cache.half()
        run(case)
    case.key_cache = case.value_cache = case.key_cache.to(torch.int8)
    with pytest.raises(ValueError, match="needs its scales"):
        run(case)
    if triton_device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="need a CUDA device"):
            run(Case([1], [5], block_size=16, heads=2, kv_heads=1))
