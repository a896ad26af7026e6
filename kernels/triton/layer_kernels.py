"""The Triton programs of the fused layer ops (host side and references: kernels/triton/layers.py).

Each program computes in float32 and rounds to the tensor's dtype where its PyTorch
reference rounds, so results match the reference up to float32 reassociation.
The module imports triton; it is loaded on first use only.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(
    x_ptr,  # [T, hidden]
    residual_ptr,  # [T, hidden] (HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    normed_ptr,  # [T, hidden] out
    total_ptr,  # [T, hidden] out: x + residual (HAS_RESIDUAL)
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_n,
    stride_t,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (row): total = x + residual (rounded), normed = round(total * rsqrt(mean(
    total²) + eps)) * weight (rounded), as layers/norm.py's RMSNorm."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + row * stride_t + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * stride_n + cols, (normed * weight).to(x.dtype), mask=mask)


@triton.jit
def rotary_kernel(
    qk_ptr,  # [T, H, D] rotated in place (any token / head strides, dim stride 1)
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D] signed: first half negated (layers/rotary.py signed_sin)
    num_heads,
    stride_t,
    stride_h,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Program (token, head block): x = (x1, x2) → (x1 cos1 + x2 sin1, x2 cos2 + x1 sin2) with
    the signed sin, i.e. apply_rotary_signed = x * cos + rotate_half(x) * sin."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < HALF
    mask = (heads < num_heads)[:, None] & dim_mask[None, :]
    cos1 = tl.load(cos_ptr + token * stride_cos + dims, mask=dim_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_cos + HALF + dims, mask=dim_mask, other=0.0)
    sin1 = tl.load(sin_ptr + token * stride_sin + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_sin + HALF + dims, mask=dim_mask, other=0.0)
    first = qk_ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    out1 = x1f * cos1[None, :] + x2f * sin1[None, :]
    out2 = x2f * cos2.to(tl.float32)[None, :] + x1f * sin2.to(tl.float32)[None, :]
    tl.store(first, out1.to(x1.dtype), mask=mask)
    tl.store(first + HALF, out2.to(x1.dtype), mask=mask)


@triton.jit
def silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2 * width]: [gate | up]
    out_ptr,  # [T, width]
    width,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
):
    """Program (row, column block): out = round(silu(gate)) * up, rounded (F.silu(gate) * up)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0)
    gf = gate.to(tl.float32)
    silu = (gf * tl.sigmoid(gf)).to(gate.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask
    )


@triton.jit
def store_kv_kernel(
    key_ptr,  # [T, H_kv, D] (any token / head strides, dim stride 1)
    value_ptr,
    key_cache_ptr,  # [N, bs, H_kv, D]
    value_cache_ptr,
    slot_mapping_ptr,  # [T]
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (token): copy its keys and values into cache slot slot_mapping[token]
    (block slot // BLOCK_SIZE, offset slot % BLOCK_SIZE). A negative slot is skipped."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    target = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    target = target + heads[:, None] * stride_ch + dims[None, :]
    key = tl.load(
        key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask
    )
    tl.store(key_cache_ptr + target, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask
    )
    tl.store(value_cache_ptr + target, value.to(value_cache_ptr.dtype.element_ty), mask=mask)
