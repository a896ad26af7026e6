"""`python -m textgate.bench.micro.linear_rows`: packed linears over many row counts, the
rows padded to `kernels.linear.padded_rows` or multiplied as they are.

A served step's rows are its decodes plus its prompt tokens: a different count nearly every
mixed step. oneDNN builds a kernel per row count and caches a bounded number
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, 1024 by default), so a server pays a build at every
count it has not seen, and keeps paying once it has seen more counts than the cache holds.
This bench multiplies the default model's four linear shapes (q/o, k/v, gate/up, down of
SmolLM2-135M, or `--shapes`) at `--counts` random row counts in [`--min-rows`,
`--max-rows`], in two passes over the same counts (the second shows what the cache keeps),
exact counts in one process and padded counts in another, so neither warms the other's
cache. Prints each pass's milliseconds and the padded ÷ exact ratio (below 1: padding is
faster).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from textgate.bench.serving.report import format_table

SHAPES = "576x576,576x192,576x1536,1536x576"
"""in x out of SmolLM2-135M's linears (q and o, k and v, gate and up, down)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.micro.linear_rows",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--shapes", default=SHAPES, help="in x out, comma-separated")
    parser.add_argument("--counts", type=int, default=300, help="random row counts per pass")
    parser.add_argument("--min-rows", type=int, default=33)
    parser.add_argument("--max-rows", type=int, default=700)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", choices=["exact", "padded"], help=argparse.SUPPRESS)
    return parser


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """`"576x192,..."` → [(576, 192), ...]."""
    shapes = []
    for part in text.split(","):
        fields = part.strip().lower().split("x")
        if len(fields) != 2 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise ValueError(f"a shape is IN x OUT, e.g. 576x192: got {part!r}")
        shapes.append((int(fields[0]), int(fields[1])))
    return shapes


def passes(args: argparse.Namespace, padded: bool) -> list[float]:
    """Milliseconds of each of two passes over the counts (this process: one mode only)."""
    from textgate.kernels import linear

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    layers = []
    for fan_in, fan_out in parse_shapes(args.shapes):
        packed = linear.prepack(torch.randn(fan_out, fan_in, generator=generator).to(dtype))
        if packed is None:
            raise SystemExit(f"{args.dtype} weights cannot be packed for oneDNN here")
        layers.append((fan_in, packed))
    rng = random.Random(args.seed)
    counts = [rng.randint(args.min_rows, args.max_rows) for _ in range(args.counts)]
    inputs = {
        (rows, fan_in): torch.randn(rows, fan_in, generator=generator).to(dtype)
        for rows in set(counts)
        for fan_in, _ in layers
    }

    def exact(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")

    multiply = linear.packed_linear if padded else exact
    times = []
    for _ in range(2):
        start = time.perf_counter()
        for rows in counts:
            for fan_in, packed in layers:
                multiply(inputs[rows, fan_in], packed)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    parse_shapes(args.shapes)  # a bad shape fails here, before any process starts
    if args.min_rows < 1 or args.max_rows < args.min_rows or args.counts < 1:
        raise SystemExit("need 1 <= --min-rows <= --max-rows and --counts >= 1")
    if args.one:
        print(json.dumps(passes(args, padded=args.one == "padded")))
        return 0
    results = {}
    for mode in ("exact", "padded"):
        command = [
            sys.executable,
            "-P",
            "-m",
            "textgate.bench.micro.linear_rows",
            *raw,
            "--one",
            mode,
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.stderr.write(done.stderr)
            return done.returncode
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"{args.dtype}, shapes {args.shapes}, {args.counts} row counts in "
        f"[{args.min_rows}, {args.max_rows}], {args.threads} threads"
    )
    rows = [
        [f"pass {i + 1}", round(results["exact"][i], 1), round(results["padded"][i], 1),
         round(results["padded"][i] / results["exact"][i], 3)]
        for i in range(2)
    ]  # fmt: skip
    print(format_table(["", "exact ms", "padded ms", "padded / exact"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
