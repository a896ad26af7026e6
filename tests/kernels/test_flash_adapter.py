"""The flash-attn adapter's plumbing (cu_seqlens, block tables, cache layout, causal and
window conventions), against the SDPA reference, through a fake `flash_attn` module.

flash-attn needs CUDA, so the fake implements its two entry points in plain PyTorch from
their documented semantics (paged k/v [num_blocks, page_size, H_kv, D] read through an
int32 block_table; causal masks aligned to the bottom right; window_size=(left, right)
around that diagonal) with their real signatures: a wrong argument, dtype or mapping fails.
Also: how `--attention` resolves (auto, and the errors for what cannot run).
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import pytest
import torch

from textgate.kernels import (
    AttentionMetadata,
    SdpaAttentionBackend,
    attention_backend_name,
    attention_unavailable_reason,
    get_attention_backend,
    select_attention_backend,
)
from textgate.kernels import flash as flash_module
from textgate.kernels import triton as triton_package
from textgate.kernels.flash import FlashAttentionBackend


def _attend(q, keys, values, scale, causal, window):
    """q [sq, H, D] over keys/values [sk, H_kv, D] with flash-attention's mask rules."""
    sq, heads, dim = q.shape
    sk, kv_heads = keys.shape[0], keys.shape[1]
    scale = dim**-0.5 if scale is None else scale
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # head h reads kv head h // group
    values = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * scale
    diagonal = torch.arange(sq)[:, None] + sk - sq  # the key each query is aligned to
    key_pos = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= key_pos <= diagonal
    left, right = window
    if left >= 0:
        keep &= key_pos >= diagonal - left
    if right >= 0:
        keep &= key_pos <= diagonal + right
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values.float()).to(q.dtype)


def _paged(cache, table_row, length):
    """The first `length` slots of one sequence: cache [N, page, H, D] → [length, H, D]."""
    page = cache.shape[1]
    blocks = table_row[: math.ceil(length / page)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


def fake_flash_attn() -> types.ModuleType:
    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.calls = []

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        module.calls.append("varlen")
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert block_table is not None and block_table.dtype == torch.int32
        assert k.dim() == 4 and k.shape == v.shape, "paged k/v [num_blocks, page, H_kv, D]"
        assert q.dim() == 3 and dropout_p == 0.0
        out = torch.empty_like(q)
        for b in range(len(cu_seqlens_q) - 1):
            q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            assert q1 - q0 <= max_seqlen_q and seqlen_k <= max_seqlen_k
            keys = _paged(k, block_table[b], seqlen_k)
            values = _paged(v, block_table[b], seqlen_k)
            out[q0:q1] = _attend(q[q0:q1], keys, values, softmax_scale, causal, window_size)
        return out

    def flash_attn_with_kvcache(
        q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
        cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
        rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
    ):  # fmt: skip
        module.calls.append("kvcache")
        assert k is None and v is None, "the model stores new keys itself"
        assert q.dim() == 4, "q [B, seqlen, H, D]"
        assert cache_seqlens.dtype == torch.int32 and block_table.dtype == torch.int32
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            length = int(cache_seqlens[b])
            keys = _paged(k_cache, block_table[b], length)
            values = _paged(v_cache, block_table[b], length)
            out[b] = _attend(q[b], keys, values, softmax_scale, causal, window_size)
        return out

    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


@pytest.fixture
def fake_flash(monkeypatch):
    module = fake_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


def random_step(query_lens, context_lens, block_size, heads, kv_heads, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    counts = [math.ceil(length / block_size) for length in lengths]
    ids = torch.randperm(sum(counts) + 2, generator=gen).tolist()
    # Rows of different widths: padding past a sequence's blocks, as the shard sends.
    tables = [[ids.pop() for _ in range(count)] for count in counts]
    metadata = AttentionMetadata.build(
        query_lens=query_lens, context_lens=context_lens, block_tables=tables, block_size=block_size
    )
    shape = (sum(counts) + 2, block_size, kv_heads, 16)
    keys = torch.randn(shape, generator=gen).to(dtype)
    values = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), heads, 16, generator=gen).to(dtype)
    return metadata, query, keys, values


def reference(metadata, query, keys, values, window=None):
    sdpa = SdpaAttentionBackend()
    out = sdpa.forward(
        query.float(), keys.float(), values.float(), sdpa.prepare(metadata), scale=0.25,
        sliding_window=window,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "entry"),
    [
        ([1, 1, 1], [0, 17, 40], "kvcache"),  # decode: ragged, partial last blocks
        ([7, 12], [0, 0], "varlen"),  # whole prompts
        ([5, 1, 9], [20, 33, 3], "varlen"),  # prefix-cached chunks with a decode mixed in
    ],
)
@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "dtype"),
    [(16, 4, 2, torch.bfloat16), (32, 4, 4, torch.float16), (64, 8, 2, torch.bfloat16)],
)
def test_adapter_matches_sdpa(
    fake_flash, monkeypatch, query_lens, context_lens, entry, block_size, heads, kv_heads, dtype
):
    monkeypatch.setattr(FlashAttentionBackend, "page_size_multiple", 16)
    metadata, query, keys, values = random_step(
        query_lens, context_lens, block_size, heads, kv_heads, dtype
    )
    backend = FlashAttentionBackend()
    out = backend.forward(query, keys, values, backend.prepare(metadata), scale=0.25)
    assert fake_flash.calls == [entry]
    assert out.shape == query.shape and out.dtype == dtype
    expected = reference(metadata, query, keys, values)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("query_lens", "context_lens"), [([1, 1], [30, 6]), ([6, 4], [13, 0])])
