"""`--quantize gguf`: a GGUF model served with its 4-bit linear layers kept quantized.

A GGUF file (`--model-id model.gguf`, or the embedded default, itself a Q4_1 GGUF) is
converted once into a floating-point folder (`shard_server/loading/model_source.py`), which
remembers the file it came from. With `--quantize gguf` the linear layers stored as Q4_0,
Q4_1 or Q4_K are read from the GGUF itself, as codes, and served by the same int4 layers
as GPTQ and AWQ (`int4_linear.build_quantized_linear`: the CPU int4 kernel in bfloat16,
the Triton kernel on CUDA for Q4_0); every other tensor (norms, the embedding and a tied
head, layers in other GGUF types: Q8_0, Q6_K and the other K-quants, floats) comes from
the folder, dequantized there by transformers' GGUF reader, exactly as without the flag.

GGUF blocks hold consecutive inputs of one output row:
- Q4_0: fp16 `d`, 16 bytes of codes; w = d * (q - 8).
- Q4_1: fp16 `d`, fp16 `m`, 16 bytes of codes; w = d * q + m, i.e. d * (q - z) with the
  fractional zero point z = -m / d (a block with d = 0 is m whatever its codes:
  `zero_points` rewrites it so). In both, code j < 16 of a block is byte j's low nibble,
  code j + 16 its high nibble.
- Q4_K: super-blocks of 256 inputs whose eight groups of 32 each have a 6-bit scale and
  min: per group, w = (D * scale) q - Dmin * min, the Q4_1 form again (`_decode_q4_k`).
llama.cpp's converter reorders the rows of llama's q and k projections (rotary halves
interleaved); they are put back in the order the folder and the model use, as
transformers does.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from textgate.kernels.packing import UnpackedWeight, contiguous_g_idx
from textgate.paths import converted_from
from textgate.quantization.gptq import GroupQuantizedLoader
from textgate.quantization.registry import register

if TYPE_CHECKING:
    from textgate.quantization.weights import Shard, Weights

log = logging.getLogger("textgate.quantization")

BLOCK = 32
"""Inputs per group of one scale and offset (a Q4_0/Q4_1 block, an eighth of a Q4_K one)."""
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}

# Hugging Face module names -> GGUF tensor names, for the llama-family layout.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_PREFIX = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Architectures whose GGUF linears map onto the model's as above; llama's q/k rows were
# reordered by llama.cpp's converter (see `_unpermute`).
_ARCHITECTURES = {"llama": True, "mistral": True, "qwen2": False}


def gguf_tensor_name(prefix: str) -> str | None:
    """`model.layers.3.self_attn.q_proj` -> `blk.3.attn_q.weight` (None: not a mapped linear)."""
    match = _PREFIX.match(prefix)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def decode_q4(raw: Tensor, kind: str) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of Q4_0/Q4_1/Q4_K blocks (uint8 [out, blocks * bytes]) -> codes int32 [out, in]
    and, per group of 32 inputs, d and m float32 [out, in / 32]: w = d q + m."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, _BLOCK_BYTES[kind])
    if kind == "Q4_K":
        return _decode_q4_k(blocks)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if kind == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        packed = blocks[..., 4:]
    else:
        m = -8 * d
        packed = blocks[..., 2:]
    codes = torch.cat([packed & 15, packed >> 4], dim=-1)  # [out, blocks, 32]
    return codes.reshape(out_features, -1).to(torch.int32), d, m


def _decode_q4_k(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K super-blocks of 256 inputs: fp16 d and dmin, 12 bytes packing eight 6-bit scales
    and mins (one per 32 inputs), 128 bytes of codes (each 32 bytes: the low nibbles are one
    group of 32, the high nibbles the next); w = d * scale * q - dmin * min."""
    out_features = blocks.shape[0]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [out, blocks, 1]
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:16].long()
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([low & 63, (high & 15) | ((low >> 6) << 4)], dim=-1)  # [out, blocks, 8]
    mins = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    qs = blocks[..., 16:].reshape(out_features, -1, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=3)  # [out, blocks, 4, 2, 32]
    return (
        codes.reshape(out_features, -1).to(torch.int32),
        (d * scales).reshape(out_features, -1),
        (-dmin * mins).reshape(out_features, -1),
    )


