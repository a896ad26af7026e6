"""Dense float32 and bfloat16 linear layers on textgate's CPU kernel (cpu_dense.c).

`pack_dense` reorders a weight [out, in] once, at load, into blocks of 16 output channels
([N/16][K/P][16][P], P = 2 bfloat16 inputs per pair or 1 float32), the layout the kernel
streams; `dense_linear` multiplies by it in one C call. The activations and the result are
in the weight's dtype, the sums float32, each row's in the same order whatever it is
batched with. In bfloat16 every level gives the same bits (vdpbf16ps, or the pairs widened
and added in its order); in float32 the levels with FMA round each product once, the
portable one twice.

`reference_dense_linear` (`F.linear` on the unpacked weight) is the definition. `FastLinear`
(kernels/linear.py) packs for this kernel where `serves` says so, else for oneDNN as before:
where the kernels cannot run (no C compiler, `TEXTGATE_CPU_KERNELS=0`, a GPU), where they
have no vector path (the portable x86 level, other architectures), for bfloat16 on AMX
CPUs, and with `TEXTGATE_DENSE_KERNEL=0`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from textgate.kernels import cpu_build, cpu_isa

DENSE_KERNEL_ENV = "TEXTGATE_DENSE_KERNEL"
"""`0`: dense layers stay on oneDNN (the A/B of the kernel); `1`: on the kernel wherever it
builds, even where `serves` would leave them to oneDNN; unset: `serves` decides."""

_C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
BLOCK = 16
"""Output channels per packed block."""


def pair_size(dtype: torch.dtype) -> int:
    """Inputs per packed group: 2 for bfloat16 (vdpbf16ps takes pairs), 1 for float32."""
    return 2 if dtype == torch.bfloat16 else 1


@dataclass(frozen=True)
class PackedDense:
    """A weight packed by `pack_dense`: `packed` [N/16, K/P, 16, P] in the weight's dtype,
    `bias` float32 [N padded to 16] or None."""

    packed: Tensor
    bias: Tensor | None
    in_features: int
    out_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype


def can_pack_dense(weight: Tensor) -> bool:
    """Whether `pack_dense` packs this weight [out, in]: on the CPU, float32 or bfloat16 (an
    even number of inputs), no grad, and the C kernels loaded."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in _C_DTYPES
        and not weight.requires_grad
        and weight.shape[1] % pair_size(weight.dtype) == 0
        and weight.shape[0] > 0
        and weight.shape[1] > 0
        and cpu_build.load_library() is not None
    )


def serves(dtype: torch.dtype) -> bool:
    """Whether `FastLinear` puts dense layers of `dtype` on the kernel here: where the kernels
    built have a vector path (AVX2 or AVX512; plain C is slower than oneDNN), except bfloat16
    on a CPU with AMX, whose tiles multiply prompts several times faster in oneDNN than
    AVX512 can (`TEXTGATE_DENSE_KERNEL` overrides both ways)."""
    setting = os.environ.get(DENSE_KERNEL_ENV, "")
    library = cpu_build.load_library()
    if setting == "0" or library is None or dtype not in _C_DTYPES:
        return False
    if setting == "1":
        return True
    if library.textgate_dense_isa() < 1:
        return False
    return not (dtype == torch.bfloat16 and "amx_bf16" in cpu_isa.cpu_features())


def pack_dense(weight: Tensor, bias: Tensor | None = None) -> PackedDense | None:
    """`weight` [out, in] (and its bias [out]) in the kernel's layout, or None where
    `can_pack_dense` is False. A copy: callers should drop the plain weight."""
    if not can_pack_dense(weight):
        return None
    out_features, in_features = weight.shape
    pair = pair_size(weight.dtype)
    blocks = -(-out_features // BLOCK)
    padded = F.pad(weight.detach(), (0, 0, 0, blocks * BLOCK - out_features))
    packed = (
        padded.reshape(blocks, BLOCK, in_features // pair, pair).permute(0, 2, 1, 3).contiguous()
    )
    packed_bias = None
    if bias is not None:
        packed_bias = F.pad(bias.detach().float(), (0, blocks * BLOCK - out_features))
    return PackedDense(packed, packed_bias, in_features, out_features)


def unpack_dense(weight: PackedDense) -> Tensor:
    """The plain weight [out, in] that `pack_dense` packed."""
    blocks, groups, _, pair = weight.packed.shape
    plain = weight.packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK, groups * pair)
    return plain[: weight.out_features].contiguous()


def reference_dense_linear(x: Tensor, weight: PackedDense) -> Tensor:
    """The definition of `dense_linear`: `F.linear` on the unpacked weight."""
    bias = None if weight.bias is None else weight.bias[: weight.out_features].to(x.dtype)
    return F.linear(x, unpack_dense(weight), bias)


def dense_linear(x: Tensor, weight: PackedDense) -> Tensor:
    """`x @ W.T + bias` for x [..., in] in the weight's dtype, in one call of cpu_dense.c."""
    library = cpu_build.load_library()
    if library is None or x.dtype != weight.dtype or x.device.type != "cpu":
        return reference_dense_linear(x, weight)
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < weight.in_features):
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
    if rows.shape[0]:
        library.textgate_dense_linear(
            rows.data_ptr(), rows.shape[0], weight.in_features, max(rows.stride(0), 1),
            weight.packed.data_ptr(), None if weight.bias is None else weight.bias.data_ptr(),
            out.data_ptr(), weight.out_features, _C_DTYPES[weight.dtype],
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], weight.out_features)


def describe_kernel() -> str:
    """What multiplies the dense layers here, for logs and benchmarks."""
    library = cpu_build.load_library()
    if library is None or not serves(torch.bfloat16):
        return "onednn"
    level = cpu_build.loaded_level()
    dot = "+bf16-dot" if library.textgate_dense_bf16_dot() else ""
    return f"textgate-{level}{dot}"
