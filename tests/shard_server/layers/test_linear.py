"""FastLinear: same result packed or not; the plain weight stays readable."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels.linear import can_prepack
from textgate.shard_server.layers.linear import FastLinear


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
