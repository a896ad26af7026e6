"""Loaders that quantize floating-point checkpoints at load (int8, bitsandbytes).

They read and shard tensors exactly as the unquantized loader does; only the layer a
weight becomes differs. A subclass says what by `make_weight`, and whether the lm head is
quantized too by `quantize_head`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from textgate.quantization.base import Weight, WeightsLoader
from textgate.quantization.unquantized import UnquantizedWeight, UnquantizedWeightsLoader

if TYPE_CHECKING:
    from textgate.quantization.weights import Shard, Weights


class FromFloatWeightsLoader(WeightsLoader):
    """Reads `<prefix>.weight` like `UnquantizedWeightsLoader`; `make_weight` quantizes it."""

    reads_float_checkpoint = True
    #: Whether the lm head is quantized as well (else it stays in the model's dtype).
    quantize_head = False

    def __init__(self) -> None:
        self._dense = UnquantizedWeightsLoader()

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any]) -> WeightsLoader:
        if quantization_config:
            method = quantization_config.get("quant_method", "?")
            raise ValueError(
                f"this checkpoint is already quantized (quant_method {method!r}); quantizing "
                "at load needs floating-point weights"
            )
        return cls()

    @abstractmethod
    def make_weight(self, weight: Tensor) -> Weight:
        """The quantized form of a float weight [out_features, in_features] (this rank's)."""

    def _quantized(self, dense: Weight) -> Weight:
        assert isinstance(dense, UnquantizedWeight)
        return self.make_weight(dense.weight)

    def get_weights(self, weights: Weights, prefix: str) -> Weight:
        return self._quantized(self._dense.get_weights(weights, prefix))

    def get_weights_col(self, weights: Weights, prefix: str, shard: Shard | None = None) -> Weight:
        return self._quantized(self._dense.get_weights_col(weights, prefix, shard))

    def get_multi_weights_col(
        self,
        weights: Weights,
        prefixes: Sequence[str],
        dim: int,
        shards: Sequence[Shard] | None = None,
    ) -> Weight:
        return self._quantized(self._dense.get_multi_weights_col(weights, prefixes, dim, shards))

    def get_weights_row(self, weights: Weights, prefix: str, shard: Shard | None = None) -> Weight:
        return self._quantized(self._dense.get_weights_row(weights, prefix, shard))

    def get_head(self, weight: Tensor) -> Weight:
        return self.make_weight(weight) if self.quantize_head else super().get_head(weight)
