"""The fused CPU layer ops against the PyTorch references they stand in for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from textgate.kernels import AttentionMetadata, cpu_build
from textgate.kernels.cpu_layers import add_rms_norm, rotary_and_store, silu_and_mul
from textgate.shard_server.layers.norm import RMSNorm
from textgate.shard_server.layers.rotary import apply_rotary_signed, signed_sin
from textgate.shard_server.step.kv_cache import KVCache

DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(out: torch.Tensor, expected: torch.Tensor, exact_share: float) -> None:
    """fp32: equal up to summation order; bf16: the same roundings, so nearly all equal."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=1e-2)
    assert (out == expected).float().mean() >= exact_share


def reference_norm(norm: RMSNorm, x, residual, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(cpu_build, "load_library", lambda: None)
        return norm(x, residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_rms_norm(dtype, with_residual, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(37, 96, generator=generator)).to(dtype)
    residual = torch.randn(37, 96, generator=generator).to(dtype) if with_residual else None
    norm = RMSNorm(torch.rand(96, generator=generator).to(dtype) + 0.5, 1e-5)
    fused = add_rms_norm(x, residual, norm.weight, norm.eps)
    assert fused is not None
    expected = reference_norm(norm, x, residual, monkeypatch)
    assert_matches(fused[1], expected[1], exact_share=1.0)  # x + residual: one rounding
    assert_matches(fused[0], expected[0], exact_share=0.98)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_silu_times_up(dtype):
    gate_up = (4 * torch.randn(19, 2 * 80, generator=torch.Generator().manual_seed(1))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = silu_and_mul(gate_up)
    assert out is not None
    assert_matches(out, F.silu(gate) * up, exact_share=0.99)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (9, 3, 64), (2, 2, 128)])
def test_rotary_and_store_matches_rotary_then_cache_store(dtype, heads, kv_heads, dim):
    generator = torch.Generator().manual_seed(2)
    tokens, block_size = 11, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=generator) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = signed_sin(torch.cat([angles.sin(), angles.sin()], -1).to(dtype))
    metadata = AttentionMetadata.build(
        query_lens=[7, 4], context_lens=[2, 5], block_tables=[[3, 1, 6], [0, 5, 2]], block_size=4
    )

    def new_cache() -> KVCache:
        return KVCache.allocate(
            num_layers=1, num_blocks=8, block_size=block_size, num_kv_heads=kv_heads,
            head_dim=dim, dtype=dtype,
        )  # fmt: skip

    fused_cache, reference_cache = new_cache(), new_cache()
    query = rotary_and_store(
        qkv, cos, sin, *fused_cache.layer(0), metadata.slot_mapping, heads, kv_heads
    )
    assert query is not None
    query_key, value = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], -1)
    rotated = apply_rotary_signed(query_key.view(tokens, heads + kv_heads, dim), cos, sin)
    expected_query, key = rotated.split([heads, kv_heads], dim=1)
    reference_cache.store(0, key, value.view(tokens, kv_heads, dim), metadata.slot_mapping)
    assert query.shape == (tokens, heads, dim) and query.is_contiguous()
    assert_matches(query, expected_query, exact_share=1.0)
    for fused, expected in zip(fused_cache.layer(0), reference_cache.layer(0), strict=True):
        assert_matches(fused, expected, exact_share=1.0)  # untouched slots stay zero too


def test_they_decline_what_they_cannot_take():
    half = torch.randn(4, 8, dtype=torch.float16)
    assert silu_and_mul(half) is None
    assert add_rms_norm(half, None, torch.ones(8, dtype=torch.float16), 1e-5) is None
    strided = torch.randn(8, 4).t()
    assert silu_and_mul(strided) is None
    mixed = add_rms_norm(torch.randn(4, 8), None, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    assert mixed is None


def test_without_the_library_they_decline(monkeypatch):
    monkeypatch.setattr(cpu_build, "load_library", lambda: None)
    assert silu_and_mul(torch.randn(4, 8)) is None
