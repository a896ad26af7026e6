"""A linear layer over tensors that are already loaded."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class FastLinear(nn.Module):
    """`x @ weight.T + bias` for a loaded weight [out_features, in_features].

    Unlike `nn.Linear` it neither allocates nor initialises a weight of its own,
    and its parameters never require grad (inference only).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)
