"""Packed oneDNN linears against `F.linear`."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels.linear import can_prepack, packed_linear, prepack, reference_linear

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
