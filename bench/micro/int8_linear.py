"""`python -m textgate.bench.micro.int8_linear`: time the CPU int8 linear candidates in one process.

For each of the default model's linear shapes (in x out) and row counts M, every candidate
computes `x[M, in] @ W.T` and its median time is printed as a ratio to the fp32 FastLinear
(oneDNN-prepacked) time of the same cell: below 1 is faster. The candidates:

- `bf16`: FastLinear in bfloat16 (the launcher's CPU default dtype).
- `ao-x86` / `ao-onednn`: `quantized::linear_dynamic` (torch.ao dynamic int8: per-channel
  int8 weights prepacked by the fbgemm-based x86 engine or by oneDNN; per-tensor dynamic
  uint8 activations).
- `ao-x86-tok`: `ao-x86` on rows scaled to absmax 1 first and rescaled after, which makes
  the per-tensor activation scale a per-token one.
- `int_mm`: per-token int8 activations quantized in PyTorch, `torch._int_mm`, rescale.
- `w8pack`: `aten._weight_int8pack_mm` (int8 weights, fp32 activations; weight-only).
- `onednn-q`: `onednn::qlinear_pointwise` on plain int8 tensors (the op PyTorch's x86 PT2E
  int8 path lowers to): weights prepacked once, per-tensor dynamic uint8 activations
  quantized by PyTorch ops.
- `ours`: `kernels.int8_linear.Int8Linear` as it serves here (its `default_kernel`).
- `c-<level>`: cpu_int8.c built for each instruction-set level this CPU runs
  (kernels/cpu_isa.py: `c-avx2` is what an AVX2-only CPU serves with).
- `ours-onednn`: the same layer on oneDNN's int8 GEMM (per-token activations quantized in
  one C pass; wrong where oneDNN saturates, see `int8_linear.onednn_is_exact`).
- `ref`: dequantize then matmul (the reference).

Candidates are timed round-robin within a cell, in short windows; each one's fastest
window counts, which on a shared machine is the one least disturbed by other processes.

This is how kernels/int8_linear.py chose its fast path; rerun it on a new machine.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable, Sequence

import torch

from textgate.bench.micro.timing import best_seconds
from textgate.bench.serving.cli import parse_list
from textgate.bench.serving.report import format_table
from textgate.kernels import cpu_build, cpu_isa, int8_linear
from textgate.kernels.int8_linear import Int8Linear
from textgate.kernels.linear import FastLinear

SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 49152))


def _ao_linear(weight: torch.Tensor, engine: str) -> Callable[[torch.Tensor], torch.Tensor]:
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
        zeros = torch.zeros(weight.shape[0], dtype=torch.int64)
        with warnings.catch_warnings():  # quantized tensor types are deprecated in torch 2.13
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = previous

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, packed, False)

    return run


def candidates(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every candidate for `x @ weight.T`, built once for this weight [out, in]."""
    fp32 = FastLinear(weight.clone())
    bf16 = FastLinear(weight.to(torch.bfloat16))
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127  # [out]
    qweight = torch.round(weight / scales[:, None]).to(torch.int8)  # [out, in]
    qweight_t = qweight.t().contiguous()  # [in, out] for _int_mm
    ao_x86 = _ao_linear(weight, "x86")
    ao_onednn = _ao_linear(weight, "onednn")

    def ao_token(x: torch.Tensor) -> torch.Tensor:
        row_max = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8)  # [M, 1]
        return ao_x86(x / row_max) * row_max

    packed = torch.ops.onednn.qlinear_prepack(qweight, None)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int32)

    def onednn_q(x: torch.Tensor) -> torch.Tensor:
        low, high = x.amin().clamp(max=0), x.amax().clamp(min=0)
        x_scale = ((high - low) / 255).clamp(min=1e-8)
        x_zero = torch.round(-low / x_scale).to(torch.int32)
        qx = torch.clamp(torch.round(x / x_scale) + x_zero, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise.tensor(
            qx, x_scale, x_zero, packed, scales, zero_points, None, 1.0, 0, torch.float32,
            "none", [], "",
        )  # fmt: skip

    def int_mm(x: torch.Tensor) -> torch.Tensor:
        x_scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127  # [M, 1]
        qx = torch.round(x / x_scale).to(torch.int8)
        return torch._int_mm(qx, qweight_t).float() * x_scale * scales

    def reference(x: torch.Tensor) -> torch.Tensor:
        return x @ (qweight.float() * scales[:, None]).t()

    return {
        "fp32": fp32,
        "bf16": lambda x: bf16(x.to(torch.bfloat16)),
        "ao-x86": ao_x86,
        "ao-onednn": ao_onednn,
        "ao-x86-tok": ao_token,
        "onednn-q": onednn_q,
        "ours": Int8Linear(qweight, scales),
        "ours-onednn": Int8Linear(qweight, scales, kernel="onednn"),
        **_c_levels(qweight, scales),
        "int_mm": int_mm,
        "w8pack": lambda x: torch.ops.aten._weight_int8pack_mm(x, qweight, scales),
        "ref": reference,
    }


Linear = Callable[[torch.Tensor], torch.Tensor]


def _c_levels(qweight: torch.Tensor, scales: torch.Tensor) -> dict[str, Linear]:
    """cpu_int8.c built for each level this CPU runs, on weights packed for it."""
    fns: dict[str, Linear] = {}
    for level in cpu_isa.runnable_levels():
        library = cpu_build.load_library(level=level.name)
        if library is None:
            continue
        packed = int8_linear.pack_int8(qweight, scales, None, int(library.textgate_int8_isa()))

        def run(x: torch.Tensor, packed=packed, library=library) -> torch.Tensor:
            return int8_linear.cpu_int8_linear(x, packed, None, library)

        fns[f"c-{level.name}"] = run
    return fns


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.micro.int8_linear", description=__doc__
    )
    parser.add_argument("--rows", default="1,32,256,1280", help="row counts M")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per cell")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows_list = parse_list(args.rows, int)
    names: list[str] = []
    table = []
    for in_features, out_features in SHAPES:
        weight = torch.randn(out_features, in_features) * in_features**-0.5
        fns = candidates(weight)
        names = [n for n in fns if n != "fp32"]
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            best = best_seconds(fns, x, args.rounds, window_s=0.002)
            base = best["fp32"]
            row = [f"{in_features}x{out_features}", rows, round(base * 1e3, 3)]
            table.append(row + [round(best[n] / base, 2) for n in names])
            print(*table[-1], sep="\t", file=sys.stderr, flush=True)  # progress
    print(
        f"{torch.get_num_threads()} threads; best time / fp32 FastLinear best time (lower is faster)"
    )
    print(format_table(["shape", "M", "fp32 ms", *names], table))


if __name__ == "__main__":
    main()