def zero_points(codes: Tensor, d: Tensor, m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Codes, scales and zero points z with d (q - z) = d q + m, per group of 32 [out, groups].

    z = -m / d, integer for Q4_0 (8; returned as int32, as GPTQ's). A group with d = 0 is m
    whatever its codes: it becomes codes 0, scale |m| / 1024 (1 where m = 0 too) and
    z = -m / scale, which gives m again (to float rounding, in any dtype the scale and zero
    are kept in), without a special case downstream.
    """
    flat = d == 0
    if bool(flat.any()):
        codes = codes.masked_fill(flat.repeat_interleave(BLOCK, dim=1), 0)
        d = torch.where(flat, torch.where(m == 0, 1.0, m.abs() / 1024), d)
    zeros = -m / d
    if torch.equal(zeros, zeros.round()):
        return codes, d, zeros.to(torch.int32)
    return codes, d, zeros


def _unpermute(rows: int, heads: int) -> Tensor:
    """Row order undoing llama.cpp's q/k permutation: row r of the model is row perm[r] of
    the GGUF tensor (transformers' reverse_permute_weights, as indices)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


class GgufFile:
    """The GGUF file a folder was converted from: its linears' types and blocks."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(str(path))
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        architecture = self.field("general.architecture")
        if architecture not in _ARCHITECTURES:
            raise ValueError(
                f"--quantize gguf reads llama, mistral and qwen2 GGUF files; {path.name} is "
                f"{architecture!r}: serve it without --quantize (dequantized)"
            )
        self.architecture = str(architecture)

    def field(self, key: str) -> Any:
        """A scalar or string metadata value (None where absent)."""
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

    def kind(self, name: str) -> str | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.tensor_type.name

    def read(self, name: str) -> tuple[Tensor, Tensor, Tensor]:
        """Codes, d and m of a Q4_0/Q4_1/Q4_K tensor, rows in the model's order."""
        tensor = self.tensors[name]
        raw = torch.from_numpy(tensor.data.copy())  # [out, bytes]
        codes, d, m = decode_q4(raw, tensor.tensor_type.name)
        heads = self._permuted_heads(name)
        if heads:
            order = _unpermute(codes.shape[0], heads)
            codes, d, m = codes[order], d[order], m[order]
        return codes, d, m

    def _permuted_heads(self, name: str) -> int | None:
        if not _ARCHITECTURES[self.architecture]:
            return None
        arch = self.architecture
        if name.endswith(".attn_q.weight"):
            return int(self.field(f"{arch}.attention.head_count"))
        if name.endswith(".attn_k.weight"):
            kv = self.field(f"{arch}.attention.head_count_kv")
            return int(kv if kv is not None else self.field(f"{arch}.attention.head_count"))
        return None

    @cached_property
    def servable(self) -> frozenset[str]:
        """Names of the layers' tensors stored in a 4-bit type this loader reads."""
        return frozenset(
            name
            for name, tensor in self.tensors.items()
            if name.startswith("blk.") and tensor.tensor_type.name in _BLOCK_BYTES
        )


@register("gguf")
class GgufWeightsLoader(GroupQuantizedLoader):
    """Q4_0/Q4_1/Q4_K linears from the GGUF file the folder was converted from."""

    bits = 4
    reads_float_checkpoint = True  # the folder is floating point; its GGUF sits beside it
    mixed_fuse_as_float = True  # q and v (or gate and up) may be stored in different types

    def __init__(self, gguf: GgufFile | None = None) -> None:
        self._gguf = gguf

    @classmethod
    def from_checkpoint(
        cls, path: Path, quantization_config: Mapping[str, Any]
    ) -> GgufWeightsLoader:
        source = converted_from(path)
        if source is None:
            raise ValueError(
                f"--quantize gguf serves a GGUF model: {path} was not converted from one. "
                "Pass the .gguf file as --model-id (or leave --model-id unset for the "
                "embedded default)"
            )
        if not source.is_file():
            raise ValueError(f"--quantize gguf: {path} was converted from {source}, now missing")
        return cls(GgufFile(source))

    @property
    def gguf(self) -> GgufFile:
        if self._gguf is None:
            raise ValueError("the gguf loader is built from a checkpoint (from_checkpoint)")
        return self._gguf

    def cpu_dtype(self) -> torch.dtype | None:
        """bf16 (the int4 kernel's) when the file holds 4-bit linears; else measure."""
        return super().cpu_dtype() if self.gguf.servable else None

    def _is_quantized(self, weights: Weights, prefix: str) -> bool:
        name = gguf_tensor_name(prefix)
        return name is not None and name in self.gguf.servable

    def _in_features(self, weights: Weights, prefix: str) -> int:
        return int(self.gguf.tensors[self._name(prefix)].shape[0])  # ggml: ne0 = inputs

    def _out_features(self, weights: Weights, prefix: str) -> int:
        return int(self.gguf.tensors[self._name(prefix)].shape[1])

    def _name(self, prefix: str) -> str:
        name = gguf_tensor_name(prefix)
        assert name is not None
        return name

    def _read(
        self, weights: Weights, prefix: str, outputs: Shard | None, inputs: Shard | None
    ) -> UnpackedWeight:
        codes, d, m = self.gguf.read(self._name(prefix))
        g_idx = contiguous_g_idx(codes.shape[1], BLOCK)
        codes, d, zeros = zero_points(codes, d, m)
        if outputs is not None:
            codes, d, zeros = (t[outputs.start : outputs.stop] for t in (codes, d, zeros))
        if inputs is not None:
            codes, g_idx = codes[:, inputs.start : inputs.stop], g_idx[inputs.start : inputs.stop]
        device = weights.device  # decoded on the host; served where the model runs
        return UnpackedWeight(
            intweight=codes.contiguous().to(device),
            scales=d.T.contiguous().to(device),  # [groups, out]
            zeros=zeros.T.contiguous().to(device),  # fractional for Q4_1 and Q4_K
            g_idx=g_idx.to(torch.int32).to(device),
        )

    def finish(self, model: torch.nn.Module, model_dir: Path) -> None:
        """Log which of the file's linears stayed 4-bit, and which types were dequantized."""
        del model, model_dir
        linears = [
            (name, tensor.tensor_type.name)
            for name, tensor in self.gguf.tensors.items()
            if name.startswith("blk.") and name.split(".")[2] in _LAYER_NAMES.values()
        ]
        dequantized = Counter(kind for name, kind in linears if name not in self.gguf.servable)
        log.info(
            "gguf %s: %d of %d linear layers kept as int4 codes; dequantized: %s",
            self.gguf.path.name,
            len(linears) - sum(dequantized.values()),
            len(linears),
            ", ".join(f"{count} {kind}" for kind, count in sorted(dequantized.items())) or "none",
        )
