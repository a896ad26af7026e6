"""RMSNorm with the residual add fused in front of it."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from textgate.quantization.weights import Weights


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x**2) + eps)`, computed in float32 like the reference.

    `forward(x, residual)` first adds the residual stream and returns the sum as the
    next residual, so a decoder layer reads as norm → block → norm → block.
    """

    def __init__(self, weight: Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    @classmethod
    def load(cls, weights: Weights, prefix: str, eps: float) -> RMSNorm:
        """The norm whose scale is `<prefix>.weight` (replicated on every rank)."""
        return cls(weights.get_tensor(f"{prefix}.weight"), eps)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Return (normed, residual) where residual = x + residual (or x alone)."""
        if residual is not None:
            x = x + residual
        # One fused kernel instead of pow/mean/add/rsqrt/mul: a decode step is ~60 norms.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype), x
