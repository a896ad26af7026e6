"""RMSNorm with the residual add fused in front of it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from textgate.kernels import cpu_layers
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
        self._eps = torch.tensor(eps, dtype=torch.float32, device=weight.device)

    @classmethod
    def load(cls, weights: Weights, prefix: str, eps: float, offset: float = 0.0) -> RMSNorm:
        """The norm whose scale is `<prefix>.weight` plus `offset` (replicated on every rank).

        Gemma scales by (1 + w): the 1 is folded in here, in float32, once.
        """
        if not offset:
            return cls(weights.get_tensor(f"{prefix}.weight"), eps)
        weight = weights.get_tensor(f"{prefix}.weight", to_dtype=False).float() + offset
        return cls(weight.to(weights.dtype), eps)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Return (normed, residual) where residual = x + residual (or x alone)."""
        fused = cpu_layers.add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        # The reference (and the path off the CPU).
        if residual is not None:
            x = x + residual
        # Few kernels per norm (a decode step runs ~60): the float32 sum of squares comes
        # from one reduction over x, and x * rsqrt(mean + eps) is computed in float32 and
        # rounded once into x's dtype, as the reference's `.to(x.dtype)` does.
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # [T, 1]
        inv_rms = torch.addcmul(self._eps, norm, norm, value=1 / x.shape[-1]).rsqrt_()
        normed = torch.mul(x, inv_rms, out=torch.empty_like(x))
        return normed.mul_(self.weight), x
