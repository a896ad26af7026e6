"""GPTQ checkpoints (AutoGPTQ, GPTQModel, transformers/optimum): `--quantize gptq`.

Reads `<prefix>.qweight/.qzeros/.scales/.g_idx` in the standard layout (see
`textgate.kernels.packing`), for 2, 4 and 8 bits, any group size (-1 included),
act-order (`desc_act`) or not, symmetric or not, and both zero-point conventions:
`checkpoint_format` (or GPTQModel's newer `format`) "gptq" (v1, zeros stored minus one,
what AutoGPTQ and GPTQModel save by default) and "gptq_v2" (zeros as they are).
Layers the checkpoint left in floating point (`<prefix>.weight`) load as such.

Tensor parallel, in the unpacked domain (codes [out, in], groups [groups, out]):
- column-parallel: this rank's output columns of qweight, scales and zeros; g_idx whole.
- row-parallel: this rank's input rows of qweight (the split must fall on whole packed
  words, multiples of 32 / bits inputs) and its slice of g_idx; scales and zeros keep the
  groups those inputs use, whole — a group split between two ranks is used by both with
  the same scale, and act-order's scattered groups (TGI's approach) need no special case.
The resulting `QuantizedWeight` becomes the fastest CPU layer, or on CUDA the Triton
dequant-matmul layer (see `int4_linear`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from textgate.kernels.cpu_isa import has_bf16_arithmetic
from textgate.kernels.int4_linear import build_quantized_linear, int4_kernel_enabled
from textgate.kernels.packing import (
    GPTQ_BITS,
    GPTQ_V1,
    GPTQ_V2,
    UnpackedWeight,
    dequantize,
    unpack_gptq_weight,
    unpack_gptq_zeros,
)
from textgate.quantization.base import Weight, WeightsLoader
from textgate.quantization.registry import register
from textgate.quantization.unquantized import UnquantizedWeightsLoader

if TYPE_CHECKING:
    from textgate.quantization.weights import Shard, Weights

_FLOAT_LAYERS = UnquantizedWeightsLoader()


@dataclass
class QuantizedWeight(Weight):
    """This rank's integer codes of one linear layer, and the dtype the model runs in."""

    unpacked: UnpackedWeight
    bits: int
    dtype: torch.dtype

    def get_linear(self, bias: Tensor | None) -> nn.Module:
        return build_quantized_linear(self.unpacked, self.bits, self.dtype, bias)


def slice_outputs(unpacked: UnpackedWeight, start: int, stop: int) -> UnpackedWeight:
    """Output features [start, stop) of a layer (column-parallel)."""
    return unpacked._replace(
        intweight=unpacked.intweight[start:stop].contiguous(),
        scales=unpacked.scales[:, start:stop].contiguous(),
        zeros=unpacked.zeros[:, start:stop].contiguous(),
    )


def keep_used_groups(unpacked: UnpackedWeight) -> UnpackedWeight:
    """Drop the groups no input of this (row-parallel) slice belongs to; renumber g_idx."""
    used, g_idx = torch.unique(unpacked.g_idx.long(), return_inverse=True)
    return unpacked._replace(
        scales=unpacked.scales[used].contiguous(),
        zeros=unpacked.zeros[used].contiguous(),
        g_idx=g_idx.to(torch.int32),
    )


def concat_outputs(parts: Sequence[UnpackedWeight]) -> UnpackedWeight | None:
    """Layers sharing their input fused along the output axis; None if g_idx differ."""
    if any(not torch.equal(p.g_idx, parts[0].g_idx) for p in parts[1:]):
        return None
    if any(p.scales.shape[0] != parts[0].scales.shape[0] for p in parts[1:]):
        return None
    return UnpackedWeight(
        intweight=torch.cat([p.intweight for p in parts], dim=0),
        scales=torch.cat([p.scales for p in parts], dim=1),
        zeros=torch.cat([p.zeros for p in parts], dim=1),
        g_idx=parts[0].g_idx,
    )


