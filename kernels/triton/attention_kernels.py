"""The Triton programs of the paged-attention backend (host side: kernels/triton/attention.py).

Every program reads keys and values in place through the block tables, BLOCK_N tokens
per loop iteration (each token's block looked up, so a tile may span blocks and any
block size works), and keeps a streaming softmax in float32 (running max m, running sum
l, unnormalized accumulator acc), in base 2: scores are scaled by scale * log2(e) so
exp2 stands in for exp. GQA: one program serves every query head of one kv head, so
each key/value tile is loaded once per group, not once per query head.

Masked scores are -inf; the running max starts at a finite -1e30 so a row that has seen
only masked keys never computes (-inf) - (-inf).

The module imports triton; it is loaded on first use only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from textgate.kernels.triton.dot import dot

# log2(e): exp(x) = exp2(x * LOG2E).
LOG2E = 1.4426950408889634
NO_MAX: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _load_tile(
    cache_ptr,
    scales_ptr,
    rows,
    scale_rows,
    valid,
    dims,
    dim_mask,
    QUANTIZED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """The cache rows `rows` [BLOCK_N] → [BLOCK_N, BLOCK_D] in OUT_DTYPE; rows that are not
    `valid` read as zeros. A quantized cache is dequantized with its per-slot scales at
    `scale_rows` [BLOCK_N]."""
    tile = tl.load(
        cache_ptr + rows[:, None] + dims[None, :],
        mask=valid[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if QUANTIZED:
        scales = tl.load(scales_ptr + scale_rows, mask=valid, other=0.0)
        out = (tile.to(tl.float32) * scales[:, None]).to(OUT_DTYPE)
    else:
        out = tile.to(OUT_DTYPE)
    return out


@triton.jit
def _load_kv(
    key_cache_ptr,
    value_cache_ptr,
    key_scales_ptr,
    value_scales_ptr,
    block_table_ptr,
    positions,
    valid,
    kv_head,
    dims,
    dim_mask,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """The keys and values of one kv head at token `positions` [BLOCK_N] of a sequence whose
    block table row starts at `block_table_ptr` → two [BLOCK_N, BLOCK_D] tiles in OUT_DTYPE;
    positions that are not `valid` read as zeros. Each token's block is looked up, so a
    tile may span several cache blocks."""
    blocks = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slots = positions % BLOCK_SIZE
    rows = blocks * stride_cb + slots * stride_cs + kv_head * stride_ch  # [BLOCK_N]
    scale_rows = blocks * stride_sb + slots * stride_ss + kv_head  # [BLOCK_N] (QUANTIZED)
    keys = _load_tile(
        key_cache_ptr, key_scales_ptr, rows, scale_rows, valid, dims, dim_mask,
        QUANTIZED, OUT_DTYPE,
    )  # fmt: skip
    values = _load_tile(
        value_cache_ptr, value_scales_ptr, rows, scale_rows, valid, dims, dim_mask,
        QUANTIZED, OUT_DTYPE,
    )  # fmt: skip
    return keys, values


@triton.jit
def _softmax_step(query, keys, values, visible, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr):
    """One tile of the streaming softmax: fold keys/values [BLOCK_N, BLOCK_D] into the running
    (max m_i [rows], sum l_i [rows], accumulator acc [rows, BLOCK_D]) of query [rows, BLOCK_D];
    keys where `visible` (broadcast to [rows, BLOCK_N]) is false score -inf."""
    scores = dot(query, tl.trans(keys), UPCAST) * qk_scale  # [rows, BLOCK_N]
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.math.exp2(scores - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(values.dtype), values, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _normalize(acc, l_i):
    """The attention output acc / l_i [rows, BLOCK_D]; a row that saw no key (l_i 0) is 0."""
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def paged_decode_kernel(
    query_ptr,  # [B, H_q, D]: one query per sequence
    key_cache_ptr,  # [N, bs, H_kv, D]
    value_cache_ptr,
    key_scales_ptr,  # [N, bs, H_kv] float32 (QUANTIZED only)
    value_scales_ptr,
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, H_q, D] (one split)
    part_acc_ptr,  # [B, H_q, splits, BLOCK_D] float32 (SPLIT)
    part_max_ptr,  # [B, H_q, splits] float32
    part_sum_ptr,  # [B, H_q, splits] float32
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in tokens (USE_WINDOW)
    tokens_per_split,  # a multiple of BLOCK_N
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    QUANTIZED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (sequence, kv head, split): the GROUP queries of the kv head over the
    split's keys, BLOCK_N at a time. With one split it writes the output; with more (SPLIT; the grid's third
    dimension) it writes its partial (acc, max, sum) for `paged_decode_reduce_kernel`
    (split-K over long contexts). The split count is no constexpr: contexts that grow
    step by step do not compile new variants."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    members = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + members
    head_mask = members < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    query = tl.load(
        query_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    first = split * tokens_per_split
    end = tl.minimum(first + tokens_per_split, seq_len)
    if USE_WINDOW:
        # The query at seq_len - 1 sees keys at positions > seq_len - 1 - window.
        first = tl.maximum(first, tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_G], NO_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for start in range(first, end, BLOCK_N):
        positions = start + offsets
        valid = positions < end
        if USE_WINDOW:
            valid = valid & (positions > seq_len - 1 - window)
        keys, values = _load_kv(
            key_cache_ptr, value_cache_ptr, key_scales_ptr, value_scales_ptr, table, positions,
            valid, kv_head, dims, dim_mask, stride_cb, stride_cs, stride_ch, stride_sb,
            stride_ss, BLOCK_SIZE, QUANTIZED, query.dtype,
        )  # fmt: skip
        m_i, l_i, acc = _softmax_step(
            query, keys, values, valid[None, :], m_i, l_i, acc, qk_scale, UPCAST
        )
    if not SPLIT:
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            _normalize(acc, l_i).to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & dim_mask[None, :],
        )
    else:
        row = (seq * (GROUP * tl.num_programs(1)) + heads) * tl.num_programs(2) + split
        tl.store(part_max_ptr + row, m_i, mask=head_mask)
        tl.store(part_sum_ptr + row, l_i, mask=head_mask)
        tl.store(
            part_acc_ptr + row[:, None] * BLOCK_D + dims[None, :], acc, mask=head_mask[:, None]
        )


@triton.jit
def paged_decode_reduce_kernel(
    part_acc_ptr,  # [B, H_q, num_splits, BLOCK_D] float32
    part_max_ptr,  # [B, H_q, num_splits]
    part_sum_ptr,
    out_ptr,  # [B, H_q, D]
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (sequence, query head): merge the splits' partial softmaxes. A split that
    saw no key has max -1e30 and sum 0, so its weight exp2(max - global max) is 0."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    row = (seq * num_heads + head) * num_splits + splits  # [BLOCK_S]
    maxes = tl.load(part_max_ptr + row, mask=split_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + row, mask=split_mask, other=0.0)
    accs = tl.load(
        part_acc_ptr + row[:, None] * BLOCK_D + dims[None, :], mask=split_mask[:, None], other=0.0
    )  # [BLOCK_S, BLOCK_D]
    weights = tl.math.exp2(maxes - tl.max(maxes, 0))
    total = tl.sum(sums * weights, 0)
    out = tl.sum(accs * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@triton.jit
def paged_prefill_kernel(
    query_ptr,  # [T, H_q, D]
    key_cache_ptr,  # [N, bs, H_kv, D]
    value_cache_ptr,
    key_scales_ptr,  # [N, bs, H_kv] float32 (QUANTIZED only)
    value_scales_ptr,
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    query_start_ptr,  # [B + 1]
    tile_seq_ptr,  # [num_tiles] sequence of each tile; num_seqs or more: an empty tile
    tile_first_ptr,  # [num_tiles] first query (within its sequence) of each tile
    out_ptr,  # [T, H_q, D]
    qk_scale,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUANTIZED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (tile, kv head): BLOCK_Q consecutive new tokens of one sequence × the GROUP
    query heads of the kv head, as BLOCK_Q * BLOCK_G rows (row r: token r // BLOCK_G,
    member r % BLOCK_G), over the cached prefix and the new tokens, causally, BLOCK_N keys
    at a time."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    if seq >= num_seqs:
        return
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    first_query = tl.load(tile_first_ptr + tile)
    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    tokens = first_query + rows // BLOCK_G  # within the sequence's new tokens
    members = rows % BLOCK_G
    row_mask = (tokens < query_len) & (members < GROUP)
    heads = kv_head * GROUP + members
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    row_offsets = (query_start + tokens).to(tl.int64) * stride_qt + heads * stride_qh
    query = tl.load(
        query_ptr + row_offsets[:, None] + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_Q * BLOCK_G, BLOCK_D]
    query_pos = context_len + tokens  # absolute positions
    last_pos = context_len + tl.minimum(first_query + BLOCK_Q, query_len) - 1
    first = 0
    if USE_WINDOW:
        first = tl.maximum(context_len + first_query - window + 1, 0) // BLOCK_N * BLOCK_N
    table = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_Q * BLOCK_G], NO_MAX, tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for start in range(first, last_pos + 1, BLOCK_N):
        positions = start + offsets
        in_seq = positions <= last_pos
        keys, values = _load_kv(
            key_cache_ptr, value_cache_ptr, key_scales_ptr, value_scales_ptr, table, positions,
            in_seq, kv_head, dims, dim_mask, stride_cb, stride_cs, stride_ch, stride_sb,
            stride_ss, BLOCK_SIZE, QUANTIZED, query.dtype,
        )  # fmt: skip
        visible = positions[None, :] <= query_pos[:, None]
        if USE_WINDOW:
            visible = visible & (positions[None, :] > query_pos[:, None] - window)
        m_i, l_i, acc = _softmax_step(query, keys, values, visible, m_i, l_i, acc, qk_scale, UPCAST)
    out_offsets = (query_start + tokens).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(
        out_ptr + out_offsets[:, None] + dims[None, :],
        _normalize(acc, l_i).to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )
