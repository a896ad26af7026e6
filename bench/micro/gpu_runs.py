"""The timed runs of bench/micro/gpu_kernels.py: decode rows (CUDA graphs off and on) and a prefill.

`run` builds the model of `gpu_model` once, then measures each attention backend in turn
with a `KernelBench`: its eager decode rows (whose logits become the reference when the
backend is torch), its graph-replay rows, its prefill row. Every decode row carries its
logits' largest difference from the torch backend's eager step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from textgate.bench.micro.gpu_model import (
    SHAPES,
    ModelShape,
    bandwidth_for,
    build_model,
    decode_roofline_ms,
    prefill_flops,
)
from textgate.bench.serving.roofline import DTYPES
from textgate.kernels import AttentionMetadata, get_attention_backend
from textgate.shard_server.step.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphRunner,
    eager_capture,
    graph_safe,
)

BLOCK_SIZE = 16


@dataclass(frozen=True)
class StepInputs:
    """A step's model inputs: every sequence `context` tokens deep plus `query` new ones."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    blocks_per_seq: int

    @classmethod
    def build(
        cls,
        batch: int,
        context: int,
        query: int,
        vocab: int,
        device: torch.device,
        first_block: int = 0,
    ) -> StepInputs:
        """Sequence i owns blocks from first_block + i * blocks_per_seq on."""
        per_seq = -(-(context + query) // BLOCK_SIZE)
        tables = [
            list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
            for i in range(batch)
        ]
        metadata = AttentionMetadata.build(
            query_lens=[query] * batch,
            context_lens=[context] * batch,
            block_tables=tables,
            block_size=BLOCK_SIZE,
            device=device,
        )
        generator = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, vocab, (batch * query,), generator=generator)
        positions = torch.arange(context, context + query).repeat(batch)
        ends = torch.arange(1, batch + 1) * query - 1
        return cls(ids.to(device), positions.to(device), metadata, ends.to(device), per_seq)


@dataclass
class KernelRow:
    """One measured step."""

    kind: str  # "decode" or "prefill"
    backend: str
    graphs: str  # "off", "on", "on (eager stand-in)" or "n/a: why"
    batch: int
    context: int
    tokens: int
    ms: float
    tokens_per_s: float
    roofline_ms: float | None = None
    roofline_ratio: float | None = None
    tflops: float | None = None
    max_diff: float | None = None
    """Largest |logit - torch backend's eager logit| of the step (decode rows)."""


