"""The on-disk layouts of GPTQ and AWQ checkpoints: pack, unpack and dequantize.

Pure torch: writers (`textgate quantize`) pack with these, loaders unpack with them,
and `dequantize_*` is the reference every fast path is tested against. It sits beside the
int4 kernels that read these layouts (`int4_linear`, `triton/int4_matmul.py`).

Common vocabulary (all functions): a layer has `out` output and `in` input features;
`intweight` [out, in] holds integer codes in [0, 2**bits); `scales` and `zeros` are
[groups, out]; `g_idx` [in] (int32) names the group of every input feature. The real
weight is `W[o, i] = scales[g, o] * (intweight[o, i] - zeros[g, o])` with `g = g_idx[i]`.
Packed words are int32 (safetensors has no uint32); bits are filled from the low end.

GPTQ (AutoGPTQ, GPTQModel, TGI, vLLM, transformers all read this; bits 2, 4, 8):
- `qweight` int32 [in * bits / 32, out]: packed along the INPUT axis; word `r` of column
  `o` holds inputs `r*k .. r*k+k-1` (k = 32 / bits), input `r*k + j` at bits `j*bits`.
- `qzeros`  int32 [groups, out * bits / 32]: packed along the OUTPUT axis, same order.
- `scales`  fp16 [groups, out].
- `g_idx`   int32 [in]: `i // group_size` unless act-order (desc_act) permuted the groups.
  `group_size = -1` means one group spanning every input.
- Zero-point convention: `checkpoint_format` "gptq" (v1, the default of AutoGPTQ and of
  GPTQModel's saved files) stores every zero minus one; GPTQModel's "gptq_v2" stores the
  zero itself. The minus-one is applied to the whole packed word as int32 arithmetic
  (`word - 0x11111111` for 4 bits), which is exactly how GPTQModel converts v2 <-> v1,
  so a zero of 0 (asymmetric layers) survives the round trip; AutoGPTQ subtracts per
  value before packing, which agrees with this whenever no zero is 0. Symmetric
  checkpoints have every zero at 2**(bits-1) (stored 7 for 4 bits in v1).

AWQ GEMM (AutoAWQ `version: "gemm"`; 4 bits only, contiguous groups, no g_idx):
- `qweight` int32 [in, out / 8]: packed along the OUTPUT axis in AWQ's interleaved order:
  nibble `j` of word `c` holds output `8*c + AWQ_PACK_ORDER[j]`, order (0,2,4,6,1,3,5,7).
- `qzeros`  int32 [groups, out / 8]: the same order; zeros stored as they are (no -1).
- `scales`  fp16 [groups, out].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

GPTQ_V1 = "gptq"
GPTQ_V2 = "gptq_v2"
GPTQ_BITS = (2, 4, 8)
AWQ_BITS = 4
# Nibble j of an AWQ word holds output column AWQ_PACK_ORDER[j] of its block of eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

_WORD = 1 << 32


class UnpackedWeight(NamedTuple):
    """Integer codes and their group parameters, as described in the module docstring."""

    intweight: Tensor  # [out, in] int32 codes
    scales: Tensor  # [groups, out] as stored (fp16)
    zeros: Tensor  # [groups, out] int32 codes (the real zero point, v1's -1 undone);
    # float32 where a format's zero point is fractional (GGUF Q4_1: w = d q + m)
    g_idx: Tensor  # [in] int32


def contiguous_g_idx(in_features: int, group_size: int) -> Tensor:
    """`g_idx` [in] for groups of `group_size` consecutive inputs (-1: one group)."""
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.int32)
    if group_size <= 0:
        raise ValueError(f"group_size must be positive or -1, got {group_size}")
    return (torch.arange(in_features) // group_size).to(torch.int32)


def _values_per_word(bits: int, allowed: tuple[int, ...]) -> int:
    if bits not in allowed:
        raise ValueError(f"{bits}-bit packing is not supported (supported: {allowed})")
    return 32 // bits


def _to_int32(words: Tensor) -> Tensor:
    """int64 words in [0, 2**32) as int32 with the same bits."""
    return torch.where(words >= _WORD // 2, words - _WORD, words).to(torch.int32)


def _check_codes(name: str, codes: Tensor, bits: int) -> Tensor:
    if codes.is_floating_point():
        raise ValueError(f"{name} must hold integer codes, got {codes.dtype}")
    codes = codes.to(torch.int64)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"{name} has codes outside [0, {1 << bits}) for {bits} bits")
    return codes


def _pack_dim0(codes: Tensor, bits: int, order: tuple[int, ...] | None = None) -> Tensor:
    """int64 codes [n, m] -> int64 words [n / k, m]: k consecutive rows per word."""
    k = 32 // bits
    n, m = codes.shape
    if n % k:
        raise ValueError(f"{n} values do not pack into whole {bits}-bit words of {k}")
    blocks = codes.reshape(n // k, k, m)  # [words, k, m]
    if order is not None:
        blocks = blocks[:, list(order), :]
    shifts = (torch.arange(k, dtype=torch.int64) * bits).view(1, k, 1)
    return (blocks << shifts).sum(dim=1)  # the shifted fields are disjoint: sum == or


def _unpack_dim0(words: Tensor, bits: int, order: tuple[int, ...] | None = None) -> Tensor:
    """int32 words [n / k, m] -> int32 codes [n, m], the inverse of `_pack_dim0`."""
    k = 32 // bits
    # int32 arithmetic shifts sign-extend the top field; the mask drops those bits.
    shifts = (torch.arange(k, dtype=torch.int32) * bits).view(1, k, 1)
    fields = (words.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [w, k, m]
    if order is not None:
        fields = fields[:, [order.index(j) for j in range(k)], :]
    return fields.reshape(-1, words.shape[1])


def _zero_offset(bits: int) -> int:
    """The int32 word that adds one to every packed value (0x11111111 for 4 bits)."""
    return sum(1 << (j * bits) for j in range(32 // bits))


def _check_group_shapes(intweight: Tensor, scales: Tensor, zeros: Tensor) -> None:
    if intweight.dim() != 2:
        raise ValueError(f"intweight must be [out, in], got shape {tuple(intweight.shape)}")
    out_features = intweight.shape[0]
    if scales.dim() != 2 or scales.shape[1] != out_features:
        raise ValueError(f"scales must be [groups, {out_features}], got {tuple(scales.shape)}")
    if zeros.shape != scales.shape:
        raise ValueError(f"zeros {tuple(zeros.shape)} must match scales {tuple(scales.shape)}")


def _default_g_idx(in_features: int, num_groups: int) -> Tensor:
    if in_features % num_groups:
        raise ValueError(
            f"{in_features} inputs do not split into {num_groups} equal groups; pass g_idx"
        )
    return contiguous_g_idx(in_features, in_features // num_groups)


def pack_gptq(
    intweight: Tensor,
    scales: Tensor,
    zeros: Tensor,
    g_idx: Tensor | None = None,
    bits: int = 4,
    *,
    checkpoint_format: str = GPTQ_V1,
) -> dict[str, Tensor]:
    """The GPTQ tensors of one layer: `qweight`, `qzeros`, `scales` (fp16), `g_idx`.

    intweight [out, in] codes; scales, zeros [groups, out] (zeros are integer codes, the
    real zero point); g_idx [in], or None for `in / groups` consecutive inputs per group.
    `in` must be a multiple of 32 / bits, `out` too (qzeros packs along it).
    """
    k = _values_per_word(bits, GPTQ_BITS)
    _check_group_shapes(intweight, scales, zeros)
    out_features, in_features = intweight.shape
    if out_features % k:
        raise ValueError(f"out_features {out_features} is not a multiple of {k}")
    if g_idx is None:
        g_idx = _default_g_idx(in_features, scales.shape[0])
    if g_idx.shape != (in_features,):
        raise ValueError(f"g_idx must be [{in_features}], got {tuple(g_idx.shape)}")
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]):
        raise ValueError(f"g_idx names groups outside [0, {scales.shape[0]})")
    qweight = _pack_dim0(_check_codes("intweight", intweight, bits).T.contiguous(), bits)
    qzeros = _pack_dim0(_check_codes("zeros", zeros, bits).T.contiguous(), bits).T
    if checkpoint_format == GPTQ_V1:
        qzeros = (qzeros - _zero_offset(bits)) % _WORD
    elif checkpoint_format != GPTQ_V2:
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}")
    return {
        "qweight": _to_int32(qweight),  # [in / k, out]
        "qzeros": _to_int32(qzeros.contiguous()),  # [groups, out / k]
        "scales": scales.to(torch.float16).contiguous(),  # [groups, out]
        "g_idx": g_idx.to(torch.int32).contiguous(),  # [in]
    }


def unpack_gptq_zeros(qzeros: Tensor, bits: int, checkpoint_format: str = GPTQ_V1) -> Tensor:
    """qzeros int32 [groups, out * bits / 32] -> zero points int32 [groups, out]."""
    _values_per_word(bits, GPTQ_BITS)
    words = qzeros.to(torch.int64)
    if checkpoint_format == GPTQ_V1:
        words = (words + _zero_offset(bits)) % _WORD
    elif checkpoint_format != GPTQ_V2:
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}")
    return _unpack_dim0(_to_int32(words).T.contiguous(), bits).T.contiguous()


def unpack_gptq_weight(qweight: Tensor, bits: int) -> Tensor:
    """qweight int32 [in * bits / 32, out] -> codes int32 [out, in]."""
    _values_per_word(bits, GPTQ_BITS)
    return _unpack_dim0(qweight, bits).T.contiguous()


def unpack_gptq(
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor | None,
    bits: int = 4,
    *,
    checkpoint_format: str = GPTQ_V1,
) -> UnpackedWeight:
    """The inverse of `pack_gptq` (g_idx None: consecutive groups, as `pack_gptq`)."""
    intweight = unpack_gptq_weight(qweight, bits)
    zeros = unpack_gptq_zeros(qzeros, bits, checkpoint_format)
    _check_group_shapes(intweight, scales, zeros)
    if g_idx is None:
        g_idx = _default_g_idx(intweight.shape[1], scales.shape[0])
    if g_idx.shape != (intweight.shape[1],):
        raise ValueError(f"g_idx must be [{intweight.shape[1]}], got {tuple(g_idx.shape)}")
    return UnpackedWeight(intweight, scales, zeros, g_idx.to(torch.int32))


def dequantize(unpacked: UnpackedWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """W [out, in] = scales[g_idx] * (intweight - zeros[g_idx]), computed in float32."""
    g = unpacked.g_idx.long()
    scales = unpacked.scales.to(torch.float32)[g].T  # [out, in]
    zeros = unpacked.zeros[g].T  # [out, in]
    return (scales * (unpacked.intweight - zeros).to(torch.float32)).to(dtype).contiguous()


def dequantize_gptq(
    qweight: Tensor,
    qzeros: Tensor,
    scales: Tensor,
    g_idx: Tensor | None,
    bits: int = 4,
    *,
    checkpoint_format: str = GPTQ_V1,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The float weight [out, in] of a GPTQ layer (the reference for every fast path)."""
    unpacked = unpack_gptq(
        qweight, qzeros, scales, g_idx, bits, checkpoint_format=checkpoint_format
    )
    return dequantize(unpacked, dtype)


