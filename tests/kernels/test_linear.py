"""Packed oneDNN linears against `F.linear`; FastLinear the same packed or not."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels.dense_linear import can_pack_dense
from textgate.kernels.linear import (
    EXACT_ROWS,
    FastLinear,
    can_prepack,
    packed_linear,
    padded_rows,
    prepack,
    reference_linear,
)

needs_packing = pytest.mark.skipif(
    not can_prepack(torch.zeros(2, 2)), reason="oneDNN packing unavailable in this build"
)


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 33, 161])
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


def test_row_counts_past_the_exact_ones_round_up_to_eight_per_doubling():
    assert [padded_rows(n) for n in (0, 1, 17, EXACT_ROWS)] == [0, 1, 17, EXACT_ROWS]
    assert [padded_rows(n) for n in (33, 36, 37, 64, 65, 161, 256, 257, 1281)] == [
        36, 36, 40, 64, 72, 176, 256, 288, 1408
    ]  # fmt: skip
    counts = {padded_rows(n) for n in range(1, 4097)}
    assert len(counts) <= EXACT_ROWS + 8 * 7  # few kernels for oneDNN to build and keep
    for n in range(1, 4097):
        assert n <= padded_rows(n) <= n * 9 / 8


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_give_each_real_row_what_it_gets_alone(dtype):
    """The padding's rows are dropped, and a real row is the same whatever pads it: a
    161-row product (multiplied as 176) equals its rows multiplied at a count that needs no
    padding (160 and 1, exact), up to summation order (oneDNN may block another count
    differently)."""
    if not can_prepack(torch.zeros(2, 2, dtype=dtype)):
        pytest.skip(f"{dtype} packing unsupported on this CPU")
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(48, 64, generator=generator).to(dtype)
    x = torch.randn(3, 161, 64, generator=generator).to(dtype)[1]
    packed = prepack(weight)
    out = packed_linear(x, packed)
    assert out.shape == (161, 48) and out.is_contiguous()
    parts = torch.cat([packed_linear(x[:160], packed), packed_linear(x[160:], packed)])
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out, parts, rtol=1.6e-2, atol=1e-2)
    else:
        torch.testing.assert_close(out, parts, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, reference_linear(x, weight), rtol=2e-2, atol=2e-2)


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
    # One copy is held: for textgate's kernel where it runs, else for oneDNN, else plain;
    # `weight` unpacks a packed one.
    assert (linear.kernel_packed is not None) == can_pack_dense(weight)
    if linear.kernel_packed is None:
        assert (linear.packed is not None) == can_prepack(weight)
    held = (linear.kernel_packed, linear.packed, linear.dense)
    assert sum(copy is not None for copy in held) == 1
    assert torch.equal(linear.weight, weight)
    assert not linear.weight.requires_grad
