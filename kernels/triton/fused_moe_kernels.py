"""The Triton program of the fused MoE block (host side and reference: kernels/triton/fused_moe.py).

One grouped matmul over (token, expert) pairs sorted by expert, run twice per layer: once
over the gate-up weights (rows gathered by token, SwiGLU in the epilogue) and once over
the down weights (each row times its routing weight, written in token order). It
accumulates in float32 and rounds to the activations' dtype where the PyTorch path rounds
(after each matmul, after the SiLU, after the weighting).
The module imports triton; it is loaded on first use only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from textgate.kernels.triton.dot import dot


@triton.jit
def expert_matmul_kernel(
    a_ptr,  # GATE_UP: hidden [T, K]; else the activations [P, K] in pair order
    w_ptr,  # GATE_UP: gate-up [E, 2 N, K] (gate rows, then up rows); else down [E, N, K]
    out_ptr,  # GATE_UP: [P, N] in pair order; else [P, N] in token order (row dest[pair])
    tokens_ptr,  # [P] the token of each pair (GATE_UP)
    dest_ptr,  # [P] the output row of each pair (not GATE_UP)
    route_weights_ptr,  # [P] the routing weight of each pair (not GATE_UP)
    block_expert_ptr,  # [num_blocks] the expert of each row block; -1 past the last
    block_first_ptr,  # [num_blocks] the block's first pair
    block_end_ptr,  # [num_blocks] the end of its expert's pairs
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    GATE_UP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (row block, column block): the tile a[rows] @ w[expert].T of one expert's
    BLOCK_M pairs; GATE_UP: silu(gate) * up, else times the routing weights."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:  # the grid is sized for the most blocks any routing can need
        return
    first = tl.load(block_first_ptr + tl.program_id(0))
    end = tl.load(block_end_ptr + tl.program_id(0))
    pairs = first + tl.arange(0, BLOCK_M)
    pair_mask = pairs < end
    if GATE_UP:
        rows = tl.load(tokens_ptr + pairs, mask=pair_mask, other=0).to(tl.int64)
    else:
        rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    weight = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + ks[None, :],
            mask=pair_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(weight + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += dot(a, w, UPCAST)
        if GATE_UP:
            up = tl.load(weight + N * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            acc_up += dot(a, up, UPCAST)
    dtype = out_ptr.dtype.element_ty
    if GATE_UP:
        gate = acc.to(dtype).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        result = silu * acc_up.to(dtype).to(tl.float32)
        out_rows = pairs.to(tl.int64)
    else:
        route = tl.load(route_weights_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)
        result = acc.to(dtype).to(tl.float32) * route[:, None]
        out_rows = tl.load(dest_ptr + pairs, mask=pair_mask, other=0).to(tl.int64)
    out = out_ptr + out_rows[:, None] * stride_om + cols[None, :]
    tl.store(out, result.to(dtype), mask=pair_mask[:, None] & col_mask[None, :])