def test_sliding_window_maps_to_window_size(fake_flash, monkeypatch, query_lens, context_lens):
    monkeypatch.setattr(FlashAttentionBackend, "page_size_multiple", 16)
    metadata, query, keys, values = random_step(query_lens, context_lens, 16, 4, 2, torch.float16)
    backend = FlashAttentionBackend()
    out = backend.forward(
        query, keys, values, backend.prepare(metadata), scale=0.25, sliding_window=5
    )
    expected = reference(metadata, query, keys, values, window=5)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


def test_default_pages_of_256(fake_flash):
    metadata, query, keys, values = random_step([3, 1], [300, 0], 256, 2, 1, torch.bfloat16)
    backend = FlashAttentionBackend()
    out = backend.forward(query, keys, values, backend.prepare(metadata), scale=0.25)
    torch.testing.assert_close(
        out.float(), reference(metadata, query, keys, values), atol=2e-2, rtol=2e-2
    )


def test_refuses_what_flash_attn_cannot_read(fake_flash, monkeypatch):
    backend = FlashAttentionBackend()
    metadata, query, keys, values = random_step([2], [3], 16, 2, 1, torch.bfloat16)
    plan = backend.prepare(metadata)
    with pytest.raises(ValueError, match="multiple of 256, got 16"):
        backend.forward(query, keys, values, plan, scale=0.25)
    monkeypatch.setattr(FlashAttentionBackend, "page_size_multiple", 16)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        backend.forward(query.float(), keys.float(), values.float(), plan, scale=0.25)
    scales = torch.ones(keys.shape[:3])
    with pytest.raises(ValueError, match="no quantized KV cache"):
        backend.forward(query, keys, values, plan, scale=0.25, key_scales=scales)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: import fails
    with pytest.raises(RuntimeError, match="needs the 'flash-attn' package"):
        FlashAttentionBackend().forward(query, keys, values, plan, scale=0.25)
    assert fake_flash.calls == []


def test_auto_prefers_flash_then_triton_on_cuda(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(flash_module, "flash_attn_installed", lambda: True)
    assert select_attention_backend("auto", cuda, torch.bfloat16, 256) == "flash"
    # flash-attn cannot: 16-slot blocks, float32, a quantized cache → triton.
    assert select_attention_backend("auto", cuda, torch.bfloat16, 16) == "triton"
    assert select_attention_backend("auto", cuda, torch.float32, 256) == "triton"
    assert select_attention_backend("auto", cuda, torch.bfloat16, 256, quantized_kv=True) == (
        "triton"
    )
    monkeypatch.setattr(flash_module, "flash_attn_installed", lambda: False)
    assert select_attention_backend("auto", cuda, torch.bfloat16, 256) == "triton"
    assert select_attention_backend("auto", cuda, torch.bfloat16, 8) == "triton"  # any size
    # Without triton: the PyTorch reference.
    monkeypatch.setattr(triton_package, "triton_installed", lambda: False)
    assert select_attention_backend("auto", cuda, torch.bfloat16, 16) == "torch"
    assert select_attention_backend("auto", "cpu", torch.bfloat16, 16) == "cpu"


def test_a_named_backend_that_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(flash_module, "flash_attn_installed", lambda: False)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"--attention flash cannot run here: .*not installed"):
        select_attention_backend("flash", cuda, torch.bfloat16, 256)
    with pytest.raises(ValueError, match="flash-attn runs on CUDA GPUs only"):
        select_attention_backend("flash", "cpu", torch.bfloat16, 256)
    with pytest.raises(ValueError, match="--attention cpu cannot run here"):
        select_attention_backend("cpu", cuda, torch.bfloat16, 16)
    with pytest.raises(
        ValueError, match=r"compute in float16/bfloat16/float32, not torch\.float64"
    ):
        select_attention_backend("triton", cuda, torch.float64, 16)
    with pytest.raises(ValueError, match="unknown attention backend 'paged'"):
        select_attention_backend("paged", "cpu", torch.float32, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton kernels need a CUDA device"):
        select_attention_backend("triton", "cpu", torch.float32, 16)
    assert select_attention_backend("torch", cuda, torch.float32, 8) == "torch"
    assert attention_unavailable_reason("cpu", "cpu", torch.float32, 16, quantized_kv=True) is None


def test_backends_report_their_registered_name():
    assert attention_backend_name(SdpaAttentionBackend()) == "torch"
    assert attention_backend_name(FlashAttentionBackend()) == "flash"
    assert attention_backend_name(get_attention_backend("triton")) == "triton"
    assert attention_backend_name(get_attention_backend("cpu")) == "cpu"


@pytest.mark.parametrize(("flag", "expected"), [("auto", "cpu"), ("torch", "torch")])
def test_the_shard_runs_and_reports_the_resolved_backend(tiny_model_dir, flag, expected):
    from textgate.shard_server.loading.shard_loader import load_model

    model = load_model(tiny_model_dir, "tiny", "float32", attention=flag)
    assert attention_backend_name(model.model.attention_backend) == expected
    assert model.describe().attention_backend == expected  # InfoResponse, then /info
