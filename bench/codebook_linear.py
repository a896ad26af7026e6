"""`python -m textgate.bench.codebook_linear`: time the CPU NF4/FP4 linear candidates.

For each of the default model's linear shapes (in x out) and row counts M, a random weight
is quantized by bitsandbytes (`--quant-type`, 64-value blocks) and each candidate computes
`x[M, in] @ W.T` in `--dtype`; its best time is printed as a ratio to the dense FastLinear
(oneDNN-prepacked) of the unquantized weight in the same dtype and cell: below 1 is faster.

- `bnb`: bitsandbytes' own `Linear4bit` forward (on the CPU: dequantize, then matmul).
- `lut4`: `CodebookLinear`'s kernel (`cpu_lut4.c`) on the same codes, whatever M.

Note that a weight this size stays in cache between calls, which flatters the dense
layer: in a whole model, read from memory, 4-bit codes move a quarter of bf16's bytes
(`python -m textgate.bench.step --quantize bitsandbytes-nf4` times that). This is how
quantization/codebook_linear.py chose KERNEL_ROWS; rerun it on a new machine.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import torch

from textgate.bench.cli import parse_list
from textgate.bench.int4_linear import SHAPES
from textgate.bench.report import format_table
from textgate.bench.timing import best_seconds
from textgate.kernels.linear import FastLinear
from textgate.quantization import codebook_linear
from textgate.quantization.bitsandbytes import FourBitBnbWeight
from textgate.quantization.codebook_linear import CodebookLinear


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.codebook_linear", description=__doc__
    )
    parser.add_argument("--rows", default="1,4,8,16,32", help="row counts M")
    parser.add_argument("--quant-type", default="nf4", choices=["nf4", "fp4"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=15, help="round-robin timing rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    dtype = getattr(torch, args.dtype)
    codebook_linear.KERNEL_ROWS = 1 << 30  # time the kernel at every M
    torch.manual_seed(0)
    table = []
    for in_features, out_features in SHAPES:
        weight = (torch.randn(out_features, in_features) * in_features**-0.5).to(dtype)
        layer = FourBitBnbWeight(weight, args.quant_type).get_linear(None)
        if not isinstance(layer, CodebookLinear):
            raise SystemExit("the CPU kernels (AVX512) are not built here: nothing to compare")
        fns = {"dense": FastLinear(weight), "bnb": layer.linear, "lut4": layer}
        for rows in parse_list(args.rows, int):
            x = torch.randn(rows, in_features).to(dtype)
            with torch.inference_mode():
                times = best_seconds(fns, x, args.rounds)
            base = times["dense"]
            table.append(
                [f"{in_features}x{out_features}", rows, round(base * 1e3, 3)]
                + [round(times[name] / base, 2) for name in ("bnb", "lut4")]
            )
    print(
        f"{torch.get_num_threads()} threads, {args.quant_type} in {args.dtype}; "
        "time / dense FastLinear time"
    )
    print(format_table(["shape", "M", "dense ms", "bnb", "lut4"], table))


if __name__ == "__main__":
    main()
