"""`python -m textgate.bench.micro.attention`: one layer's paged attention, per backend.

Times every registered attention backend (kernels/) on the same steps, with the attention
shapes of a model (heads, kv heads, head size from its config.json; default the embedded
model): decode steps of B sequences over C cached tokens, and prompt chunks of Q tokens
over C cached tokens. Each case is one layer's `forward` over a paged cache with scattered
blocks, after `prepare` (which a step does once for all layers). Prints the median of the
repeats in microseconds, and each backend's time relative to the SDPA reference.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from textgate.bench.serving.cli import parse_list
from textgate.bench.serving.report import format_table
from textgate.bench.serving.roofline import DTYPES
from textgate.bench.serving.tokenizer import default_model_dir
from textgate.kernels import AttentionMetadata, get_attention_backend

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Case:
    """One step: `num_seqs` sequences of `query_len` new tokens over `context_len` cached."""

    name: str
    num_seqs: int
    query_len: int
    context_len: int


@dataclass(frozen=True)
class AttentionShape:
    """The attention shapes of one model layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, model_dir: Path) -> AttentionShape:
        config = json.loads((model_dir / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        return cls(heads, kv_heads, head_dim)


def default_cases(batches: Sequence[int], contexts: Sequence[int], chunk: int) -> list[Case]:
    """Decode at every (batch, context); one prompt chunk over every context."""
    cases = [Case(f"decode B={b} C={c}", b, 1, c) for b in batches for c in contexts]
    cases += [Case(f"prefill Q={chunk} C={c}", 1, chunk, c) for c in (0, *contexts)]
    return cases


def time_case(
    backend_name: str,
    case: Case,
    shape: AttentionShape,
    dtype: torch.dtype,
    repeats: int,
    generator: torch.Generator,
) -> float:
    """Median seconds of one layer's attention forward for `case`."""
    seq_len = case.query_len + case.context_len
    blocks_per_seq = math.ceil(seq_len / BLOCK_SIZE)
    num_blocks = case.num_seqs * blocks_per_seq
    order = torch.randperm(num_blocks, generator=generator)  # scattered, as in a busy cache
    tables = order.view(case.num_seqs, blocks_per_seq).tolist()
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    metadata = AttentionMetadata.build(
        query_lens=[case.query_len] * case.num_seqs,
        context_lens=[case.context_len] * case.num_seqs,
        block_tables=tables,
        block_size=BLOCK_SIZE,
    )
    rows = case.num_seqs * case.query_len
    query = torch.randn(rows, shape.num_heads, shape.head_dim, generator=generator).to(dtype)
    backend = get_attention_backend(backend_name)
    plan = backend.prepare(metadata)
    scale = shape.head_dim**-0.5
    times = []
    with torch.inference_mode():
        for _ in range(3):  # warm up: scratch buffers, thread pool
            backend.forward(query, key_cache, value_cache, plan, scale=scale)
        for _ in range(repeats):
            start = time.perf_counter()
            backend.forward(query, key_cache, value_cache, plan, scale=scale)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.micro.attention", description=__doc__
    )
    parser.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    parser.add_argument("--backends", default="sdpa,cpu", help="comma-separated, sdpa first")
    parser.add_argument("--batch", default="1,32", help="decode batch sizes")
    parser.add_argument("--context", default="100,2000", help="cached tokens per sequence")
    parser.add_argument("--chunk", type=int, default=256, help="prompt chunk length")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_dir()
    shape = AttentionShape.from_config(model_dir)
    backends = args.backends.split(",")
    cases = default_cases(parse_list(args.batch, int), parse_list(args.context, int), args.chunk)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for case in cases:
        seconds = [
            time_case(name, case, shape, DTYPES[args.dtype], args.repeats, generator)
            for name in backends
        ]
        rows.append(
            [
                case.name,
                *(round(s * 1e6, 1) for s in seconds),
                *(round(s / seconds[0], 2) for s in seconds[1:]),
            ]
        )
    print(
        f"{model_dir.name}: {shape.num_heads} heads, {shape.num_kv_heads} kv heads, "
        f"head size {shape.head_dim}, {args.dtype}, {torch.get_num_threads()} threads; "
        "one layer, median µs"
    )
    headers = [
        "case",
        *(f"{b} µs" for b in backends),
        *(f"{b} / {backends[0]}" for b in backends[1:]),
    ]
    print(format_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