class GroupQuantizedLoader(WeightsLoader):
    """What GPTQ and AWQ share: sharding and fusing in the unpacked domain.

    Subclasses read one layer (`_read`) as integer codes for a range of its outputs or
    inputs; a layer stored in floating point is read by the unquantized loader.
    """

    bits: int
    #: A fused layer (q/k/v, gate/up) whose parts are partly quantized: refused (a GPTQ or
    #: AWQ checkpoint is inconsistent then), or, where a format mixes types by design
    #: (GGUF), fused in floating point from the folder.
    mixed_fuse_as_float: ClassVar[bool] = False

    def cpu_dtype(self) -> torch.dtype | None:
        """bfloat16 for 4-bit (and 2-bit) codes where the CPU int4 kernel runs and the CPU
        has bf16 arithmetic: the only dtype the kernel serves (`int4_linear`); in float32
        the codes would be dequantized to 8x their bytes. Without bf16 arithmetic (an AVX2
        CPU) bf16 may crawl, so both are timed (None)."""
        fast = int4_kernel_enabled() and has_bf16_arithmetic()
        return torch.bfloat16 if self.bits <= 4 and fast else None

    @abstractmethod
    def _read(
        self, weights: Weights, prefix: str, outputs: Shard | None, inputs: Shard | None
    ) -> UnpackedWeight:
        """Codes of outputs `outputs` (None: all) or inputs `inputs` (None: all)."""

    @abstractmethod
    def _in_features(self, weights: Weights, prefix: str) -> int:
        """The layer's input features, from its stored shapes."""

    def _is_quantized(self, weights: Weights, prefix: str) -> bool:
        return weights.has_tensor(f"{prefix}.qweight")

    def _weight(self, weights: Weights, unpacked: UnpackedWeight) -> QuantizedWeight:
        return QuantizedWeight(unpacked, self.bits, weights.dtype)

    def get_weights(self, weights: Weights, prefix: str) -> Weight:
        if not self._is_quantized(weights, prefix):
            return _FLOAT_LAYERS.get_weights(weights, prefix)
        return self._weight(weights, self._read(weights, prefix, None, None))

    def _out_features(self, weights: Weights, prefix: str) -> int:
        return weights.get_shape(f"{prefix}.scales")[1]

    def get_weights_col(self, weights: Weights, prefix: str, shard: Shard | None = None) -> Weight:
        if not self._is_quantized(weights, prefix):
            return _FLOAT_LAYERS.get_weights_col(weights, prefix, shard)
        if shard is None:
            shard = weights.even_shard(self._out_features(weights, prefix))
        return self._weight(weights, self._read(weights, prefix, shard, None))

    def get_multi_weights_col(
        self,
        weights: Weights,
        prefixes: Sequence[str],
        dim: int,
        shards: Sequence[Shard] | None = None,
    ) -> Weight:
        if not all(self._is_quantized(weights, p) for p in prefixes):
            if not self.mixed_fuse_as_float and any(
                self._is_quantized(weights, p) for p in prefixes
            ):
                raise ValueError(f"{list(prefixes)} mix quantized and floating-point layers")
            return _FLOAT_LAYERS.get_multi_weights_col(weights, prefixes, dim, shards)
        if dim != 0:
            raise ValueError(f"quantized layers fuse along the output axis (dim 0), not {dim}")
        per_prefix = shards if shards is not None else [None] * len(prefixes)
        if len(per_prefix) != len(prefixes):
            raise ValueError(f"{len(prefixes)} prefixes but {len(per_prefix)} shards")
        parts = []
        for prefix, shard in zip(prefixes, per_prefix, strict=True):
            if shard is None:
                shard = weights.even_shard(self._out_features(weights, prefix))
            parts.append(self._read(weights, prefix, shard, None))
        fused = concat_outputs(parts)
        if fused is None:
            # Act-order gave the fused layers different input orders: no one int layout
            # serves them, so they are fused as floating point (the reference path).
            from textgate.quantization.unquantized import UnquantizedWeight

            dense = [dequantize(part, weights.dtype) for part in parts]
            return UnquantizedWeight(torch.cat(dense, dim=0))
        return self._weight(weights, fused)

    def get_weights_row(self, weights: Weights, prefix: str, shard: Shard | None = None) -> Weight:
        if not self._is_quantized(weights, prefix):
            return _FLOAT_LAYERS.get_weights_row(weights, prefix, shard)
        if shard is None:
            shard = weights.even_shard(self._in_features(weights, prefix))
        return self._weight(weights, keep_used_groups(self._read(weights, prefix, None, shard)))


