"""Warmup helpers of a paged shard: whether decode graphs are recorded, and a shapes-only
forward pass over consecutive blocks of the cache (memory profiling, graph warmup)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from textgate.kernels import AttentionMetadata
from textgate.shard_server.step.cuda_graphs import CudaGraphCapture, GraphCapture, graph_safe
from textgate.shard_server.step.kv_cache import KVCache

log = logging.getLogger("textgate.shard")


def pick_graph_capture(
    sizes: tuple[int, ...],
    override: GraphCapture | None,
    device: torch.device,
    attention_backend: Any,
) -> GraphCapture | None:
    """How a shard records decode graphs of `sizes`, or None when it runs every step eager.

    `override` (tests) wins whenever sizes are asked for; otherwise real CUDA graphs on a
    GPU with a backend that reads step lengths on the device.
    """
    if not sizes:
        return None
    if override is not None:
        return override
    if device.type != "cuda":
        log.info("--cuda-graphs ignored: CUDA graphs need a GPU, this shard runs on CPU")
        return None
    if not graph_safe(attention_backend):
        log.info(
            "CUDA graphs off: the %s attention backend reads step lengths on the host "
            "(graphs need a backend that reads them on the GPU)",
            type(attention_backend).__name__,
        )
        return None
    return CudaGraphCapture(device)


def warmup_pass(
    model: Any, kv_cache: KVCache, query_lens: list[int], block_size: int, device: torch.device
) -> None:
    """One step of sequences with `query_lens` new tokens each from position 0, in
    consecutive blocks of `kv_cache` (values are irrelevant: shapes only)."""
    tables, first = [], 0
    for length in query_lens:
        count = -(-length // block_size)
        tables.append(list(range(first, first + count)))
        first += count
    metadata = AttentionMetadata.build(
        query_lens=query_lens,
        context_lens=[0] * len(query_lens),
        block_tables=tables,
        block_size=block_size,
        device=device,
    )
    ends = torch.tensor(query_lens).cumsum(0) - 1
    positions = torch.cat([torch.arange(length) for length in query_lens])
    with torch.inference_mode():
        model(
            torch.zeros(int(ends[-1]) + 1, dtype=torch.int64, device=device),
            positions.to(device),
            kv_cache,
            metadata,
            ends.to(device),
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
