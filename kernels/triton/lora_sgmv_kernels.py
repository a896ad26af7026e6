"""The Triton programs of the segmented LoRA matmuls (host side and reference: kernels/triton/lora_sgmv.py).

Punica's SGMV pair over rows sorted by adapter: shrink gathers each row block's rows of
x and multiplies by its adapter's A (→ [R, r] in sorted order), expand multiplies those
by the adapter's B and adds the result, times the scale, into the rows of y. Both
accumulate in float32 and round where the PyTorch path rounds (after each matmul).
The module imports triton; it is loaded on first use only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from textgate.kernels.triton.dot import dot


@triton.jit
def sgmv_shrink_kernel(
    x_ptr,  # [T, K] the layer's inputs
    a_ptr,  # [S, RANK, K] every adapter's A, stacked
    v_ptr,  # [R, RANK] out: x[rows] @ A[slot].T in sorted order
    rows_ptr,  # [R] the row of x at each sorted position
    block_slot_ptr,  # [num_blocks] the adapter of each row block; -1: none (or past the last)
    block_first_ptr,  # [num_blocks] the block's first sorted position
    block_end_ptr,  # [num_blocks] the end of its segment
    RANK,
    K,
    stride_xm,
    stride_as,
    stride_ar,
    stride_vm,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (row block, rank block): the tile x[rows] @ A[slot].T of one segment."""
    slot = tl.load(block_slot_ptr + tl.program_id(0))
    if slot < 0:  # the grid is sized for the most blocks any segmentation can need
        return
    first = tl.load(block_first_ptr + tl.program_id(0))
    end = tl.load(block_end_ptr + tl.program_id(0))
    positions = first + tl.arange(0, BLOCK_M)
    row_mask = positions < end
    rows = tl.load(rows_ptr + positions, mask=row_mask, other=0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_mask = ranks < RANK
    a = a_ptr + slot.to(tl.int64) * stride_as + ranks[None, :].to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(a + ks[:, None], mask=k_mask[:, None] & rank_mask[None, :], other=0.0)
        acc += dot(x, w, UPCAST)  # w: [BLOCK_K, BLOCK_R]
    out = v_ptr + positions[:, None].to(tl.int64) * stride_vm + ranks[None, :]
    tl.store(out, acc.to(v_ptr.dtype.element_ty), mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def sgmv_expand_kernel(
    v_ptr,  # [R, RANK] the shrunk rows in sorted order
    b_ptr,  # [S, N, RANK] every adapter's B, stacked
    y_ptr,  # [T, N] the base layer's output: each segment's rows get their update added
    rows_ptr,  # [R] the row of y at each sorted position (each row at most once)
    block_slot_ptr,  # [num_blocks] as in sgmv_shrink_kernel
    block_first_ptr,
    block_end_ptr,
    N,
    RANK,
    stride_vm,
    stride_bs,
    stride_bn,
    stride_ym,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (row block, column block): y[rows, cols] += v @ B[slot].T * scale. No two
    programs touch one element (rows are distinct, blocks disjoint): no atomics."""
    slot = tl.load(block_slot_ptr + tl.program_id(0))
    if slot < 0:
        return
    first = tl.load(block_first_ptr + tl.program_id(0))
    end = tl.load(block_end_ptr + tl.program_id(0))
    positions = first + tl.arange(0, BLOCK_M)
    row_mask = positions < end
    rows = tl.load(rows_ptr + positions, mask=row_mask, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b = b_ptr + slot.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, RANK, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        rank_mask = ranks < RANK
        v = tl.load(
            v_ptr + positions[:, None].to(tl.int64) * stride_vm + ranks[None, :],
            mask=row_mask[:, None] & rank_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        w = tl.load(b + ranks[:, None], mask=rank_mask[:, None] & col_mask[None, :], other=0.0)
        acc += dot(v, w, UPCAST)  # w: [BLOCK_R, BLOCK_N]
    dtype = y_ptr.dtype.element_ty
    update = (acc * scale).to(dtype).to(tl.float32)  # rounded as the PyTorch path rounds
    y = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    base = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    tl.store(y, (base + update).to(dtype), mask=mask)
