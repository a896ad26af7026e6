"""kernels/kv_quant.py: the quantized KV layout's reference ops."""

from __future__ import annotations

import math

import pytest
import torch

from textgate.kernels import (
    AttentionMetadata,
    CpuAttentionBackend,
    SdpaAttentionBackend,
    cpu_build,
    kv_quant,
)
from textgate.kernels.cpu_attention import QUANTIZED_KV_KINDS, store_quantized
from textgate.shard_server.step.kv_cache import KVCache

QUANTIZED = [torch.int8, torch.float8_e4m3fn]


def test_resolve_names() -> None:
    assert kv_quant.resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.resolve_kv_cache_dtype("int8", torch.float32) == torch.int8
    assert kv_quant.resolve_kv_cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_quant.resolve_kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    with pytest.raises(
        ValueError, match=r"unknown KV cache dtype 'fp4'.*auto, fp8, fp8_e4m3, int8"
    ):
        kv_quant.resolve_kv_cache_dtype("fp4", torch.float32)
    assert kv_quant.kv_dtype_name(torch.float8_e4m3fn) == "fp8_e4m3"
    assert kv_quant.kv_dtype_name(torch.int8) == "int8"
    assert kv_quant.kv_dtype_name(torch.bfloat16) == "bfloat16"


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantize_round_trip_error_is_bounded(dtype: torch.dtype) -> None:
    x = torch.randn(50, 4, 64, generator=torch.Generator().manual_seed(0)) * 3
    q, scale = kv_quant.quantize_kv(x, dtype)
    assert q.dtype == dtype and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (50, 4)
    torch.testing.assert_close(scale, x.abs().amax(-1) / kv_quant.QMAX[dtype])
    back = kv_quant.dequantize_kv(q, scale, torch.float32)
    error = (back - x).abs() / x.abs().amax(-1, keepdim=True)
    # int8: half a step of absmax/127; e4m3: 3 mantissa bits, half an ulp is 1/16 relative.
    bound = 0.5 / 127 if dtype == torch.int8 else 1 / 16
    assert float(error.max()) <= bound + 1e-6
    # The largest element of each vector maps onto QMAX and comes back exactly (up to fp32).
    peak = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(back.gather(-1, peak), x.gather(-1, peak))


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_zero_vectors_and_bf16_input(dtype: torch.dtype) -> None:
    x = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    x[1, 1] = torch.linspace(-2, 2, 8)
    q, scale = kv_quant.quantize_kv(x, dtype)
    assert float(scale[0, 0]) == 0.0 and not q[0].float().any()
    back = kv_quant.dequantize_kv(q, scale, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.isfinite(back.float()).all()
    assert float(back[1, 1, -1]) == 2.0 and float(back[1, 1, 0]) == -2.0


def test_int8_never_reaches_minus_128() -> None:
    x = torch.tensor([[-1.0, 1.0, -0.999]])
    q, _ = kv_quant.quantize_kv(x, torch.int8)
    assert q.tolist() == [[-127, 127, -127]]


def test_unquantized_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="not a quantized"):
        kv_quant.quantize_kv(torch.ones(2, 2), torch.bfloat16)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_store_and_gather_by_slot(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, dim = 6, 4, 2, 16
    cache = torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype)
    scales = torch.zeros(num_blocks, block_size, heads)
    x = torch.randn(5, heads, dim, generator=generator)
    slots = torch.tensor([21, 3, 8, 9, 0])
    kv_quant.store_kv(cache, scales, x, slots)
    q, scale = kv_quant.quantize_kv(x, dtype)
    stored = cache.view(torch.uint8).view(-1, heads, dim)[slots]  # the bits, for fp8 too
    assert torch.equal(stored, q.view(torch.uint8))
    assert torch.equal(scales.view(-1, heads)[slots], scale)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not scales.view(-1, heads)[untouched].any()
    gathered = kv_quant.gather_dequantized(cache, scales, torch.tensor([2, 5]), torch.float32)
    assert gathered.shape == (2, block_size, heads, dim)
    torch.testing.assert_close(
        gathered[1, 1], kv_quant.dequantize_kv(q[0], scale[0], torch.float32)
    )
    torch.testing.assert_close(
        gathered[0, 0], kv_quant.dequantize_kv(q[2], scale[2], torch.float32)
    )
    assert not gathered[0, 2:].any()


# -- attention backends over a quantized cache ------------------------------------------


class KernelOnly(CpuAttentionBackend):
    """Every sequence on the C kernel (the default sends long prompt chunks to SDPA)."""

    kernel_max_seq_len = 10**9


