"""The fused Triton layer ops against their PyTorch references (and the model layers' own).

Runs on CUDA (`-m gpu`) or on CPU tensors in triton's interpreter (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from textgate.kernels.triton import layers
from textgate.shard_server.layers.norm import RMSNorm
from textgate.shard_server.layers.rotary import apply_rotary, signed_sin
from textgate.shard_server.step.kv_cache import KVCache

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One rounding of the result apart (the reference rounds intermediate products too).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def device(triton_device, monkeypatch):
    """The device, with the ops enabled on it (CUDA only by default)."""
    monkeypatch.setattr(layers, "enabled_devices", ("cuda", "cpu"))
    return triton_device


def randn(*shape, dtype, device, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_model_norm(device, dtype, with_residual):
    x = randn(5, 96, dtype=dtype, device=device)  # hidden 96: a partial block of 128
    residual = randn(5, 96, dtype=dtype, device=device, seed=1) if with_residual else None
    weight = randn(96, dtype=dtype, device=device, seed=2)
    normed, total = layers.add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_total = layers.reference_add_rms_norm(x, residual, weight, 1e-6)
    assert_close(normed, ref_normed, dtype)
    assert_close(total, ref_total, dtype)
    if dtype != torch.float16:  # the model's norm (on the CPU: fp32/bf16 run its C kernel)
        model_normed, _ = RMSNorm(weight.cpu(), 1e-6)(
            x.cpu(), None if residual is None else residual.cpu()
        )
        assert_close(normed, model_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_a_strided_view_in_place(device, dtype):
    tokens, heads, dim = 4, 5, 16
    qkv = randn(tokens, (heads + 2) * dim, dtype=dtype, device=device)
    before = qkv.clone()
    angles = torch.arange(tokens)[:, None] * torch.rand(dim // 2)[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype).to(device)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype).to(device)
    query_key = qkv.view(tokens, heads + 2, dim)[:, :heads]  # the last two heads stay
    assert layers.rotary(query_key, cos, signed_sin(sin))
    expected = apply_rotary(before.view(tokens, heads + 2, dim)[:, :heads], cos, sin)
    assert_close(query_key, expected, dtype)
    assert torch.equal(
        qkv.view(tokens, heads + 2, dim)[:, heads:], before.view(tokens, heads + 2, dim)[:, heads:]
    )
    assert_close(
        layers.reference_rotary(
            before.view(tokens, heads + 2, dim)[:, :heads], cos, signed_sin(sin)
        ),
        expected,
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(device, dtype):
    gate_up = randn(3, 2 * 40, dtype=dtype, device=device)
    out = layers.silu_and_mul(gate_up)
    assert out.shape == (3, 40)
    assert_close(out, layers.reference_silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize(
    ("dtype", "block_size"), [(torch.float32, 16), (torch.bfloat16, 32), (torch.float16, 64)]
)
def test_store_kv_writes_the_slots_kv_cache_store_writes(device, dtype, block_size):
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=4,
        block_size=block_size,
        num_kv_heads=3,
        head_dim=8,
        dtype=dtype,
        device=device,
    )
    expected = KVCache.allocate(
        num_layers=1,
        num_blocks=4,
        block_size=block_size,
        num_kv_heads=3,
        head_dim=8,
        dtype=dtype,
        device=device,
    )
    qkv = randn(6, 9 * 8, dtype=dtype, device=device).view(6, 9, 8)
    key, value = qkv[:, 3:6], qkv[:, 6:]  # strided views, as in the model
    slots = torch.tensor(
        [0, 5, 2 * block_size - 1, 3 * block_size + 7, 2 * block_size, 1], device=device
    )
    assert layers.store_kv(key, value, *cache.layer(0), slots)
    expected.store(0, key, value, slots)
    assert torch.equal(cache.key_caches[0], expected.key_caches[0])
    assert torch.equal(cache.value_caches[0], expected.value_caches[0])
    # A negative slot (padding) is skipped, like the reference's.
    reference = [c.clone() for c in expected.layer(0)]
    skip = torch.tensor([-1, 2, -1, 4, 6, 8], device=device)
    assert layers.store_kv(key, value, *expected.layer(0), skip)
    layers.reference_store_kv(key, value, *reference, skip)
    assert torch.equal(expected.key_caches[0], reference[0])
    assert torch.equal(expected.value_caches[0], reference[1])


def test_ops_decline_what_they_do_not_handle(triton_device, monkeypatch):
    x = torch.randn(2, 8)
    weight = torch.ones(8)
    # Off the enabled devices (the CPU by default): the caller runs the reference.
    monkeypatch.setattr(layers, "enabled_devices", ("cuda",))
    assert layers.add_rms_norm(x, None, weight, 1e-6) is None
    assert layers.silu_and_mul(x) is None
    monkeypatch.setattr(layers, "enabled_devices", ("cuda", "cpu"))
    x, weight = x.to(triton_device), weight.to(triton_device)
    assert layers.add_rms_norm(x.double(), None, weight.double(), 1e-6) is None
    assert layers.add_rms_norm(x, None, weight.half(), 1e-6) is None  # mixed dtypes
    cache = torch.zeros(2, 16, 1, 8, dtype=torch.int8, device=triton_device)  # quantized
    qkv = torch.randn(2, 3 * 8, device=triton_device)
    cos = torch.ones(2, 8, device=triton_device)
    slots = torch.tensor([0, 1], device=triton_device)
    before = qkv.clone()
    assert layers.rotary_and_store(qkv, cos, cos, cache, cache, slots, 1, 1) is None
    assert torch.equal(qkv, before)


def test_rotary_and_store_matches_the_model_reference(device):
    tokens, heads, kv_heads, dim = 3, 4, 2, 16
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device=device)
    angles = torch.arange(tokens)[:, None] * torch.rand(dim // 2)[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1).bfloat16().to(device)
    sin = signed_sin(torch.cat([angles.sin(), angles.sin()], -1).bfloat16()).to(device)
    cache = KVCache.allocate(
        num_layers=1, num_blocks=2, block_size=16, num_kv_heads=kv_heads, head_dim=dim,
        dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    slots = torch.tensor([17, 3, 4], device=device)
    heads_view = qkv.view(tokens, -1, dim)
    rotated = layers.reference_rotary(heads_view[:, : heads + kv_heads], cos, sin)
    value = heads_view[:, heads + kv_heads :].clone()
    query = layers.rotary_and_store(qkv, cos, sin, *cache.layer(0), slots, heads, kv_heads)
    assert query.shape == (tokens, heads, dim)
    assert_close(query, rotated[:, :heads], torch.bfloat16)
    flat_keys = cache.key_caches[0].view(-1, kv_heads, dim)
    assert_close(flat_keys[slots.cpu()], rotated[:, heads:], torch.bfloat16)
    assert torch.equal(cache.value_caches[0].view(-1, kv_heads, dim)[slots], value)
