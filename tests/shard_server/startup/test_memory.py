"""KV-cache sizing on a GPU, with injected memory numbers: the arithmetic and the warmup flow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from textgate.shard_server.startup.memory import (
    MemoryProfile,
    agree_on_blocks,
    kv_cache_budget,
    measure_warmup,
    num_kv_blocks,
)
from textgate.tests.fake_group import FakeGroup

GiB = 1 << 30


def test_budget_is_free_times_fraction_minus_the_step_peak_and_the_graph_pool() -> None:
    profile = MemoryProfile(free_bytes=100 * GiB, activation_bytes=6 * GiB, graph_bytes=1 * GiB)
    assert kv_cache_budget(profile, 0.9) == 90 * GiB - 7 * GiB
    assert kv_cache_budget(profile, 1.0) == 93 * GiB
    no_graphs = MemoryProfile(free_bytes=100 * GiB, activation_bytes=6 * GiB)
    assert kv_cache_budget(no_graphs, 0.5) == 44 * GiB


def test_an_8b_model_on_an_h200_keeps_about_900k_tokens_of_cache() -> None:
    # 143 GiB card, 15 GiB of bf16 weights, ~2 GiB peak for an 8k-token prefill.
    profile = MemoryProfile(free_bytes=127 * GiB, activation_bytes=2 * GiB, graph_bytes=GiB // 4)
    per_block = 2 * 32 * 16 * 8 * 128 * 2  # K+V x 32 layers x 16 slots x 8 kv heads x 128 x bf16
    blocks = num_kv_blocks(kv_cache_budget(profile, 0.9), per_block, reserved_blocks=1)
    assert blocks == int(127 * 0.9 * GiB - 2.25 * GiB) // per_block - 1
    assert 900_000 < blocks * 16 < 950_000  # tokens: 128 KiB each


def test_nothing_left_is_a_clear_error() -> None:
    tight = MemoryProfile(free_bytes=10 * GiB, activation_bytes=9 * GiB, graph_bytes=GiB)
    with pytest.raises(ValueError, match=r"no GPU memory is left for the KV cache.*9\.00 GiB"):
        kv_cache_budget(tight, 0.9)
    with pytest.raises(ValueError, match="holds no block"):
        num_kv_blocks(1000, 600, reserved_blocks=1)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kv_cache_budget(tight, 0.0)
    with pytest.raises(ValueError, match="negative"):
        kv_cache_budget(MemoryProfile(GiB, -1), 0.9)


class FakeDevice:
    """An allocator whose counters move as the injected passes 'allocate'."""

    def __init__(self, total: int, allocated: int) -> None:
        self.total, self.allocated, self.peak, self.cached = total, allocated, allocated, 0
        self.events: list[str] = []

    def alloc(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def free(self, size: int) -> None:
        self.allocated -= size
        self.cached += size  # the caching allocator keeps it until release_cached

    def free_bytes(self) -> int:
        return self.total - self.allocated - self.cached

    def allocated_bytes(self) -> int:
        return self.allocated

    def peak_bytes(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def release_cached(self) -> None:
        self.cached = 0
        self.events.append("release")


def test_measure_warmup_reads_each_pass_peak_after_freeing_the_provisional_cache() -> None:
    device = FakeDevice(total=80 * GiB, allocated=16 * GiB + GiB)  # weights + provisional cache

    def prefill() -> None:  # 3 GiB of activations at its peak, all freed after
        device.alloc(3 * GiB)
        device.free(3 * GiB)

    def decode() -> None:
        device.alloc(GiB // 2)
        device.free(GiB // 2)

    profile = measure_warmup(device, prefill, decode, lambda: device.free(GiB), with_graphs=True)
    assert profile == MemoryProfile(
        free_bytes=64 * GiB, activation_bytes=3 * GiB, graph_bytes=GiB // 2
    )
    assert device.events[-1] == "release"  # free memory was read with the cache released
    without = measure_warmup(device, prefill, decode, lambda: None, with_graphs=False)
    assert without.graph_bytes == 0 and without.activation_bytes == 3 * GiB


def test_ranks_agree_on_the_smallest_block_count(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    assert agree_on_blocks(1234, None, torch.device("cpu")) == 1234
    group = FakeGroup(0, 2)
    seen = []

    def all_reduce(tensor: torch.Tensor, op: object, group: object) -> None:
        seen.append((op, group))
        tensor.clamp_(max=1000)  # the other rank measured 1000 blocks

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert agree_on_blocks(1234, group, torch.device("cpu")) == 1000
    assert seen == [(dist.ReduceOp.MIN, group)]


def test_paged_warmup_pass_runs_in_a_provisional_cache_then_sizes_from_free_memory(
    tiny_model_dir: Path,
) -> None:
    from textgate.proto import generate_pb2 as pb
    from textgate.shard_server.loading.shard_loader import load_model
    from textgate.shard_server.protocols.paged_model import CacheConfig, PagedModel

    config = CacheConfig(block_size=4, cuda_memory_fraction=0.5, cuda_graphs=(1, 2, 48))
    paged = load_model(tiny_model_dir, "tiny", "float32", cache_config=config)
    assert isinstance(paged, PagedModel)
    MiB = 1 << 20
    seen: list[object] = []

    class Stats:
        """Each pass 'peaks' above the baseline: the prefill at 3 MiB, the decode at 1 MiB."""

        def __init__(self) -> None:
            self.peaks = [3 * MiB, MiB]

        def free_bytes(self) -> int:
            seen.append(("free", paged.kv_cache))
            return 64 * MiB

        def allocated_bytes(self) -> int:
            return 100 * MiB

        def peak_bytes(self) -> int:
            assert paged.kv_cache is not None
            seen.append(("peak", paged.kv_cache.num_blocks))
            return 100 * MiB + self.peaks.pop(0)

        def reset_peak(self) -> None:
            pass

        def release_cached(self) -> None:
            pass

    request = pb.WarmupRequest(max_prefill_tokens=40, max_batch_size=8)
    blocks = paged._profiled_num_blocks(request, reserved=1, stats=Stats())
    # Provisional: max(40 tokens / 4, the largest batch: 48 (a graph size) > 8) + scratch.
    assert seen == [("peak", 49), ("peak", 49), ("free", None)]
    budget = 32 * MiB - 3 * MiB - MiB  # free x 0.5, the step peak, the graph pool
    assert blocks == budget // paged.bytes_per_block() - 1
