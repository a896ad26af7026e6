"""kernels/kv_quant.py: the quantized KV layout's reference ops."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels import kv_quant

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
