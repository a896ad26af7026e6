"""The linear layer a GPTQ or AWQ weight becomes: codes kept packed (CPU kernel, Triton), else dequantized.

At load, once, every quantized weight is turned into the fastest CPU form measured
(`python -m textgate.bench.micro.int4_linear`, 2-core AVX512-VNNI/BF16 Xeon, 2 threads, random
4-bit g128 weights; time as a ratio to the fp32 FastLinear of the dequantized weight,
lower is faster, all cells in one run):

    shape      M  fp32 ms  bf16  i4-f32  i4-bf16  i4-bf16-act  ao-int8    ref
    576x576    1     0.03  0.79   15.27     0.62         0.73    26.46* 118.83
    576x576   32     0.23  0.45   47.03     0.60         0.57     0.72   15.55
    576x1536   1     0.21  0.43    3.32     0.17         0.19     0.36   22.35
    576x1536  32     0.34  0.32   96.86     0.69         0.71     0.63   16.11
    1536x576   1     0.26  0.38    3.08     0.16         0.21     0.62   62.64
    1536x576  32     0.35  0.48   88.17     0.85         0.82     0.24   14.23

(`--rows 1,32 --rounds 25`, taken while the machine ran other work: read the ratios, not
the milliseconds; * an outlier of that noise, 0.51-1.07 in other runs.) In bf16 the int4 kernel beats the dense bf16 FastLinear at M=1 (the
decode step of one stream: 1.3-2.5x) and trails it at M=32 (1.3-2x), at a quarter of its
weight bytes; in float32 (and float16) the kernel falls to a slow path (3-100x), so those
dtypes take the dequantized FastLinear. Act-order's gather costs ~10-20% at M=1.

- `Int4PackedLinear` (chosen for 4-bit and 2-bit weights): `aten._weight_int4pack_mm_for_cpu`, the
  groupwise int4 kernel behind torchao's CPU int4 weight-only path. It computes
  `(q - 8) * scale + zero` per group, so GPTQ/AWQ's `scale * (q - z)` maps onto it exactly
  with `zero = scale * (8 - z)`. Act-order (desc_act) weights are permuted at load so each
  group's inputs are contiguous, and the activation is gathered with the same permutation
  (`x[..., perm]`) at run time. The kernel's groups are equal and of 32/64/128/256 inputs:
  a checkpoint group whose size is a multiple of one of them (-1 included, and the last
  group of 64 that g128 leaves on the default model's 576 inputs) becomes several kernel
  groups repeating its scale and zero. 1/4 of bf16's weight bytes. From `PROMPT_ROWS`
  rows (a prompt chunk) the codes are expanded to bf16 (`expand_int4`, kernels/cpu_int4.c)
  for a dense matmul instead, which makes prompt steps 1.55-1.7x faster (PROMPT_ROWS).
- `TritonInt4Linear` (weights on CUDA, float16/bfloat16, triton importable): the codes
  repacked once into GPTQ's layout (zeros as they are, v2), AWQ's included, for the
  Triton dequant-matmul `kernels/triton/int4_matmul.py`; 2-bit codes go as 4-bit ones,
  8-bit as 8-bit. The weight stays 4-bit in GPU memory; act-order needs no permutation
  (the program reads each input's group through g_idx).
- Otherwise (8 bits on CPU, out_features not a multiple of 16, unequal groups, float32
  on CUDA, or `TEXTGATE_CPU_KERNELS=0`): the weight is dequantized once to the model's
  dtype and served by `FastLinear` (oneDNN prepacked) — the reference, exact to the
  float rounding of the dequantized weight.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from textgate.kernels.cpu_build import load_library
from textgate.kernels.linear import FastLinear
from textgate.kernels.packing import GPTQ_V2, UnpackedWeight, dequantize, pack_gptq
from textgate.kernels.triton import triton_installed

log = logging.getLogger("textgate.quantization")

INT4_GROUP_SIZES = (256, 128, 64, 32)  # what the CPU int4 kernel accepts, largest first


class Int4PackedLinear(nn.Module):
    """`x @ W.T + bias` with W kept as int4 in the CPU kernel's packed layout.

    Build it with `Int4PackedLinear.from_unpacked` (None where the kernel cannot serve
    the weight). Runs in float32, bfloat16 or float16 (the dtype of the scales given).
    """

    def __init__(
        self,
        packed: Tensor,
        scales_and_zeros: Tensor,
        group_size: int,
        perm: Tensor | None,
        bias: Tensor | None,
    ) -> None:
        super().__init__()
        self.register_buffer("packed", packed)  # uint8 [out, in / 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / group, out, 2]
        self.register_buffer("perm", perm)  # int64 [in], the input order the kernel expects
        self.group_size = group_size
        self.out_features = packed.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_unpacked(
        cls, unpacked: UnpackedWeight, dtype: torch.dtype, bias: Tensor | None = None
    ) -> Int4PackedLinear | None:
        """The packed layer for 4-bit codes, or None where the kernel cannot take them."""
        if not _int4_kernel_available(unpacked, dtype):
            return None
        g_idx = unpacked.g_idx.long()
        in_features = g_idx.numel()
        counts = torch.bincount(g_idx, minlength=unpacked.scales.shape[0])  # inputs per group
        # The kernel's groups are contiguous and equal: each checkpoint group (128 inputs,
        # or a last one of 64 where in_features % 128 == 64) becomes counts[g] / kernel_group
        # kernel groups sharing its scale and zero.
        kernel_group = next((g for g in INT4_GROUP_SIZES if bool((counts % g == 0).all())), None)
        if kernel_group is None:
            return None
        repeats = counts // kernel_group
        perm = torch.argsort(g_idx, stable=True)  # groups contiguous, in group order
        intweight = unpacked.intweight[:, perm]  # [out, in], groups contiguous
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(intweight.contiguous(), 1)
        scales = unpacked.scales.to(torch.float32)  # [groups, out]
        zeros = scales * (8 - unpacked.zeros.to(torch.float32))  # (q-8)*s + zero == s*(q-z)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1)  # [groups, out, 2]
        scales_and_zeros = scales_and_zeros.repeat_interleave(repeats, dim=0).to(dtype)
        identity = torch.equal(perm, torch.arange(in_features))
        return cls(
            packed, scales_and_zeros.contiguous(), kernel_group, None if identity else perm, bias
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1]).to(self.scales_and_zeros.dtype).contiguous()  # [M, in]
        dense = None
        if x2d.shape[0] >= PROMPT_ROWS:
            dense = expand_int4(self.packed, self.scales_and_zeros, self.group_size)
        if dense is not None:
            out = torch.mm(x2d, dense)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2d, self.packed, self.group_size, self.scales_and_zeros
            )  # [M, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)


PROMPT_ROWS = 128
"""Rows from which `Int4PackedLinear` expands its weight to bfloat16 (`expand_int4`) and
runs a dense matmul instead of the int4 kernel. A layer alone, its packed weight in cache,
hardly tells the two apart (`python -m textgate.bench.micro.int4_linear --rows 64,128,512,2048
--group-size 64`: i4-expand 0.96-1.0x i4-bf16 from 128 rows, slower below), but in the
model, whose weights stream from memory, prompt steps are 1.55-1.7x faster with it: the AWQ
g64 default model's prefill of 4 / 32 prompts of 128 tokens took 242-246 / 1834-2079 ms,
against 412-416 / 3218-3234 ms with `--no-int4-expand` (`python -m textgate.bench.micro.step
--model AWQ_DIR --batch 4,32 --prompt-len 128 --steps 8 [--no-int4-expand]`, two rounds
each, 2-core EPYC)."""


@dataclass(frozen=True)
class Int4Layout:
    """A layout `aten._convert_weight_to_int4pack_for_cpu` packs codes in.

    uint8 [n / block][k][block / 2]: the codes of input i for a block of `block` output
    columns take block / 2 bytes, two columns per byte, low nibble first. `halves`: byte j
    holds columns j and j + block / 2; otherwise columns 2j and 2j + 1. Which one torch
    uses depends on the kernel it dispatches to on this CPU (ATen's CPU capability), so it
    is read off torch itself (`torch_int4_layout`), never assumed.
    """

    name: str
    block: int
    halves: bool

    def pack(self, codes: Tensor) -> Tensor:
        """Codes [n, k] (0..15; n a multiple of `block`) packed as uint8 [n, k / 2]."""
        n, k = codes.shape
        blocks = codes.to(torch.uint8).view(n // self.block, self.block, k).transpose(1, 2)
        if self.halves:
            low, high = blocks[..., : self.block // 2], blocks[..., self.block // 2 :]
        else:
            low, high = blocks[..., 0::2], blocks[..., 1::2]
        return (low | (high << 4)).contiguous().view(n, k // 2)

    def unpack(self, packed: Tensor) -> Tensor:
        """The codes [n, k] (int32) that `pack` turned into `packed` [n, k / 2]."""
        n, k = packed.shape[0], packed.shape[1] * 2
        blocks = packed.view(n // self.block, k, self.block // 2).to(torch.int32)
        low, high = blocks & 15, blocks >> 4  # [n / block, k, block / 2] each
        if self.halves:
            columns = torch.cat([low, high], dim=2)
        else:
            columns = torch.stack([low, high], dim=3).flatten(2)
        return columns.transpose(1, 2).reshape(n, k)


INT4_LAYOUTS = (
    Int4Layout("block64-halves", 64, True),  # ATen's AVX512 kernel
    Int4Layout("block32-halves", 32, True),  # its AVX2 kernel
    Int4Layout("block32-pairs", 32, False),  # its portable kernel
)


@functools.cache
def torch_int4_layout() -> Int4Layout | None:
    """The layout torch packs int4 codes in here: a known matrix packed by torch and
    compared with each of INT4_LAYOUTS; None (logged) where none matches, and then nothing
    reads the packed codes but torch's own int4 kernel."""
    codes = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    for layout in INT4_LAYOUTS:
        if packed.shape == (128, 32) and torch.equal(layout.pack(codes), packed):
            return layout
    log.warning(
        "torch %s (CPU capability %s) packs int4 codes in a layout textgate does not know: "
        "4-bit prompts run torch's int4 kernel instead of the bf16 expansion",
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
    )
    return None


def expand_int4(packed: Tensor, scales_and_zeros: Tensor, group_size: int) -> Tensor | None:
    """The bfloat16 weight [in, out] that packed int4 codes stand for (`cpu_int4.c`), or None
    where the C kernels do not run, or torch's layout here is unknown or does not tile the
    layer's columns."""
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    library = load_library()
    layout = torch_int4_layout()
    if library is None or layout is None or scales_and_zeros.dtype != torch.bfloat16:
        return None
    if out_features % layout.block:
        return None
    dense = torch.empty(in_features, out_features, dtype=torch.bfloat16)
    library.textgate_int4_dequantize(
        packed.data_ptr(),
        scales_and_zeros.data_ptr(),
        out_features,
        in_features,
        group_size,
        layout.block,
        int(layout.halves),
        dense.data_ptr(),
    )
    return dense


def reference_expand_int4(
    packed: Tensor, scales_and_zeros: Tensor, group_size: int, layout: Int4Layout | None = None
) -> Tensor:
    """`expand_int4` in PyTorch: undo `layout`'s packing (default: torch's here), then
    (code - 8) * s + z, rounded to bfloat16."""
    layout = layout or torch_int4_layout()
    if layout is None:
        raise ValueError("torch's int4 layout here is unknown (torch_int4_layout)")
    codes = layout.unpack(packed).t()  # [in, out]
    groups = scales_and_zeros.float().repeat_interleave(group_size, dim=0)  # [in, out, 2]
    return ((codes - 8).float() * groups[..., 0] + groups[..., 1]).to(torch.bfloat16)


def int4_kernel_enabled() -> bool:
    """Whether 4-bit weights on the CPU may take the int4 kernel (`TEXTGATE_CPU_KERNELS=0`
    sends every layer to its reference instead)."""
    return os.environ.get("TEXTGATE_CPU_KERNELS", "1") != "0"


def _int4_kernel_available(unpacked: UnpackedWeight, dtype: torch.dtype) -> bool:
    if not int4_kernel_enabled():
        return False
    if unpacked.intweight.device.type != "cpu" or dtype not in _KERNEL_DTYPES:
        return False
    out_features, in_features = unpacked.intweight.shape
    return out_features % 16 == 0 and in_features % 32 == 0


_KERNEL_DTYPES = (torch.bfloat16,)  # float32 and float16 inputs take slow paths (measured)


def build_quantized_linear(
    unpacked: UnpackedWeight, bits: int, dtype: torch.dtype, bias: Tensor | None = None
) -> nn.Module:
    """The layer computing `x @ W.T + bias` for integer codes of `bits` bits.

    On CUDA in float16/bfloat16 the Triton kernel serves every width (`TritonInt4Linear`);
    2- and 4-bit weights the CPU kernel can take stay packed (`Int4PackedLinear`); anything
    else is dequantized once to `dtype` and served by `FastLinear`.
    """
    triton_layer = TritonInt4Linear.from_unpacked(unpacked, bits, dtype, bias)
    if triton_layer is not None:
        return triton_layer
    if bits <= 4:  # 2-bit codes are 4-bit codes that happen to be small
        packed = Int4PackedLinear.from_unpacked(unpacked, dtype, bias)
        if packed is not None:
            return packed
    return FastLinear(dequantize(unpacked, dtype), bias)


#: Devices whose weights take the Triton kernel. CUDA only: on the CPU the layers above
#: serve. Tests add "cpu" to run it in triton's interpreter.
TRITON_DEVICES: tuple[str, ...] = ("cuda",)
_TRITON_DTYPES = (torch.float16, torch.bfloat16)


class TritonInt4Linear(nn.Module):
    """`x @ W.T + bias` on the GPU with W kept packed in GPTQ's layout (zeros as they are).

    Build it with `TritonInt4Linear.from_unpacked` (None where the kernel does not apply).
    """

    def __init__(
        self,
        qweight: Tensor,
        qzeros: Tensor,
        scales: Tensor,
        g_idx: Tensor,
        bits: int,
        dtype: torch.dtype,
        bias: Tensor | None,
    ) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # int32 [in / pack, out]
        self.register_buffer("qzeros", qzeros)  # int32 [groups, out / pack]
        self.register_buffer("scales", scales)  # [groups, out] float, as stored
        self.register_buffer("g_idx", g_idx)  # int32 [in]
        self.bits = bits
        self.dtype = dtype
        self.out_features = scales.shape[1]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_unpacked(
        cls, unpacked: UnpackedWeight, bits: int, dtype: torch.dtype, bias: Tensor | None = None
    ) -> TritonInt4Linear | None:
        """The layer for codes of `bits` bits, or None off TRITON_DEVICES, in float32, or
        without triton."""
        device = unpacked.intweight.device
        if device.type not in TRITON_DEVICES or dtype not in _TRITON_DTYPES:
            return None
        if unpacked.zeros.is_floating_point():  # GPTQ's layout packs integer zero points
            return None
        kernel_bits = 4 if bits <= 4 else 8  # 2-bit codes are 4-bit codes that happen to be small
        pack = 32 // kernel_bits
        out_features, in_features = unpacked.intweight.shape
        if out_features % pack or in_features % pack or not triton_installed():
            return None
        cpu = [t.cpu() for t in unpacked]  # packing runs once, at load, on the host
        tensors = pack_gptq(*cpu, bits=kernel_bits, checkpoint_format=GPTQ_V2)
        return cls(
            tensors["qweight"].to(device),
            tensors["qzeros"].to(device),
            unpacked.scales.contiguous(),  # as stored (fp16): the reference dequantizes with them
            tensors["g_idx"].to(device),
            kernel_bits,
            dtype,
            bias,
        )

    def forward(self, x: Tensor) -> Tensor:
        from textgate.kernels.triton.int4_matmul import int4_matmul

        out = int4_matmul(
            x.to(self.dtype), self.qweight, self.qzeros, self.scales, self.g_idx, self.bits
        )
        return out if self.bias is None else out + self.bias