def pack_awq(intweight: Tensor, scales: Tensor, zeros: Tensor) -> dict[str, Tensor]:
    """The AWQ GEMM tensors of one 4-bit layer: `qweight`, `qzeros`, `scales` (fp16).

    intweight [out, in] codes; scales, zeros [groups, out]; groups are `in / groups`
    consecutive inputs. `out` must be a multiple of 8.
    """
    _check_group_shapes(intweight, scales, zeros)
    out_features, in_features = intweight.shape
    if out_features % 8:
        raise ValueError(f"out_features {out_features} is not a multiple of 8")
    _default_g_idx(in_features, scales.shape[0])  # groups must split `in` evenly
    codes = _check_codes("intweight", intweight, AWQ_BITS)  # [out, in]
    zero_codes = _check_codes("zeros", zeros, AWQ_BITS).T.contiguous()  # [out, groups]
    return {
        "qweight": _to_int32(_pack_dim0(codes, AWQ_BITS, AWQ_PACK_ORDER).T.contiguous()),
        "qzeros": _to_int32(_pack_dim0(zero_codes, AWQ_BITS, AWQ_PACK_ORDER).T.contiguous()),
        "scales": scales.to(torch.float16).contiguous(),
    }


def unpack_awq_weight(qweight: Tensor) -> Tensor:
    """qweight int32 [in, out / 8] -> codes int32 [out, in]."""
    return _unpack_dim0(qweight.T.contiguous(), AWQ_BITS, AWQ_PACK_ORDER).contiguous()


def unpack_awq_zeros(qzeros: Tensor) -> Tensor:
    """qzeros int32 [groups, out / 8] -> zero points int32 [groups, out]."""
    return _unpack_dim0(qzeros.T.contiguous(), AWQ_BITS, AWQ_PACK_ORDER).T.contiguous()


def unpack_awq(qweight: Tensor, qzeros: Tensor, scales: Tensor) -> UnpackedWeight:
    """The inverse of `pack_awq`; g_idx is the contiguous one its groups imply."""
    intweight = unpack_awq_weight(qweight)
    zeros = unpack_awq_zeros(qzeros)
    _check_group_shapes(intweight, scales, zeros)
    g_idx = _default_g_idx(intweight.shape[1], scales.shape[0])
    return UnpackedWeight(intweight, scales, zeros, g_idx)


def dequantize_awq(
    qweight: Tensor, qzeros: Tensor, scales: Tensor, *, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The float weight [out, in] of an AWQ GEMM layer."""
    return dequantize(unpack_awq(qweight, qzeros, scales), dtype)
