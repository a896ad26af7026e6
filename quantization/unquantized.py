"""Plain floating-point checkpoints: `<prefix>.weight` becomes a `FastLinear`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from textgate.kernels.linear import FastLinear
from textgate.quantization.base import Weight, WeightsLoader
from textgate.quantization.registry import UNQUANTIZED, register

if TYPE_CHECKING:
    from textgate.quantization.weights import Shard, Weights


@dataclass
class UnquantizedWeight(Weight):
    """A dense weight [out_features, in_features] in the model's dtype."""

    weight: Tensor

    def get_linear(self, bias: Tensor | None) -> nn.Module:
        return FastLinear(self.weight, bias)


@register(UNQUANTIZED)
class UnquantizedWeightsLoader(WeightsLoader):
    """Reads `<prefix>.weight` and slices it for this rank."""

    reads_float_checkpoint = True

    def get_weights(self, weights: Weights, prefix: str) -> Weight:
        return UnquantizedWeight(weights.get_tensor(f"{prefix}.weight"))

    def get_weights_col(self, weights: Weights, prefix: str, shard: Shard | None = None) -> Weight:
        return UnquantizedWeight(weights.get_sharded(f"{prefix}.weight", 0, shard))

    def get_multi_weights_col(
        self,
        weights: Weights,
        prefixes: Sequence[str],
        dim: int,
        shards: Sequence[Shard] | None = None,
    ) -> Weight:
        per_prefix = shards if shards is not None else [None] * len(prefixes)
        if len(per_prefix) != len(prefixes):
            raise ValueError(f"{len(prefixes)} prefixes but {len(per_prefix)} shards")
        parts = [
            weights.get_sharded(f"{prefix}.weight", 0, shard)
            for prefix, shard in zip(prefixes, per_prefix, strict=True)
        ]
        return UnquantizedWeight(torch.cat(parts, dim=dim))

    def get_weights_row(self, weights: Weights, prefix: str, shard: Shard | None = None) -> Weight:
        return UnquantizedWeight(weights.get_sharded(f"{prefix}.weight", 1, shard))
