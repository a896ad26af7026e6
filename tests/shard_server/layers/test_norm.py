from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from textgate.shard_server.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers(dtype):
    torch.manual_seed(0)
    weight = torch.randn(16)
    x = (torch.randn(5, 16) * 3).to(dtype)
    reference = LlamaRMSNorm(16, eps=1e-5).to(dtype)
    reference.weight.data.copy_(weight)
    normed, residual = RMSNorm(weight.to(dtype), 1e-5)(x)
    # bf16: bit-identical. fp32: within an ulp (the sum of squares comes from a norm).
    exact = dtype == torch.bfloat16
    tol = 0.0 if exact else 1e-6
    torch.testing.assert_close(normed, reference(x), atol=tol, rtol=tol)
    assert residual is x


def test_adds_the_residual_first():
    torch.manual_seed(0)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    norm = RMSNorm(torch.rand(8), 1e-6)
    normed, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, norm(x + residual)[0])
