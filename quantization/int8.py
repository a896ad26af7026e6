"""`--quantize int8`: per-output-channel int8 weights made at load from a floating-point
checkpoint, multiplied with per-token dynamic int8 activations (W8A8).

Every linear layer becomes a `kernels.int8_linear.Int8Linear`, and so does the lm head
(the largest matmul of a small model: 576 x 49152 on the default one). On CPU the layer
runs the int8 units (VNNI); elsewhere its PyTorch reference (see kernels/int8_linear.py).
Weights take 1 byte per value plus one float32 scale per output channel.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from textgate.kernels.int8_linear import Int8Linear, quantize_weight
from textgate.quantization.base import Weight
from textgate.quantization.from_float import FromFloatWeightsLoader
from textgate.quantization.registry import register


@dataclass
class Int8Weight(Weight):
    """A float weight [out, in], quantized per output channel when its layer is built."""

    weight: Tensor

    def get_linear(self, bias: Tensor | None) -> nn.Module:
        qweight, scales = quantize_weight(self.weight)
        return Int8Linear(qweight, scales, bias)


@register("int8")
class Int8WeightsLoader(FromFloatWeightsLoader):
    """W8A8 linears, lm head included, from a floating-point checkpoint."""

    quantize_head = True

    def make_weight(self, weight: Tensor) -> Weight:
        return Int8Weight(weight)
