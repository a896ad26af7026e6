"""The weights-loader interface: how a linear layer's tensors are read and what they become.

Model code asks the loader for a layer's weight ("column-parallel q/k/v of layer 3") and
turns the answer into a module with `Weight.get_linear(bias)`. It never learns whether
the checkpoint is plain floating point, GPTQ, AWQ or bitsandbytes: each method is one
`WeightsLoader` subclass registered by name (see `textgate.quantization.registry`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from textgate.quantization.weights import Shard, Weights


class Weight(ABC):
    """The tensors of one linear layer as a loader read them (this rank's slice)."""

    @abstractmethod
    def get_linear(self, bias: Tensor | None) -> nn.Module:
        """Build the module computing `x @ W.T + bias` for inputs [..., in_features]."""


class WeightsLoader(ABC):
    """Reads a linear layer's tensors for one tensor-parallel rank.

    `prefix` names a layer without the tensor suffix (`model.layers.0.mlp.down_proj`);
    the loader knows which tensors sit under it (`.weight`, or `.qweight/.scales/...`).
    `shard` overrides the default even split of the sharded dimension (e.g. to keep
    attention heads whole when they do not divide evenly over the ranks).
    """

    #: True when the method reads floating-point checkpoints (plain, or quantized at
    #: load); False when it needs a checkpoint already quantized with it (GPTQ, AWQ).
    reads_float_checkpoint: ClassVar[bool] = False

    @classmethod
    def check_device(cls, device: torch.device) -> None:
        """Raise ValueError, saying why, when the method cannot run on `device`."""
        del device

    def cpu_dtype(self) -> torch.dtype | None:
        """The dtype `--dtype auto` serves this method in on a CPU, where only one keeps the
        method's fast path; None (the default): time the candidates and keep the faster."""
        return None

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any]) -> WeightsLoader:
        """Build the loader from the checkpoint's quantization config (empty if none)."""
        del quantization_config
        return cls()

    @classmethod
    def from_checkpoint(cls, path: Path, quantization_config: Mapping[str, Any]) -> WeightsLoader:
        """Build the loader for the checkpoint folder `path`: `from_config` by default;
        loaders that read files beside the folder's config (gguf) override it."""
        del path
        return cls.from_config(quantization_config)

    @abstractmethod
    def get_weights(self, weights: Weights, prefix: str) -> Weight:
        """The whole, unsharded weight (replicated on every rank)."""

    @abstractmethod
    def get_weights_col(self, weights: Weights, prefix: str, shard: Shard | None = None) -> Weight:
        """This rank's rows of the output dimension (column-parallel linear)."""

    @abstractmethod
    def get_multi_weights_col(
        self,
        weights: Weights,
        prefixes: Sequence[str],
        dim: int,
        shards: Sequence[Shard] | None = None,
    ) -> Weight:
        """Several column-parallel weights (q/k/v, gate/up) sliced and fused along `dim`.

        The fused output holds this rank's slice of prefixes[0], then of prefixes[1], …
        `shards`, when given, holds one slice per prefix.
        """

    @abstractmethod
    def get_weights_row(self, weights: Weights, prefix: str, shard: Shard | None = None) -> Weight:
        """This rank's columns of the input dimension (row-parallel linear)."""

    def get_head(self, weight: Tensor) -> Weight:
        """The lm head from its floating-point weight [vocab (this rank's), hidden].

        Heads stay in floating point by default (quantized checkpoints keep them so, and
        tied heads are the embedding itself); loaders that quantize at load may override.
        """
        from textgate.quantization.unquantized import UnquantizedWeight

        return UnquantizedWeight(weight)

    def finish(self, model: nn.Module, model_dir: Path) -> None:
        """Called once the whole model is built from this loader's layers, before it serves:
        for methods that calibrate on the assembled model (int8's smoothing). No-op here."""
        del model, model_dir
