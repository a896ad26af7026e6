"""CUDA graphs for decode steps: the model's forward captured once per batch size, replayed.

A decode step (every sequence computes one token and samples after it) launches a few
hundred small kernels; at small batches on a GPU their launch cost, not the math, sets the
step time. A CUDA graph records those launches once and replays them with one call.

How a decode step runs through a graph (`DecodeGraphRunner`):
- At warmup, once the KV cache exists, the forward is captured for each bucket size B of
  `--cuda-graphs` (largest first, all sharing one memory pool) over static buffers:
  input_ids [B], positions [B], seq_lens [B], block_tables [B, W], slot_mapping [B].
  W is the blocks of the longest sequence the router admits; the captured step's
  max_seqlen_k is W * block_size, so backends must read the true lengths from seq_lens.
- A decode batch of n sequences runs in the smallest bucket B >= n: its tensors are
  copied into the first n rows and rows n..B become padding rows (token 0 at position 0,
  seq_len 1, every block the scratch block, slot = the scratch block's first slot). A
  padding row attends to and writes only the scratch block, which the router never hands
  out, so it harms no sequence. The graph is replayed and logits[:n] returned: a view of
  the static output, read by the sampler before the next replay overwrites it.
- Everything else runs eager (`run` returns None): prefill, chunked or mixed steps, rows
  asking for prompt logprobs, a batch over the largest bucket, a table wider than W.

Capture is injectable (`GraphCapture`): `CudaGraphCapture` records a real
`torch.cuda.CUDAGraph`; `eager_capture` makes a stand-in whose replay reruns the forward
on the same static buffers, so the whole runner (padding, buffer reuse, slicing) is
tested on CPU. A real capture needs an attention backend that never reads the device on
the host (`supports_cuda_graphs = True` on its class); others run eager with a log line.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from textgate.kernels.attention import AttentionMetadata
from textgate.shard_server.step.kv_cache import KVCache

log = logging.getLogger("textgate.shard")

DEFAULT_CUDA_GRAPHS = (1, 2, 4, 8, 16, 32)
"""TGI's default `--cuda-graphs`: the decode batch sizes captured on a GPU."""


class CapturedGraph(Protocol):
    """What a capture returns: something that recomputes its static output in place."""

    def replay(self) -> None: ...


GraphCapture = Callable[[Callable[[], Tensor]], tuple[CapturedGraph, Tensor]]
"""Record `forward` (reading only static buffers); return the graph and its static output."""


class EagerGraph:
    """A stand-in for a CUDA graph: `replay` reruns the forward into the static output."""

    def __init__(self, forward: Callable[[], Tensor], output: Tensor) -> None:
        self.forward = forward
        self.output = output
        self.replays = 0

    def replay(self) -> None:
        self.output.copy_(self.forward())
        self.replays += 1


def eager_capture(forward: Callable[[], Tensor]) -> tuple[EagerGraph, Tensor]:
    """Capture for CPU tests: run once for the output's shape, replay eagerly."""
    output = forward().clone()
    return EagerGraph(forward, output), output


class CudaGraphCapture:
    """Records `torch.cuda.CUDAGraph`s that share one memory pool.

    Buckets are captured largest first, so each smaller graph fits in the memory the
    largest one's activations already reserved in the pool.
    """

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Callable[[], Tensor]) -> tuple[CapturedGraph, Tensor]:
        # Eager runs on a side stream first: cuBLAS handles, workspaces and lazy
        # initialisation must happen outside the capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_runs):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        return graph, output


def graph_safe(backend: Any) -> bool:
    """Whether an attention backend may be captured: it reads no device value on the host."""
    return bool(getattr(backend, "supports_cuda_graphs", False))


@dataclass
class GraphBucket:
    """One captured batch size and its static output."""

    batch_size: int
    graph: CapturedGraph
    logits: Tensor  # [B, V]


