"""Size the KV cache on a GPU from what a real warmup pass left free.

After the weights are loaded, the shard runs its largest steps once in a small
provisional cache: a prefill of the router's step budget and a decode step at the
largest batch (`PagedModel.warmup`). The allocator's peak over that pass, above what was
allocated before it, is the transient memory (activations, workspaces) every later step
may need again. The provisional cache is then freed and the cache gets

    budget = free × --cuda-memory-fraction − activation peak − graph pool

where `free` is the device's free memory at that moment and the graph pool (with CUDA
graphs on) is the decode pass's own peak: the captured graphs keep that much in their
private pool. The arithmetic is `kv_cache_budget`, a pure function; `measure_warmup`
runs the pass against `MemoryStats` (torch.cuda's counters, or a fake in tests).
With several shards every rank measures its own device and all take the smallest count
(`agree_on_blocks`): block tables are shared, so the caches must hold the same blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

GiB = float(1 << 30)


@dataclass(frozen=True)
class MemoryProfile:
    """What the warmup pass measured, in bytes."""

    free_bytes: int
    """Device memory free after the pass, its provisional cache freed."""
    activation_bytes: int
    """The pass's peak allocation above what was allocated before it."""
    graph_bytes: int = 0
    """Memory to leave for the CUDA graphs' private pool (0 without graphs)."""


def kv_cache_budget(profile: MemoryProfile, memory_fraction: float) -> int:
    """Bytes the KV cache may take: free × fraction − activation peak − graph pool.

    Raises ValueError when nothing is left, naming the numbers and what to change.
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must lie in (0, 1], got {memory_fraction}")
    if min(profile.free_bytes, profile.activation_bytes, profile.graph_bytes) < 0:
        raise ValueError(f"memory counts cannot be negative: {profile}")
    budget = int(profile.free_bytes * memory_fraction) - profile.activation_bytes
    budget -= profile.graph_bytes
    if budget <= 0:
        raise ValueError(
            f"no GPU memory is left for the KV cache: {profile.free_bytes / GiB:.2f} GiB free "
            f"× --cuda-memory-fraction {memory_fraction} minus the warmup step's peak of "
            f"{profile.activation_bytes / GiB:.2f} GiB and {profile.graph_bytes / GiB:.2f} GiB "
            "for CUDA graphs; lower --max-batch-prefill-tokens, --cuda-graphs or "
            "--max-batch-size, raise --cuda-memory-fraction, or add shards"
        )
    return budget


def num_kv_blocks(budget_bytes: int, bytes_per_block: int, reserved_blocks: int = 0) -> int:
    """Blocks the router may hand out from `budget_bytes`, after `reserved_blocks` that
    the shard keeps for itself (the CUDA graphs' scratch block)."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    blocks = budget_bytes // bytes_per_block - reserved_blocks
    if blocks < 1:
        raise ValueError(
            f"the KV cache budget of {budget_bytes / GiB:.3f} GiB holds no block of "
            f"{bytes_per_block} bytes beside {reserved_blocks} reserved"
        )
    return blocks


class MemoryStats(Protocol):
    """The allocator counters `measure_warmup` reads."""

    def free_bytes(self) -> int: ...

    def allocated_bytes(self) -> int: ...

    def peak_bytes(self) -> int: ...

    def reset_peak(self) -> None: ...

    def release_cached(self) -> None: ...


class CudaMemoryStats:
    """`MemoryStats` of one CUDA device through torch.cuda."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def free_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free)

    def allocated_bytes(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def measure_warmup(
    stats: MemoryStats,
    prefill_pass: Callable[[], Any],
    decode_pass: Callable[[], Any],
    free_provisional: Callable[[], None],
    *,
    with_graphs: bool,
) -> MemoryProfile:
    """Run the warmup passes, free the provisional cache, and report what they needed.

    `prefill_pass` and `decode_pass` each run one step (and wait for it); the decode
    pass's own peak is what graphs keep in their pool.
    """
    stats.release_cached()
    stats.reset_peak()
    baseline = stats.allocated_bytes()
    prefill_pass()
    prefill_peak = stats.peak_bytes() - baseline
    stats.reset_peak()
    baseline_decode = stats.allocated_bytes()
    decode_pass()
    decode_peak = stats.peak_bytes() - baseline_decode
    free_provisional()
    stats.release_cached()
    return MemoryProfile(
        free_bytes=stats.free_bytes(),
        activation_bytes=max(prefill_peak, decode_peak, 0),
        graph_bytes=max(decode_peak, 0) if with_graphs else 0,
    )


def agree_on_blocks(num_blocks: int, group: Any, device: torch.device) -> int:
    """The smallest block count over the process group (as is without one)."""
    if group is None:
        return num_blocks
    import torch.distributed as dist

    count = torch.tensor([num_blocks], dtype=torch.int64, device=device)  # nccl: on the GPU
    dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
    return int(count.item())
