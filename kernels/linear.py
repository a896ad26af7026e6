"""Dense linear layers over weights packed once for the CPU's matmul library (oneDNN).

`F.linear` on CPU multiplies by the plain [out, in] weight on every call. Reordering the
weight once, at load, into oneDNN's blocked layout ("prepacking", what torch.compile's
CPU weight freezing does) makes the same multiply ~1.3-1.6x faster on the skinny inputs
of a decode step (measured: bf16 and fp32, batch 1 and 32, AVX512 machine), with results
identical in bf16 and equal up to summation order in fp32. `F.linear` is the reference and
the fallback wherever packing is unavailable (GPU, fp16, builds without oneDNN).
`FastLinear` is the layer built on them, or on textgate's own kernel (kernels/dense_linear.py)
where that serves; quantization loaders and model layers both use it.

oneDNN builds (JIT-compiles) a kernel for every row count it is asked to multiply, and
caches it (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, 1024 by default): measured on a 2-core
AVX512/AMX Xeon in bf16, the first call at a new row count took 0.4 ms (3 rows) to 3-6 ms
(300-1300 rows) against 0.02-1.4 ms once cached, 10-40x. A served step's rows are its
decodes plus its prompt tokens, a different count nearly every mixed step, so a burst of
prompts paid that on most of its layers' calls, and a server that has seen more distinct
counts than the cache holds keeps paying it. So `packed_linear` pads the rows up to
`padded_rows` (exact up to EXACT_ROWS, then eight counts per doubling: at most 1/8 more
rows, about 90 counts up to 4096) and drops the padding's rows after: the results of the
real rows are the same rows of a product over more rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from textgate.kernels.dense_linear import (
    PackedDense,
    dense_linear,
    pack_dense,
    serves,
    unpack_dense,
)


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


EXACT_ROWS = 32
"""Row counts up to this are multiplied as they are (decode batches: few counts, each
seen every step)."""


def padded_rows(rows: int) -> int:
    """The row count `packed_linear` multiplies for `rows` rows: `rows` up to EXACT_ROWS,
    else `rows` rounded up to a multiple of 2^(bits - 4), eight counts per doubling."""
    if rows <= EXACT_ROWS:
        return rows
    grid = 1 << (rows.bit_length() - 4)
    return -(-rows // grid) * grid


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T + bias` for x [..., in_features] and `packed = prepack(weight)`, its
    rows padded to `padded_rows` for the matmul (the module docstring says why)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = padded_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [None], "")
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def reference_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The pure-PyTorch reference of `packed_linear`."""
    return F.linear(x, weight, bias)


class FastLinear(nn.Module):
    """`x @ weight.T + bias` for a loaded weight [out_features, in_features].

    Unlike `nn.Linear` it neither allocates nor initialises a weight of its own,
    and its parameters never require grad (inference only). On CPU the weight is packed once
    and the plain copy dropped: for textgate's own kernel where it serves the dtype
    (kernels/dense_linear.py, `serves`), else for oneDNN (`prepack`).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.kernel_packed: PackedDense | None = (
            pack_dense(weight, bias) if serves(weight.dtype) else None
        )
        """The weight for cpu_dense.c, or None (then `packed` or `dense` holds it)."""
        self.packed = None if self.kernel_packed is not None else prepack(weight)
        self.dense = (
            None
            if self.kernel_packed is not None or self.packed is not None
            else nn.Parameter(weight, requires_grad=False)
        )
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def weight(self) -> Tensor:
        """The weight [out_features, in_features] (an unpacked copy when it is packed)."""
        if self.dense is not None:
            return self.dense
        if self.kernel_packed is not None:
            return unpack_dense(self.kernel_packed)
        assert self.packed is not None
        return self.packed.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel_packed is not None:
            return dense_linear(x, self.kernel_packed)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.dense, self.bias)