@dataclass
class KernelReport:
    device: str
    shape: ModelShape
    dtype: str
    bandwidth_gbs: float | None
    bandwidth_source: str
    torch_version: str
    rows: list[KernelRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def median_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn` after two untimed runs (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


@dataclass
class KernelBench:
    """One model, its KV cache and step inputs, measured one attention backend at a time.

    The decode steps share the cache's first blocks, the prefill owns the blocks after them
    (so every backend sees the same decode context), and the last block is the graphs'
    scratch block.
    """

    shape: ModelShape
    model: Any
    cache: Any
    steps: dict[int, StepInputs]  # batch size → its decode step
    prefill: StepInputs
    context: int
    repeats: int
    device: torch.device
    reference: dict[int, torch.Tensor] = field(default_factory=dict)
    """The torch backend's eager logits per batch size (filled when torch runs, first)."""

    def backend_rows(self, backend_name: str, graphs: list[str]) -> Iterator[KernelRow]:
        """The backend's rows, each as soon as it is measured: eager decode (timed when
        `graphs` has "off"), graph-replay decode (when it has "on"), the prefill."""
        self.model.attention_backend = get_attention_backend(backend_name)
        yield from self.eager_rows(backend_name, timed="off" in graphs)
        if "on" in graphs:
            yield from self.graph_rows(backend_name)
        yield self.prefill_row(backend_name)

    def eager_rows(self, backend_name: str, *, timed: bool) -> Iterator[KernelRow]:
        """Checks every batch's eager logits (recording them as the reference for torch);
        with `timed`, a row per batch."""
        for batch, step in self.steps.items():

            def eager(step: StepInputs = step) -> torch.Tensor:
                return self._forward(step)

            logits = eager()
            if backend_name == "torch":
                self.reference[batch] = logits.clone()
            diff = self._max_diff(batch, logits)
            if timed:
                ms = median_ms(eager, self.device, self.repeats)
                yield self._decode_row(backend_name, "off", batch, ms, diff)

    def graph_rows(self, backend_name: str) -> Iterator[KernelRow]:
        """A row per batch replaying a captured decode graph (on CPU: its eager stand-in)."""
        on_gpu = self.device.type == "cuda"
        if on_gpu and not graph_safe(self.model.attention_backend):
            why = "n/a: backend reads lengths on the host"
            for batch in self.steps:
                yield self._decode_row(backend_name, why, batch, float("nan"), None)
            return
        runner = DecodeGraphRunner(
            self.model,
            self.cache,
            list(self.steps),
            max_blocks_per_seq=self.steps[max(self.steps)].blocks_per_seq,
            scratch_block=self.cache.num_blocks - 1,
            capture=CudaGraphCapture(self.device) if on_gpu else eager_capture,
        )
        runner.capture()
        label = "on" if on_gpu else "on (eager stand-in)"
        for batch, step in self.steps.items():

            def replay(step: StepInputs = step) -> torch.Tensor | None:
                return runner.run(
                    step.input_ids, step.positions, step.metadata, step.logits_indices
                )

            logits = replay()
            assert logits is not None, f"batch {batch} has a graph of its own"
            diff = self._max_diff(batch, logits)
            ms = median_ms(replay, self.device, self.repeats)
            yield self._decode_row(backend_name, label, batch, ms, diff)

    def prefill_row(self, backend_name: str) -> KernelRow:
        """One sequence's whole prompt in one step (half the repeats: it is the long one)."""
        ms = median_ms(lambda: self._forward(self.prefill), self.device, max(self.repeats // 2, 1))
        tokens = len(self.prefill.input_ids)
        return KernelRow(
            "prefill",
            backend_name,
            "off",
            1,
            tokens,
            tokens,
            ms,
            tokens / ms * 1e3,
            tflops=prefill_flops(self.shape, tokens) / (ms * 1e-3) / 1e12,
        )

    def _forward(self, step: StepInputs) -> torch.Tensor:
        return self.model(
            step.input_ids, step.positions, self.cache, step.metadata, step.logits_indices
        )

    def _max_diff(self, batch: int, logits: torch.Tensor) -> float | None:
        reference = self.reference.get(batch)
        if reference is None:
            return None
        return float((logits.float() - reference.float()).abs().max())

    def _decode_row(
        self, backend_name: str, graphs: str, batch: int, ms: float, diff: float | None
    ) -> KernelRow:
        return KernelRow(
            "decode",
            backend_name,
            graphs,
            batch=batch,
            context=self.context,
            tokens=batch,
            ms=ms,
            tokens_per_s=batch / ms * 1e3,
            max_diff=diff,
        )


def run(args: argparse.Namespace) -> KernelReport:
    """Every backend of `args.attention` in turn (one that fails lands in `skipped`), then
    each decode row set against the roofline when the bandwidth is known."""
    device = torch.device(args.device)
    shape, dtype = SHAPES[args.shape], DTYPES[args.dtype]
    bandwidth, source = bandwidth_for(device, args.bandwidth_gbs)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report = KernelReport(name, shape, args.dtype, bandwidth, source, torch.__version__)
    bench = _build_bench(args, shape, device, dtype)
    for backend_name in args.attention:
        try:
            with torch.inference_mode():
                for row in bench.backend_rows(backend_name, args.graphs):
                    report.rows.append(row)
        except Exception as exc:  # a backend this machine cannot run is reported, not fatal
            report.skipped[backend_name] = f"{type(exc).__name__}: {exc}"
    if bandwidth is not None:
        element = torch.empty((), dtype=dtype).element_size()
        for row in report.rows:
            if row.kind == "decode":
                row.roofline_ms = decode_roofline_ms(
                    shape, row.batch, row.context, element, bandwidth
                )
                row.roofline_ratio = row.roofline_ms / row.ms
    return report


def _build_bench(
    args: argparse.Namespace, shape: ModelShape, device: torch.device, dtype: torch.dtype
) -> KernelBench:
    torch.manual_seed(0)
    model = build_model(shape, device, dtype)
    batches, context = args.batch_sizes, args.context
    steps = {b: StepInputs.build(b, context, 1, shape.vocab, device) for b in batches}
    # The largest batch's blocks, then the prefill's, then the graphs' scratch block.
    decode_blocks = max(batches) * steps[max(batches)].blocks_per_seq
    prefill = StepInputs.build(1, 0, args.prefill_tokens, shape.vocab, device, decode_blocks)
    cache = model.allocate_kv_cache(decode_blocks + prefill.blocks_per_seq + 1, BLOCK_SIZE)
    return KernelBench(shape, model, cache, steps, prefill, context, args.repeats, device)
