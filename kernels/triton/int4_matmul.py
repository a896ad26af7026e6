"""Group-quantized (GPTQ/AWQ) weights times activations in Triton, beside its PyTorch reference.

`int4_matmul(x, qweight, qzeros, scales, g_idx, bits)` computes `x @ W.T` for the weight
W [N, K] a GPTQ checkpoint stores (layout in `textgate.kernels.packing`):
`qweight` int32 [K / pack, N] packed along the inputs, `qzeros` int32 [groups, N / pack]
packed along the outputs with the zero points as they are (GPTQ v2: the v1 minus-one
already undone), `scales` [groups, N] (any float dtype, read as float32) and `g_idx`
int32 [K] naming each input's group (act-order's scattered groups included),
pack = 32 / bits, bits 2, 4 or 8.
AWQ's GEMM layout (packed along the outputs, interleaved nibbles) is repacked into this
one at load (`kernels/int4_linear.TritonInt4Linear`), so one program serves both.

Each program owns a [BLOCK_M, BLOCK_N] tile of the output and walks K in BLOCK_K steps:
it unpacks the codes of BLOCK_K inputs, looks up each input's group scale and zero,
dequantizes `scale * (q - zero)` in float32, rounds to x's dtype (where the reference's
`dequantize(..., dtype)` rounds) and accumulates the tile's dot product in float32.
The weight crosses memory once as 4-bit codes; no dequantized copy is ever written.

The module imports triton; it is loaded on first use only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from textgate.kernels.triton import interpreting

#: Code widths of GPTQ's layout (32 / bits codes a word).
BITS = (2, 4, 8)

#: Activation dtypes the program takes (float32 layers keep the dequantized reference).
DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def int4_matmul_kernel(
    x_ptr,  # [M, K] fp16/bf16 (row stride stride_xm, column stride 1)
    qweight_ptr,  # [K / PACK, N] int32: input k of column n at bits (k % PACK) * BITS
    qzeros_ptr,  # [groups, N / PACK] int32: zero of column n at bits (n % PACK) * BITS
    scales_ptr,  # [groups, N] float
    g_idx_ptr,  # [K] int32
    out_ptr,  # [M, N], x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_om,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (row block, column block): out tile = x rows @ dequantized W columns."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    zero_shift = ((cols % PACK) * BITS)[None, :]  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        tile_mask = k_mask[:, None] & col_mask[None, :]  # [BLOCK_K, BLOCK_N]
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        words = tl.load(
            qweight_ptr + (ks // PACK)[:, None] * N + cols[None, :], mask=tile_mask, other=0
        )
        # int32 shifts sign-extend the top field; the mask drops those bits.
        codes = (words >> ((ks % PACK) * BITS)[:, None]) & MASK  # [BLOCK_K, BLOCK_N]
        groups = tl.load(g_idx_ptr + ks, mask=k_mask, other=0).to(tl.int64)
        scales = tl.load(
            scales_ptr + groups[:, None] * N + cols[None, :], mask=tile_mask, other=0.0
        )
        zero_words = tl.load(
            qzeros_ptr + groups[:, None] * (N // PACK) + (cols // PACK)[None, :],
            mask=tile_mask,
            other=0,
        )
        zeros = (zero_words >> zero_shift) & MASK
        weight = (scales.to(tl.float32) * (codes - zeros).to(tl.float32)).to(x.dtype)
        if UPCAST:  # the interpreter's bfloat16 dot is wrong: the same products in float32
            acc += tl.dot(x.to(tl.float32), weight.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, weight)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _blocks(num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): tl.dot needs 16 rows at least; a decode step's few rows
    take one row block, a prefill's many take larger tiles."""
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    return block_m, 64, 64


def check_layout(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int) -> None:
    """Raise ValueError, naming the tensor, when the five do not describe one GPTQ layer."""
    if bits not in BITS:
        raise ValueError(f"{bits}-bit weights are not supported (supported: {BITS})")
    pack = 32 // bits
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight and qzeros must be int32, got {qweight.dtype}, {qzeros.dtype}")
    in_features, out_features = qweight.shape[0] * pack, qweight.shape[1]
    groups = scales.shape[0]
    if scales.shape != (groups, out_features) or qzeros.shape != (groups, out_features // pack):
        raise ValueError(
            f"qweight {tuple(qweight.shape)} needs scales [groups, {out_features}] and qzeros "
            f"[groups, {out_features // pack}], got {tuple(scales.shape)}, {tuple(qzeros.shape)}"
        )
    if out_features % pack:
        raise ValueError(f"{out_features} outputs do not pack into whole {bits}-bit words")
    if g_idx.shape != (in_features,) or g_idx.dtype != torch.int32:
        raise ValueError(
            f"g_idx must be int32 [{in_features}], got {g_idx.dtype} {tuple(g_idx.shape)}"
        )


def int4_matmul(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int = 4
) -> Tensor:
    """x [..., K] @ W.T -> [..., N] for the GPTQ layer (qweight, qzeros v2, scales, g_idx).

    x must be float16 or bfloat16, scales any float dtype; all tensors on one device
    (CUDA, or the CPU under TRITON_INTERPRET=1). g_idx entries must lie in [0, groups).
    """
    check_layout(qweight, qzeros, scales, g_idx, bits)
    if x.dtype not in DTYPES or not scales.is_floating_point():
        raise ValueError(
            f"x must be float16/bfloat16 and scales float, got {x.dtype}, {scales.dtype}"
        )
    in_features, out_features = g_idx.numel(), scales.shape[1]
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {in_features} inputs")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, in_features)  # [M, K]
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    num_rows = x2d.shape[0]
    out = x2d.new_empty(num_rows, out_features)  # [M, N]
    if num_rows:
        block_m, block_n, block_k = _blocks(num_rows)
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
        int4_matmul_kernel[grid](
            x2d, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(),
            g_idx.contiguous(), out, num_rows, out_features, in_features,
            x2d.stride(0), out.stride(0),
            BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=interpreting(),
        )  # fmt: skip
    return out.reshape(*lead, out_features)


def reference_int4_matmul(
    x: Tensor, qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int = 4
) -> Tensor:
    """What `int4_matmul` computes, in PyTorch: unpack, dequantize `scale * (q - zero)` in
    float32, round to x's dtype, then matmul (kernels/packing.py's `dequantize`)."""
    check_layout(qweight, qzeros, scales, g_idx, bits)
    pack, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits  # [pack]
    codes = (qweight.unsqueeze(1) >> shifts[None, :, None]) & mask  # [K / pack, pack, N]
    codes = codes.reshape(-1, qweight.shape[1])  # [K, N]
    zeros = (qzeros.unsqueeze(-1) >> shifts) & mask  # [groups, N / pack, pack]
    zeros = zeros.reshape(qzeros.shape[0], -1)  # [groups, N]
    groups = g_idx.long()
    weight = scales.float()[groups] * (codes - zeros[groups]).float()  # [K, N]
    return x @ weight.to(x.dtype)
