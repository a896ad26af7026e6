"""The CPU attention backend: routing, fallbacks, threads (its numbers: test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from textgate.kernels import (
    AttentionMetadata,
    CpuAttentionBackend,
    SdpaAttentionBackend,
    cpu_build,
)
from textgate.kernels.cpu_build import load_library


def decode_step(dtype: torch.dtype = torch.float32, num_seqs: int = 6):
    """query, key cache, value cache and metadata of a decode step over random blocks."""
    generator = torch.Generator().manual_seed(0)
    block_size, kv_heads, dim, num_blocks = 16, 2, 64, 5 * num_seqs
    cache_shape = (num_blocks, block_size, kv_heads, dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, 5).tolist()
    metadata = AttentionMetadata.build(
        query_lens=[1] * num_seqs,
        context_lens=[3 * i + 2 for i in range(num_seqs)],
        block_tables=tables,
        block_size=block_size,
    )
    query = torch.randn(num_seqs, 2 * kv_heads, dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, metadata


def attend(backend, step) -> torch.Tensor:
    query, key_cache, value_cache, metadata = step
    return backend.forward(
        query, key_cache, value_cache, backend.prepare(metadata), scale=0.125, sliding_window=None
    )


def test_cpu_tensors_run_the_kernel(monkeypatch):
    library = load_library()
    assert library is not None
    calls = []
    kernel = library.textgate_paged_attention

    class Spy:
        def textgate_paged_attention(self, *args):
            calls.append(args)
            return kernel(*args)

    monkeypatch.setattr(cpu_build, "load_library", lambda: Spy())
    for dtype in (torch.float32, torch.bfloat16):
        step = decode_step(dtype)
        expected = attend(SdpaAttentionBackend(), step)
        out = attend(CpuAttentionBackend(), step)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    assert len(calls) == 2


def test_decodes_and_short_sequences_run_on_the_kernel_long_chunks_on_sdpa():
    metadata = AttentionMetadata.build(
        query_lens=[1, 120, 30, 1, 5, 9],
        context_lens=[300, 0, 60, 4, 100, 100],
        block_tables=[list(range(i * 20, i * 20 + 20)) for i in range(6)],
        block_size=16,
    )
    plan = CpuAttentionBackend().prepare(metadata)
    assert plan.kernel is not None
    # Decodes at any length, also with up to 7 drafts (queries of at most 8 rows), and
    # sequences of at most kernel_max_seq_len (96) tokens.
    assert plan.kernel.query_starts.tolist() == [0, 121, 151, 152]
    assert plan.kernel.query_lens.tolist() == [1, 30, 1, 5]
    assert plan.kernel.seq_lens.tolist() == [301, 90, 5, 105]
    assert plan.kernel.max_seq_len == 301
    (group,) = plan.sdpa_groups
    assert group.token_index is not None
    assert group.token_index.tolist() == [*range(1, 121), *range(157, 166)]


class KernelOnly(CpuAttentionBackend):
    kernel_max_seq_len = 10**9


@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_alone_handles_long_chunks_too(window, dtype):
    generator = torch.Generator().manual_seed(1)
    query_lens, context_lens = [70, 1, 33], [90, 150, 0]
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(3)]
    metadata = AttentionMetadata.build(
        query_lens=query_lens, context_lens=context_lens, block_tables=tables, block_size=16
    )
    caches = [torch.randn(48, 16, 2, 64, generator=generator).to(dtype) for _ in range(2)]
    query = torch.randn(sum(query_lens), 6, 64, generator=generator).to(dtype)
    kernel_only = KernelOnly()
    plan = kernel_only.prepare(metadata)
    assert not plan.sdpa_groups
    out = kernel_only.forward(query, *caches, plan, scale=0.125, sliding_window=window)
    sdpa = SdpaAttentionBackend()
    expected = sdpa.forward(
        query, *caches, sdpa.prepare(metadata), scale=0.125, sliding_window=window
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_other_dtypes_run_sdpa(monkeypatch):
    def no_kernel():
        raise AssertionError("the kernel was asked for a float16 step")

    monkeypatch.setattr(cpu_build, "load_library", no_kernel)
    step = decode_step(torch.float16)
    assert torch.equal(attend(CpuAttentionBackend(), step), attend(SdpaAttentionBackend(), step))


def test_without_a_compiler_it_runs_sdpa(monkeypatch, fresh_library, caplog):
    monkeypatch.setattr(cpu_build, "compiler", lambda: None)
    step = decode_step()
    with caplog.at_level("WARNING", logger="textgate.kernels"):
        out = attend(CpuAttentionBackend(), step)
    assert torch.equal(out, attend(SdpaAttentionBackend(), step))
    assert "no C compiler found" in caplog.text


def test_a_failing_build_runs_sdpa(monkeypatch, fresh_library, tmp_path, caplog):
    monkeypatch.setenv("TEXTGATE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1 for every command line
    step = decode_step()
    with caplog.at_level("WARNING", logger="textgate.kernels"):
        out = attend(CpuAttentionBackend(), step)
    assert torch.equal(out, attend(SdpaAttentionBackend(), step))
    assert "CPU kernels unavailable" in caplog.text


def test_results_do_not_depend_on_the_thread_count():
    step = decode_step(num_seqs=24)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(CpuAttentionBackend(), step)
        torch.set_num_threads(2)
        two = attend(CpuAttentionBackend(), step)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
