"""Every paged-attention backend against attention computed one sequence at a time.

"sdpa" is the pure-PyTorch reference; "cpu" runs the C kernel (kernels/cpu_attention.c)
on these CPU tensors. tests/kernels/test_cpu_attention.py covers the kernel's build and
its fallbacks.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textgate.kernels import (
    AttentionMetadata,
    CpuAttentionBackend,
    SdpaAttentionBackend,
    get_attention_backend,
    register_attention_backend,
)
from textgate.shard_server.step.kv_cache import KVCache

DIM = 8
BACKENDS = ["sdpa", "cpu"]


def naive_attention(q, k, v, context: int, window: int | None) -> torch.Tensor:
    """q [S, Hq, D] at positions context.., over k/v [L, Hkv, D]: causal softmax attention."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("shd,lhd->hsl", q.double(), k.double()) / math.sqrt(q.shape[-1])
    query_pos = torch.arange(q.shape[0])[:, None] + context
    key_pos = torch.arange(k.shape[0])[None, :]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hsl,lhd->shd", scores.softmax(-1), v.double()).float()


def run_case(
    query_lens: list[int],
    context_lens: list[int],
    heads: int = 4,
    kv_heads: int = 2,
    block_size: int = 4,
    window: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    backend_name: str = "sdpa",
    dim: int = DIM,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for needed in blocks_needed:
        tables.append([order.pop() for _ in range(needed)])
    cache = KVCache.allocate(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype=dtype,
    )
    keys = [torch.randn(n, kv_heads, dim, generator=generator).to(dtype) for n in seq_lens]
    values = [torch.randn(n, kv_heads, dim, generator=generator).to(dtype) for n in seq_lens]
    # Write every token, prefix included, the way earlier steps would have.
    full = AttentionMetadata.build(
        query_lens=seq_lens,
        context_lens=[0] * len(seq_lens),
        block_tables=tables,
        block_size=block_size,
    )
    cache.store(0, torch.cat(keys), torch.cat(values), full.slot_mapping)
    # Pad block tables with -1 past each sequence's blocks, as a caller may.
    width = max(blocks_needed) + 1
    metadata = AttentionMetadata.build(
        query_lens=query_lens, context_lens=context_lens, block_tables=tables, block_size=block_size
    )
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    metadata = AttentionMetadata(
        metadata.query_start_loc,
        metadata.seq_lens,
        padded,
        metadata.slot_mapping,
        metadata.max_seqlen_q,
        metadata.max_seqlen_k,
    )
    queries = torch.randn(sum(query_lens), heads, dim, generator=generator).to(dtype)
    backend = get_attention_backend(backend_name)
    out = backend.forward(
        queries,
        *cache.layer(0),
        backend.prepare(metadata),
        scale=dim**-0.5,
        sliding_window=window,
    )
    assert out.shape == queries.shape
    assert out.dtype == dtype
    # bf16: inputs are exact in both; the kernels round scores (SDPA) or outputs to bf16.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    starts = metadata.query_start_loc.tolist()
    for b, context in enumerate(context_lens):
        expected = naive_attention(
            queries[starts[b] : starts[b + 1]].float(),
            keys[b].float(),
            values[b].float(),
            context,
            window,
        )
        torch.testing.assert_close(
            out[starts[b] : starts[b + 1]].float(), expected, atol=tol, rtol=tol
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([7], [0]),  # one prompt
        ([5, 9, 1], [0, 0, 0]),  # prompts of several lengths
        ([6, 6], [0, 0]),  # prompts of one length: SDPA's own causal mask
        ([4, 6], [8, 3]),  # prompts over cached prefixes (prefix hits, chunked prefill)
        ([1, 1, 1], [4, 17, 9]),  # pure decode
        ([1, 6, 1, 3, 2], [12, 0, 3, 5, 0]),  # everything at once
    ],
    ids=["prefill", "prefills", "equal-prefills", "prefix", "decode", "mixed"],
)
def test_matches_per_sequence_attention(
    query_lens, context_lens, heads, kv_heads, block_size, backend
):
    run_case(query_lens, context_lens, heads, kv_heads, block_size, backend_name=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (6, 1)])