def naive_attention(q, k, v, context: int, window: int | None) -> torch.Tensor:
    """q [S, Hq, D] at positions context.. over k/v [L, Hkv, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("shd,lhd->hsl", q.double(), k) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(q.shape[0])[:, None] + context
    key_pos = torch.arange(k.shape[0])[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hsl,lhd->shd", scores.softmax(-1), v)


def quantized_step(
    kv_dtype: torch.dtype,
    query_dtype: torch.dtype,
    query_lens: list[int],
    context_lens: list[int],
    heads: int,
    kv_heads: int,
    block_size: int,
    dim: int = 64,
    seed: int = 0,
):
    """A step over a quantized cache holding every token (prefixes included) in shuffled
    blocks; also the dequantized keys/values of each sequence, the reference's inputs."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = [[order.pop() for _ in range(n)] for n in needed]
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype=kv_dtype,
    )
    # Per-token magnitudes differ by 30x: one shared scale would lose the small ones.
    magnitude = torch.logspace(-1, 0.5, sum(seq_lens))[torch.randperm(sum(seq_lens))]
    keys = torch.randn(sum(seq_lens), kv_heads, dim, generator=generator) * magnitude[:, None, None]
    values = torch.randn(sum(seq_lens), kv_heads, dim, generator=generator)
    written = AttentionMetadata.build(
        query_lens=seq_lens,
        context_lens=[0] * len(seq_lens),
        block_tables=tables,
        block_size=block_size,
    )
    cache.store(0, keys, values, written.slot_mapping)
    dequantized = [
        kv_quant.dequantize_kv(*kv_quant.quantize_kv(x, kv_dtype), torch.float32).split(seq_lens)
        for x in (keys, values)
    ]
    metadata = AttentionMetadata.build(
        query_lens=query_lens, context_lens=context_lens, block_tables=tables, block_size=block_size
    )
    query = torch.randn(sum(query_lens), heads, dim, generator=generator).to(query_dtype)
    return cache, metadata, query, dequantized


def check_against_reference(backend, step, window: int | None = None) -> None:
    cache, metadata, query, (keys, values) = step
    key_scales, value_scales = cache.layer_scales(0)
    dim = query.shape[-1]
    out = backend.forward(
        query,
        *cache.layer(0),
        backend.prepare(metadata),
        scale=dim**-0.5,
        sliding_window=window,
        key_scales=key_scales,
        value_scales=value_scales,
    )
    assert out.shape == query.shape and out.dtype == query.dtype
    # fp32: only summation order differs. bf16: SDPA rounds the dequantized K/V and the
    # scores to bf16, the kernel its output.
    tol = 2e-5 if query.dtype == torch.float32 else 3e-2
    starts = metadata.query_start_loc.tolist()
    context_lens = metadata.context_lens().tolist()
    for b, context in enumerate(context_lens):
        rows = slice(starts[b], starts[b + 1])
        expected = naive_attention(query[rows].float(), keys[b], values[b], context, window)
        torch.testing.assert_close(out[rows].double(), expected, atol=tol, rtol=tol)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the C kernel's calls and fails any dequantized gather (the kernel reads the
    quantized cache in place; only SDPA gathers)."""
    library = cpu_build.load_library()
    assert library is not None
    calls = []

    class Spy:
        def textgate_paged_attention(self, *args):
            calls.append(args)
            return library.textgate_paged_attention(*args)

        def __getattr__(self, name):
            return getattr(library, name)

    def no_gather(*args):
        raise AssertionError("the kernel path dequantized a copy of the cache")

    monkeypatch.setattr(cpu_build, "load_library", lambda: Spy())
    monkeypatch.setattr(kv_quant, "gather_dequantized", no_gather)
    return calls


STEP = {"query_lens": [1, 7, 1, 37, 1], "context_lens": [50, 0, 3, 60, 130]}


# Block sizes and GQA ratios (H_q / H_kv: 1, 4, 6) vary together to keep the grid small.
SHAPES = [(16, 4, 4), (32, 8, 2), (64, 6, 1)]


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "heads", "kv_heads"), SHAPES)
def test_sdpa_reads_a_quantized_cache(kv_dtype, query_dtype, block_size, heads, kv_heads):
    step = quantized_step(
        kv_dtype, query_dtype, **STEP, heads=heads, kv_heads=kv_heads, block_size=block_size
    )
    check_against_reference(SdpaAttentionBackend(), step)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "heads", "kv_heads"), SHAPES)
def test_the_kernel_reads_a_quantized_cache_in_place(
    kv_dtype, query_dtype, block_size, heads, kv_heads, kernel_calls
):
    step = quantized_step(
        kv_dtype, query_dtype, **STEP, heads=heads, kv_heads=kv_heads, block_size=block_size
    )
    check_against_reference(KernelOnly(), step)
    assert len(kernel_calls) == 1 and kernel_calls[0][-1] == QUANTIZED_KV_KINDS[kv_dtype]


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize(("dim", "window"), [(64, None), (128, 9), (80, 9)])
def test_head_sizes_windows_and_the_default_routing(kv_dtype, dim, window):
    """The default CPU backend: decodes and short sequences on the kernel, long chunks on
    SDPA, in one step; head sizes the kernel specializes (64, 128) and one it does not."""
    step = quantized_step(kv_dtype, torch.float32, [1, 5, 100], [40, 2, 30], 4, 2, 16, dim=dim)
    plan = CpuAttentionBackend().prepare(step[1])
    assert plan.kernel is not None and plan.sdpa_groups
    check_against_reference(CpuAttentionBackend(), step, window)


def test_the_kernel_decodes_every_fp8_value(kernel_calls) -> None:
    """Every finite e4m3 bit pattern, as a value element (scale 1), reads as torch reads it:
    one-token sequences attend to their own token only, so the output is its value."""
    bits = torch.arange(256, dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # S.1111.111 is NaN
    dim = 8
    cache = bits.view(torch.float8_e4m3fn).view(-1, 1, 1, dim)  # [32 blocks, 1 slot, 1, 8]
    num_seqs = cache.shape[0]
    scales = torch.ones(num_seqs, 1, 1)
    metadata = AttentionMetadata.build(
        query_lens=[1] * num_seqs,
        context_lens=[0] * num_seqs,
        block_tables=[[b] for b in range(num_seqs)],
        block_size=1,
    )
    query = torch.zeros(num_seqs, 1, dim)
    backend = CpuAttentionBackend()
    out = backend.forward(
        query,
        cache,
        cache,
        backend.prepare(metadata),
        scale=1.0,
        key_scales=scales,
        value_scales=scales,
    )
    assert len(kernel_calls) == 1
    assert torch.equal(out.view(-1), cache.float().view(-1))


def test_missing_or_mismatched_scales_run_sdpa(monkeypatch):
    """Without usable scales the kernel is not asked (SDPA then raises or dequantizes)."""
    step = quantized_step(torch.int8, torch.float32, [1], [10], 2, 1, 16)
    cache, _, query, _ = step
    key_cache, value_cache = cache.layer(0)
    key_scales, value_scales = cache.layer_scales(0)
    assert CpuAttentionBackend._runs_kernel(
        query, key_cache, value_cache, (key_scales, value_scales)
    )
    assert not CpuAttentionBackend._runs_kernel(query, key_cache, value_cache, (None, None))
    assert not CpuAttentionBackend._runs_kernel(
        query, key_cache, value_cache, (key_scales.double(), value_scales)
    )
    assert not CpuAttentionBackend._runs_kernel(
        query, key_cache.float(), value_cache.float(), (key_scales, value_scales)
    )


# -- the C store (cpu_attention.store_quantized) -------------------------------------------


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_c_store_writes_the_reference_bits(kv_dtype, x_dtype):
    generator = torch.Generator().manual_seed(4)
    # Magnitudes over 12 decades, zero vectors, and a dense sweep of [-1, 1] x absmax that
    # crosses every rounding boundary of both formats (fp8 subnormals included).
    x = torch.randn(200, 2, 64, generator=generator) * torch.logspace(-6, 6, 200)[:, None, None]
    x[3] = 0
    sweep = torch.linspace(-1, 1, 120 * 63).view(120, 1, 63).expand(120, 2, 63)
    x = torch.cat([x, torch.cat([torch.ones(120, 2, 1), sweep], -1)]).to(x_dtype)
    slots = torch.randperm(400, generator=generator)[: x.shape[0]]
    caches = [torch.zeros(25, 16, 2, 64, dtype=kv_dtype) for _ in range(2)]
    scales = [torch.zeros(25, 16, 2) for _ in range(2)]
    assert store_quantized(
        caches[0], scales[0], x.transpose(0, 1).contiguous().transpose(0, 1), slots
    )
    kv_quant.store_kv(caches[1], scales[1], x, slots)
    assert torch.equal(scales[0], scales[1])
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))


def test_the_c_store_declines_what_it_does_not_handle():
    cache, scales = torch.zeros(2, 4, 1, 8, dtype=torch.int8), torch.zeros(2, 4, 1)
    slots = torch.tensor([1])
    assert not store_quantized(cache, scales, torch.ones(1, 1, 8, dtype=torch.float16), slots)
    assert not store_quantized(cache, scales, torch.ones(1, 1, 8), slots.int())
    assert not store_quantized(cache.float(), scales, torch.ones(1, 1, 8), slots)
    assert not cache.any() and not scales.any()
