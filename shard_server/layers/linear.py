"""A linear layer over tensors that are already loaded."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from textgate.kernels.linear import packed_linear, prepack


class FastLinear(nn.Module):
    """`x @ weight.T + bias` for a loaded weight [out_features, in_features].

    Unlike `nn.Linear` it neither allocates nor initialises a weight of its own,
    and its parameters never require grad (inference only). On CPU the weight is
    packed once for oneDNN (`textgate.kernels.linear`) and the plain copy dropped.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.packed = prepack(weight)
        self.dense = None if self.packed is not None else nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> Tensor:
        """The weight [out_features, in_features] (an unpacked copy when it is packed)."""
        if self.dense is not None:
            return self.dense
        assert self.packed is not None
        return self.packed.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.dense, self.bias)
