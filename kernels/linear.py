"""Dense linear layers over weights packed once for the CPU's matmul library (oneDNN).

`F.linear` on CPU multiplies by the plain [out, in] weight on every call. Reordering the
weight once, at load, into oneDNN's blocked layout ("prepacking", what torch.compile's
CPU weight freezing does) makes the same multiply ~1.3-1.6x faster on the skinny inputs
of a decode step (measured: bf16 and fp32, batch 1 and 32, AVX512 machine), with results
identical in bf16 and equal up to summation order in fp32. `F.linear` is the reference and
the fallback wherever packing is unavailable (GPU, fp16, builds without oneDNN).
`FastLinear` is the layer built on them; quantization loaders and model layers both use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def can_prepack(weight: Tensor) -> bool:
    """Whether `prepack` would pack this weight [out_features, in_features]."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.requires_grad:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def prepack(weight: Tensor) -> Tensor | None:
    """The weight in oneDNN's layout for `packed_linear`, or None where it cannot be packed.

    The packed tensor is a copy: callers that keep no other use of `weight` should drop it.
    """
    if not can_prepack(weight):
        return None
    # No batch-size hint: the layout then suits every row count (decode and prefill).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T + bias` for x [..., in_features] and `packed = prepack(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


def reference_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The pure-PyTorch reference of `packed_linear`."""
    return F.linear(x, weight, bias)


class FastLinear(nn.Module):
    """`x @ weight.T + bias` for a loaded weight [out_features, in_features].

    Unlike `nn.Linear` it neither allocates nor initialises a weight of its own,
    and its parameters never require grad (inference only). On CPU the weight is
    packed once for oneDNN (`prepack`) and the plain copy dropped.
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
