"""bitsandbytes' NF4/FP4 layers with a CPU kernel of ours for decode-sized inputs.

bitsandbytes quantizes the weights (`bnb.nn.Linear4bit`, 64-value blocks, each code one of
16 codebook values times its block's absmax) and its forward serves every input, but on the
CPU it dequantizes the whole weight for each call: 0.21 ms for a 576x1536 layer at one row
where the dense bf16 layer takes 0.02 ms (2-core EPYC, 2 threads, same process). For up to
`KERNEL_ROWS` rows `CodebookLinear` runs `cpu_lut4.c` on bitsandbytes' own codes instead
(sixteen codes to floats with one in-register lookup, no dequantized copy); more rows, and
anything the kernel cannot take, go to bitsandbytes' forward. The codes are shared, not
copied: the layer adds only its blocks' absmax as float32 (the checkpoint's are quantized
again, bitsandbytes' "compress statistics") and the 16-entry codebook.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from textgate.kernels.cpu_build import load_library

KERNEL_ROWS = 8
"""Rows up to which the kernel runs (the decode steps of a small batch). Measured by
`python -m textgate.bench.codebook_linear` (2-core EPYC, 2 threads, nf4 in bf16; time as
a ratio to the dense bf16 FastLinear of a cache-resident weight, in one run):

    shape      M=1          M=8          M=16
               bnb   lut4   bnb   lut4   bnb   lut4
    576x1536   5.29  1.34   4.09  2.22   3.96  2.88
    1536x576   6.25  1.27   4.63  2.02   3.64  4.95

A whole model reads its weights from memory, where 4-bit codes move a quarter of bf16's
bytes: the nf4 model's decode step at batch 1 is 1.08x faster than the bf16 one
(`python -m textgate.bench.step --dtype bfloat16 --batch 1`, 8.71 vs 9.39 ms)."""


class CodebookLinear(nn.Module):
    """`bnb.nn.Linear4bit` with decode-sized inputs computed by `cpu_lut4.c`."""

    def __init__(self, linear: nn.Module, absmax: Tensor) -> None:
        super().__init__()
        self.linear = linear
        state = linear.weight.quant_state
        self.register_buffer("absmax", absmax)  # float32, one per block of codes
        self.register_buffer("codebook", state.code.to(torch.float32).contiguous())
        self.block = int(state.blocksize)
        self.out_features, self.in_features = (int(d) for d in state.shape)

    @classmethod
    def wrap(cls, linear: nn.Module) -> CodebookLinear | None:
        """The wrapped layer where the kernel can serve it (CPU, kernels built, a 16-value
        codebook, blocks within rows), else None."""
        weight = linear.weight
        state = getattr(weight, "quant_state", None)
        library = load_library()
        if state is None or weight.device.type != "cpu" or library is None:
            return None
        out_features, in_features = (int(d) for d in state.shape)
        block = int(state.blocksize)
        if (
            not library.textgate_lut4_available()
            or state.code is None
            or state.code.numel() != 16
            or block % 32
            or in_features % block
        ):
            return None
        return cls(linear, block_absmax(state).reshape(out_features, in_features // block))

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] > KERNEL_ROWS or x.dtype not in (torch.float32, torch.bfloat16):
            return self.linear(x)
        # Inputs in float32: a bf16 row would be widened again for every output.
        x2d = x2d.to(torch.float32).contiguous()
        out = torch.empty(x2d.shape[0], self.out_features, dtype=torch.float32)
        bias = self.linear.bias
        bias32 = None if bias is None else bias.to(torch.float32).contiguous()
        library = load_library()
        assert library is not None  # wrap() checked
        library.textgate_lut4_linear(
            x2d.data_ptr(),
            x2d.shape[0],
            self.in_features,
            0,
            self.linear.weight.data.data_ptr(),
            self.absmax.data_ptr(),
            self.block,
            self.codebook.data_ptr(),
            None if bias32 is None else bias32.data_ptr(),
            out.data_ptr(),
            self.out_features,
            0,
        )
        return out.to(x.dtype).reshape(*lead, self.out_features)


def block_absmax(state: Any) -> Tensor:
    """Each block's absmax as float32, undoing bitsandbytes' nested quantization of them."""
    if not state.nested:
        return state.absmax.to(torch.float32).contiguous()
    import bitsandbytes.functional as bnb_functional

    absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return absmax.to(torch.float32).contiguous()


def reference_codebook_weight(
    codes: Tensor, absmax: Tensor, codebook: Tensor, shape: Any
) -> Tensor:
    """The float32 weight [out, in] the kernel multiplies by: codes two per byte, high
    nibble first, each codebook[code] times its block's absmax."""
    flat = codes.reshape(-1)
    pairs = torch.stack([(flat >> 4).long(), (flat & 15).long()], dim=1).reshape(-1)
    blocks = codebook[pairs].reshape(absmax.numel(), -1) * absmax.reshape(-1, 1)
    return blocks.reshape(*shape)