@dataclass(frozen=True)
class GptqConfig:
    """The fields of a GPTQ `quantization_config` that decide how tensors are read."""

    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = GPTQ_V1

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> GptqConfig:
        """Parse and validate; ValueError names the offending field."""
        bits = int(config.get("bits", 4))
        if bits not in GPTQ_BITS:
            raise ValueError(f"GPTQ bits={bits} is not supported (supported: {GPTQ_BITS})")
        group_size = int(config.get("group_size", 128))
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"GPTQ group_size must be positive or -1, got {group_size}")
        fmt = str(config.get("checkpoint_format") or config.get("format") or GPTQ_V1).lower()
        if fmt not in (GPTQ_V1, GPTQ_V2):
            raise ValueError(
                f"GPTQ checkpoint_format {fmt!r} is not supported: textgate reads 'gptq' (v1) "
                "and 'gptq_v2'; re-save the checkpoint in one of them (GPTQModel: format='gptq')"
            )
        pack_dtype = str(config.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack_dtype != "int32":
            raise ValueError(f"GPTQ pack_dtype {pack_dtype!r} is not supported (only int32)")
        if config.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported")
        if config.get("dynamic"):
            raise ValueError("GPTQModel's per-module `dynamic` overrides are not supported")
        return cls(
            bits=bits,
            group_size=group_size,
            desc_act=bool(config.get("desc_act", False)),
            sym=bool(config.get("sym", True)),
            checkpoint_format=fmt,
        )


@register("gptq")
class GptqWeightsLoader(GroupQuantizedLoader):
    """GPTQ's `qweight/qzeros/scales/g_idx`, unpacked at load into the CPU int4 layout."""

    def __init__(self, config: GptqConfig | None = None) -> None:
        self.config = config or GptqConfig()
        self.bits = self.config.bits

    @classmethod
    def from_config(cls, quantization_config: Mapping[str, Any]) -> GptqWeightsLoader:
        return cls(GptqConfig.from_dict(quantization_config))

    def _pack_factor(self) -> int:
        return 32 // self.bits

    def _in_features(self, weights: Weights, prefix: str) -> int:
        return weights.get_shape(f"{prefix}.qweight")[0] * self._pack_factor()

    def _read(
        self, weights: Weights, prefix: str, outputs: Shard | None, inputs: Shard | None
    ) -> UnpackedWeight:
        from textgate.quantization.weights import Shard

        k = self._pack_factor()
        in_features = self._in_features(weights, prefix)
        scales = weights.get_tensor(f"{prefix}.scales", to_dtype=False)  # [groups, out]
        qzeros = weights.get_tensor(f"{prefix}.qzeros")  # [groups, out / k]
        zeros = unpack_gptq_zeros(qzeros, self.bits, self.config.checkpoint_format)
        if weights.has_tensor(f"{prefix}.g_idx"):
            g_idx = weights.get_tensor(f"{prefix}.g_idx").to(torch.int32)
        else:  # some exporters omit it without act-order: consecutive groups
            size = in_features if self.config.group_size == -1 else self.config.group_size
            g_idx = (torch.arange(in_features) // size).to(torch.int32)
        if inputs is None:
            if outputs is None:
                qweight = weights.get_tensor(f"{prefix}.qweight")
            else:
                qweight = weights.get_partial(f"{prefix}.qweight", 1, outputs)
        else:
            if inputs.start % k or inputs.stop % k:
                raise ValueError(
                    f"{prefix}: row-parallel split {inputs.start}:{inputs.stop} does not fall "
                    f"on whole {self.bits}-bit words of {k} inputs; use fewer shards"
                )
            words = Shard(inputs.start // k, inputs.stop // k)
            qweight = weights.get_partial(f"{prefix}.qweight", 0, words)
            g_idx = g_idx[inputs.start : inputs.stop]
        intweight = unpack_gptq_weight(qweight, self.bits)  # [out (slice), in (slice)]
        if zeros.shape != scales.shape or g_idx.numel() != intweight.shape[1]:
            raise ValueError(
                f"{prefix}: GPTQ tensors disagree for {self.bits} bits: qweight gives "
                f"{tuple(intweight.shape)} codes, scales {tuple(scales.shape)}, qzeros unpack "
                f"to {tuple(zeros.shape)}, g_idx has {g_idx.numel()} entries"
            )
        unpacked = UnpackedWeight(intweight, scales, zeros, g_idx)
        if outputs is not None:
            unpacked = unpacked._replace(
                scales=scales[:, outputs.start : outputs.stop].contiguous(),
                zeros=zeros[:, outputs.start : outputs.stop].contiguous(),
            )
        if int(g_idx.max()) >= scales.shape[0] or int(g_idx.min()) < 0:
            raise ValueError(f"{prefix}: g_idx names groups outside [0, {scales.shape[0]})")
        return unpacked
