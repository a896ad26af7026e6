"""`--quantize int8`: per-output-channel int8 weights made at load from a floating-point
checkpoint, multiplied with per-token dynamic int8 activations (W8A8), SmoothQuant-smoothed.

Every linear layer becomes a `kernels.int8_linear.Int8Linear`, and so does the lm head
(the largest matmul of a small model: 576 x 49152 on the default one). The layers are
built in float first (`smooth.ObservedLinear`); once the model is assembled, `finish` runs
the shipped calibration text through it and quantizes each layer with smoothing factors
from the activation maxima it saw (quantization/smooth.py: +3.3% perplexity against fp32
without them, +0.8% with). On CPU the layer runs the int8 units (VNNI); elsewhere its
PyTorch reference (see kernels/int8_linear.py). Weights take 1 byte per value plus a few
float32 numbers per channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor, nn

from textgate.quantization.base import Weight
from textgate.quantization.from_float import FromFloatWeightsLoader
from textgate.quantization.registry import register
from textgate.quantization.smooth import ALPHA, ObservedLinear, alpha_for, smooth_and_quantize

if TYPE_CHECKING:
    from textgate.quantization.weights import Shard, Weights


@dataclass
class Int8Weight(Weight):
    """A float weight [out, in]; its layer observes activations, then `finish` quantizes it."""

    weight: Tensor
    alpha: float = ALPHA  # SmoothQuant's migration strength for this layer

    def get_linear(self, bias: Tensor | None) -> nn.Module:
        return ObservedLinear(self.weight, bias, self.alpha)


@register("int8")
class Int8WeightsLoader(FromFloatWeightsLoader):
    """W8A8 linears, lm head included, from a floating-point checkpoint."""

    quantize_head = True

    def make_weight(self, weight: Tensor) -> Weight:
        return Int8Weight(weight)

    def get_weights_row(self, weights: Weights, prefix: str, shard: Shard | None = None) -> Weight:
        weight = super().get_weights_row(weights, prefix, shard)
        assert isinstance(weight, Int8Weight)
        weight.alpha = alpha_for(prefix)
        return weight

    def finish(self, model: nn.Module, model_dir: Path) -> None:
        smooth_and_quantize(model, model_dir)
