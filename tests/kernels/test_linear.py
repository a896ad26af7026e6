"""Packed oneDNN linears against `F.linear`; FastLinear the same packed or not."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels.linear import (
    FastLinear,
    can_prepack,
    packed_linear,
    prepack,
    reference_linear,
)

needs_packing = pytest.mark.skipif(
    not can_prepack(torch.zeros(2, 2)), reason="oneDNN packing unavailable in this build"
)


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_reference(dtype, rows, bias):
    if not can_prepack(torch.zeros(2, 2, dtype=dtype)):
        pytest.skip(f"{dtype} packing unsupported on this CPU")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(24, 40, generator=generator).to(dtype)
    b = torch.randn(24, generator=generator).to(dtype) if bias else None
    x = torch.randn(rows, 40, generator=generator).to(dtype)
    packed = prepack(weight)
    assert packed is not None
    out = packed_linear(x, packed, b)
    expected = reference_linear(x, weight, b)
    assert out.shape == expected.shape == (rows, 24)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected)
    assert torch.equal(packed.to_dense(), weight)


@needs_packing
def test_packed_takes_batched_and_strided_inputs():
    weight = torch.randn(8, 16)
    packed = prepack(weight)
    assert packed is not None
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(packed_linear(x, packed), reference_linear(x, weight))
    strided = torch.randn(4, 32)[:, ::2]
    torch.testing.assert_close(packed_linear(strided, packed), reference_linear(strided, weight))


def test_what_is_not_packed():
    assert prepack(torch.zeros(4, 4, dtype=torch.float16)) is None
    assert prepack(torch.zeros(4)) is None
    assert prepack(torch.zeros(4, 4, requires_grad=True)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_linear_computes_x_wt_plus_b(dtype):
    weight, bias = torch.randn(6, 4).to(dtype), torch.randn(6).to(dtype)
    linear = FastLinear(weight.clone(), bias)
    x = torch.randn(3, 4).to(dtype)
    expected = (x.float() @ weight.float().T + bias.float()).to(dtype)
    torch.testing.assert_close(linear(x), expected, atol=2e-2, rtol=2e-2)
    assert (linear.packed is not None) == can_prepack(weight)
    # Packed: only the packed copy is held; `weight` unpacks one.
    assert (linear.dense is None) == (linear.packed is not None)
    assert torch.equal(linear.weight, weight)
    assert not linear.weight.requires_grad