class DecodeGraphRunner:
    """Decode steps through graphs captured per batch size, padded up to the nearest one."""

    def __init__(
        self,
        model: Any,
        kv_cache: KVCache,
        batch_sizes: Sequence[int],
        *,
        max_blocks_per_seq: int,
        scratch_block: int,
        capture: GraphCapture,
    ) -> None:
        sizes = sorted(set(batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"graph batch sizes must be positive, got {list(batch_sizes)}")
        if max_blocks_per_seq < 1:
            raise ValueError("max_blocks_per_seq must be at least 1")
        if not 0 <= scratch_block < kv_cache.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the cache")
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = sizes
        self.max_blocks_per_seq = max_blocks_per_seq
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * kv_cache.block_size
        self.capture_fn = capture
        largest, device = sizes[-1], torch.device(model.device)
        index = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(largest, **index)
        self.positions = torch.zeros(largest, **index)
        self.seq_lens = torch.ones(largest, **index)
        self.slot_mapping = torch.full((largest,), self.scratch_slot, **index)
        self.block_tables = torch.full((largest, max_blocks_per_seq), scratch_block, **index)
        self.query_start_loc = torch.arange(largest + 1, **index)
        self.logits_indices = torch.arange(largest, **index)
        self.buckets: dict[int, GraphBucket] = {}

    def capture(self) -> None:
        """Record every bucket, largest first (all rows are padding rows while recording)."""
        with torch.inference_mode():
            for size in reversed(self.batch_sizes):
                self._pad_from(0)
                graph, logits = self.capture_fn(lambda size=size: self._forward(size))
                self.buckets[size] = GraphBucket(size, graph, logits)
        log.info(
            "Captured decode graphs for batch sizes %s (up to %d tokens per sequence)",
            ",".join(map(str, self.batch_sizes)),
            self.max_blocks_per_seq * self.kv_cache.block_size,
        )

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest captured batch size >= num_seqs, or None when none is."""
        at = bisect.bisect_left(self.batch_sizes, num_seqs)
        return self.batch_sizes[at] if at < len(self.batch_sizes) else None

    def run(
        self,
        input_ids: Tensor,
        positions: Tensor,
        metadata: AttentionMetadata,
        logits_indices: Tensor,
    ) -> Tensor | None:
        """Logits [n, V] of a decode step through its bucket's graph, or None (run eager).

        The step must be one new token per sequence, each wanting its logits.
        """
        num_seqs = metadata.num_seqs
        if metadata.max_seqlen_q != 1 or logits_indices.shape[0] != num_seqs:
            return None
        size = self.bucket_for(num_seqs)
        width = metadata.block_tables.shape[1]
        if size is None or size not in self.buckets or width > self.max_blocks_per_seq:
            return None
        self.input_ids[:num_seqs].copy_(input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(positions, non_blocking=True)
        self.seq_lens[:num_seqs].copy_(metadata.seq_lens, non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(metadata.slot_mapping, non_blocking=True)
        self.block_tables[:num_seqs, :width].copy_(metadata.block_tables, non_blocking=True)
        self.block_tables[:num_seqs, width:].fill_(self.scratch_block)
        self._pad_from(num_seqs)
        bucket = self.buckets[size]
        bucket.graph.replay()
        return bucket.logits[:num_seqs]

    def _pad_from(self, row: int) -> None:
        """Rows row.. become padding rows: they read and write only the scratch block."""
        self.input_ids[row:].zero_()
        self.positions[row:].zero_()
        self.seq_lens[row:].fill_(1)
        self.slot_mapping[row:].fill_(self.scratch_slot)
        self.block_tables[row:].fill_(self.scratch_block)

    def _forward(self, size: int) -> Tensor:
        metadata = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_seqlen_q=1,
            max_seqlen_k=self.max_blocks_per_seq * self.kv_cache.block_size,
        )
        logits: Tensor = self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_cache,
            metadata,
            self.logits_indices[:size],
        )
        return logits
