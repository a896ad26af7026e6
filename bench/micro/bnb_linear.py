"""`python -m textgate.bench.micro.bnb_linear`: bitsandbytes' CPU layers in training and in eval mode.

For each of the default model's linear shapes (in x out) and row counts M, a random weight
becomes a bitsandbytes layer (`--method`: nf4, fp4 or int8, i.e. LLM.int8()) and computes
`x[M, in] @ W.T` in `--dtype`, once as an nn.Module's default training mode leaves it and
once in eval mode (what textgate serves: the package's fast CPU kernels). Each time is
printed as a ratio to the dense FastLinear (oneDNN-prepacked) of the unquantized weight in
the same dtype and cell: below 1 is faster. This is why quantization/bitsandbytes.py puts
its layers in eval mode.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import torch

from textgate.bench.micro.int4_linear import SHAPES
from textgate.bench.micro.timing import best_seconds
from textgate.bench.serving.cli import parse_list
from textgate.bench.serving.report import format_table
from textgate.kernels.linear import FastLinear
from textgate.quantization.bitsandbytes import FourBitBnbWeight, Int8BnbWeight


def layer(method: str, weight: torch.Tensor) -> torch.nn.Module:
    if method == "int8":
        return Int8BnbWeight(weight).get_linear(None)
    return FourBitBnbWeight(weight, method).get_linear(None)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.micro.bnb_linear", description=__doc__
    )
    parser.add_argument("--rows", default="1,8,32", help="row counts M")
    parser.add_argument("--method", default="nf4", choices=["nf4", "fp4", "int8"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=15, help="round-robin timing rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    table = []
    for in_features, out_features in SHAPES:
        weight = (torch.randn(out_features, in_features) * in_features**-0.5).to(dtype)
        fns = {
            "dense": FastLinear(weight),
            "train": layer(args.method, weight).train(),
            "eval": layer(args.method, weight),
        }
        for rows in parse_list(args.rows, int):
            x = torch.randn(rows, in_features).to(dtype)
            with torch.inference_mode():
                times = best_seconds(fns, x, args.rounds)
            base = times["dense"]
            table.append(
                [f"{in_features}x{out_features}", rows, round(base * 1e3, 3)]
                + [round(times[name] / base, 2) for name in ("train", "eval")]
            )
    print(
        f"{torch.get_num_threads()} threads, bitsandbytes {args.method} in {args.dtype}; "
        "time / dense FastLinear time"
    )
    print(format_table(["shape", "M", "dense ms", "train", "eval"], table))


if __name__ == "__main__":
    main()