@pytest.mark.parametrize(
    "context_lens",
    [[5], [7, 7, 7], [3, 30, 0, 12, 17]],
    ids=["one", "equal-lengths-no-mask", "ragged"],
)
def test_decode_matches_per_sequence_attention(context_lens, heads, kv_heads, dtype, backend):
    run_case(
        [1] * len(context_lens), context_lens, heads, kv_heads, 4, dtype=dtype, backend_name=backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 80])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([40, 1, 1, 23], [0, 50, 7, 30]),
        ([1] * 6, [3, 90, 17, 4, 60, 33]),
        ([150, 1, 40, 2], [20, 200, 0, 130]),
    ],
    ids=["mixed-prompts", "decode", "long-chunks"],
)
def test_model_head_sizes(query_lens, context_lens, dim, dtype, backend):
    # 64 and 128 take the kernel's specialized paths; prompts longer than its 16-row chunks.
    run_case(query_lens, context_lens, 9, 3, 16, dtype=dtype, backend_name=backend, dim=dim)


def test_decode_needs_no_mask_only_when_every_sequence_is_max_k_long():
    def decode_mask(context_lens: list[int], window: int | None = None) -> torch.Tensor | None:
        metadata = AttentionMetadata.build(
            query_lens=[1] * len(context_lens),
            context_lens=context_lens,
            block_tables=[[0, 1, 2]] * len(context_lens),
            block_size=4,
        )
        (group,) = SdpaAttentionBackend().prepare(metadata).groups
        return group.mask(2, window, torch.float32)

    assert decode_mask([5, 5]) is None
    assert decode_mask([5, 5], window=3) is not None
    mask = decode_mask([5, 2])
    assert mask is not None
    assert mask.shape == (2, 1, 1, 6)
    assert torch.isinf(mask[1, 0, 0, 3:]).all() and not mask[1, 0, 0, :3].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([9], [0]), ([1, 1], [10, 3]), ([1, 5, 2], [12, 0, 7]), ([37], [5])],
    ids=["prefill", "decode", "mixed", "chunks-past-window"],
)
def test_sliding_window(query_lens, context_lens, window, backend):
    run_case(query_lens, context_lens, window=window, backend_name=backend)


@settings(max_examples=80, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([1, 2, 3]),
    window=st.one_of(st.none(), st.integers(1, 10)),
    backend=st.sampled_from(BACKENDS),
)
def test_any_batch_matches_per_sequence_attention(seqs, block_size, group, window, backend):
    query_lens, context_lens = [q for q, _ in seqs], [c for _, c in seqs]
    run_case(query_lens, context_lens, 2 * group, 2, block_size, window, backend_name=backend)


def test_metadata_build_maps_tokens_to_slots_and_positions():
    md = AttentionMetadata.build(
        query_lens=[3, 1], context_lens=[0, 5], block_tables=[[7], [2, 4]], block_size=4
    )
    assert md.query_start_loc.tolist() == [0, 3, 4]
    assert md.cu_seqlens_q is md.query_start_loc
    assert md.seq_lens.tolist() == [3, 6]
    assert md.slot_mapping.tolist() == [28, 29, 30, 4 * 4 + 1]
    assert md.block_tables.tolist() == [[7, 0], [2, 4]]
    assert (md.max_seqlen_q, md.max_seqlen_k, md.num_seqs, md.num_tokens) == (3, 6, 2, 4)
    assert md.positions().tolist() == [0, 1, 2, 5]
    assert md.token_seq_index().tolist() == [0, 0, 0, 1]
    assert md.context_lens().tolist() == [0, 5]


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "tables", "match"),
    [
        ([3], [2], [[0]], "cannot hold"),
        ([0], [2], [[0]], "no new tokens"),
        ([1, 1], [0], [[0], [1]], "differ in length"),
    ],
)
def test_metadata_build_rejects_inconsistent_input(query_lens, context_lens, tables, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(
            query_lens=query_lens, context_lens=context_lens, block_tables=tables, block_size=4
        )


def test_registry():
    assert isinstance(get_attention_backend(), CpuAttentionBackend)
    assert isinstance(get_attention_backend("cpu"), CpuAttentionBackend)
    assert isinstance(get_attention_backend("sdpa"), SdpaAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'paged'"):
        get_attention_backend("paged")
    with pytest.raises(ValueError, match="already registered"):
        register_attention_backend("sdpa")(SdpaAttentionBackend)


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "group_shapes"),
    [
        ([1, 1], [3, 7], [(2, 1, 8)]),
        ([4, 2], [0, 5], [(2, 4, 7)]),
        ([1, 4, 1], [9, 0, 2], [(2, 1, 10), (1, 4, 4)]),
    ],
)
def test_plan_batches_decodes_apart_from_prefills(query_lens, context_lens, group_shapes):
    metadata = AttentionMetadata.build(
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=[[0, 1, 2]] * len(query_lens),
        block_size=4,
    )
    plan = SdpaAttentionBackend().prepare(metadata)
    assert [(g.num_seqs, g.max_q, g.max_k) for g in plan.groups] == group_shapes
