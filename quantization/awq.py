"""AWQ checkpoints in AutoAWQ's GEMM layout: `--quantize awq`.

Reads `<prefix>.qweight/.qzeros/.scales` (layout and nibble order in
`textgate.kernels.packing`): 4 bits with zero points, groups of consecutive inputs
(64 and 128 in practice; any size dividing the layer's inputs). Config from config.json's
`quantization_config` (`bits`, `group_size`, `zero_point`, `version`) or AutoAWQ's own
spelling (`w_bit`, `q_group_size`). Only `version: gemm` is read: GEMV, GEMV_fast, Marlin
and the other AutoAWQ layouts store different tensors and are refused by name. AutoAWQ
itself is archived and not a dependency; its format is supported exactly.

Tensor parallel as GPTQ (see `textgate.quantization.gptq`): column-parallel splits must
fall on whole words of 8 outputs; row-parallel takes any input rows and the groups they use.
On CUDA the codes are repacked into GPTQ's layout for the Triton layer (see `int4_linear`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textgate.kernels.packing import (
    AWQ_BITS,
    UnpackedWeight,
    contiguous_g_idx,
    unpack_awq_weight,
    unpack_awq_zeros,
)
from textgate.quantization.gptq import GroupQuantizedLoader
from textgate.quantization.registry import register

if TYPE_CHECKING:
    from textgate.quantization.weights import Shard, Weights

AWQ_VERSION = "gemm"
_AWQ_PACK = 32 // AWQ_BITS  # outputs per int32 word


@dataclass(frozen=True)
class AwqConfig:
    """The fields of an AWQ `quantization_config` that decide how tensors are read."""

    group_size: int = 128

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> AwqConfig:
        """Parse and validate; ValueError names the offending field."""
        bits = int(config.get("bits", config.get("w_bit", AWQ_BITS)))
        if bits != AWQ_BITS:
            raise ValueError(f"AWQ bits={bits} is not supported (only {AWQ_BITS})")
        version = str(config.get("version", AWQ_VERSION)).lower()
        if version != AWQ_VERSION:
            raise ValueError(
                f"AWQ version {version!r} is not supported: textgate reads AutoAWQ's GEMM "
                "layout (version 'gemm') only"
            )
        if not config.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        if group_size <= 0:
            raise ValueError(f"AWQ group_size must be positive, got {group_size}")
        return cls(group_size=group_size)


@register("awq")
class AwqWeightsLoader(GroupQuantizedLoader):
    """AutoAWQ GEMM's `qweight/qzeros/scales`, unpacked at load into the CPU int4 layout."""

    bits = AWQ_BITS

    def __init__(self, config: AwqConfig | None = None) -> None:
        self.config = config or AwqConfig()

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any]) -> AwqWeightsLoader:
        return cls(AwqConfig.from_dict(quantization_config))

    def _in_features(self, weights: Weights, prefix: str) -> int:
        return weights.get_shape(f"{prefix}.qweight")[0]

    def _read(
        self, weights: Weights, prefix: str, outputs: Shard | None, inputs: Shard | None
    ) -> UnpackedWeight:
        from textgate.quantization.weights import Shard

        scales = weights.get_tensor(f"{prefix}.scales", to_dtype=False)  # [groups, out]
        qzeros = weights.get_tensor(f"{prefix}.qzeros")  # [groups, out / 8]
        in_features = self._in_features(weights, prefix)
        if scales.shape[0] * self.config.group_size != in_features:
            raise ValueError(
                f"{prefix}: {scales.shape[0]} AWQ groups of {self.config.group_size} do not "
                f"cover its {in_features} inputs"
            )
        if outputs is not None:
            if outputs.start % _AWQ_PACK or outputs.stop % _AWQ_PACK:
                raise ValueError(
                    f"{prefix}: column-parallel split {outputs.start}:{outputs.stop} does not "
                    f"fall on whole AWQ words of {_AWQ_PACK} outputs; use fewer shards"
                )
            words = Shard(outputs.start // _AWQ_PACK, outputs.stop // _AWQ_PACK)
            qweight = weights.get_partial(f"{prefix}.qweight", 1, words)
            qzeros = qzeros[:, words.start : words.stop]
            scales = scales[:, outputs.start : outputs.stop]
        elif inputs is not None:
            qweight = weights.get_partial(f"{prefix}.qweight", 0, inputs)
        else:
            qweight = weights.get_tensor(f"{prefix}.qweight")
        if qweight.shape[1] != qzeros.shape[1] or scales.shape[1] != qzeros.shape[1] * _AWQ_PACK:
            raise ValueError(
                f"{prefix}: AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros "
                f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
            )
        g_idx = contiguous_g_idx(in_features, self.config.group_size)
        if inputs is not None:
            g_idx = g_idx[inputs.start : inputs.stop]
        return UnpackedWeight(
            intweight=unpack_awq_weight(qweight),  # [out (slice), in (slice)]
            scales=scales.contiguous(),
            zeros=unpack_awq_zeros(qzeros),
            g_idx=g_idx,
        )
