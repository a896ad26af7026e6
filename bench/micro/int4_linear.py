"""`python -m textgate.bench.micro.int4_linear`: time the CPU int4 (GPTQ/AWQ) linear candidates.

For each of the default model's linear shapes (in x out) and row counts M, a random 4-bit
weight with groups of `--group-size` is built and every candidate computes `x[M, in] @ W.T`;
its median time is printed as a ratio to the fp32 FastLinear (oneDNN-prepacked) time of
the dequantized weight in the same cell: below 1 is faster. The candidates:

- `bf16`: FastLinear over the weight dequantized to bfloat16 (the CPU default dtype).
- `i4-f32` / `i4-bf16`: `Int4PackedLinear` (`aten._weight_int4pack_mm_for_cpu`) with
  float32 / bfloat16 activations, scales and zeros.
- `i4-bf16-act`: `i4-bf16` for an act-order (desc_act) weight: the same kernel after a
  gather of the activation's inputs (`x[..., perm]`).
- `i4-expand`: what `Int4PackedLinear` runs from `PROMPT_ROWS` rows on: the codes expanded
  to a bf16 matrix (`expand_int4`, kernels/cpu_int4.c), then a dense matmul.
- `ao-int8`: the dequantized weight requantized per channel to int8, torch.ao dynamic
  int8 linear (x86 engine) — lossy a second time, listed as the int8 path's speed.
- `ref`: unpack and dequantize on every call, then matmul (the reference, not a path).

This is how kernels/int4_linear.py chose its fast path; rerun it on a new machine.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Sequence

import torch

from textgate.bench.micro.timing import best_seconds
from textgate.bench.serving.cli import parse_list
from textgate.bench.serving.report import format_table
from textgate.kernels.int4_linear import Int4PackedLinear, expand_int4
from textgate.kernels.linear import FastLinear
from textgate.kernels.packing import (
    UnpackedWeight,
    contiguous_g_idx,
    dequantize,
    dequantize_gptq,
    pack_gptq,
)

SHAPES = ((576, 576), (576, 1536), (1536, 576))


def random_unpacked(out_features: int, in_features: int, group_size: int) -> UnpackedWeight:
    """Random 4-bit codes, asymmetric zeros and small scales for a layer [out, in]."""
    num_groups = -(-in_features // group_size)  # the last group may be short (576 = 4*128 + 64)
    return UnpackedWeight(
        intweight=torch.randint(0, 16, (out_features, in_features), dtype=torch.int32),
        scales=(torch.rand(num_groups, out_features) * 0.02 + 0.005).half(),
        zeros=torch.randint(0, 16, (num_groups, out_features), dtype=torch.int32),
        g_idx=contiguous_g_idx(in_features, group_size),
    )


def ao_int8_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """torch.ao dynamic int8 linear (x86 engine) over `weight` requantized per channel."""
    # The ao quantized-tensor API warns that it is deprecated; it is measured, not used.
    warnings.filterwarnings("ignore", message=".*quantize_per_channel.*", category=UserWarning)
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127  # [out]
        zeros = torch.zeros(weight.shape[0], dtype=torch.int64)
        qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = previous
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, False)


def candidates(unpacked: UnpackedWeight) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every candidate for `x @ W.T`, built once; x arrives in float32."""
    weight = dequantize(unpacked)
    fp32 = FastLinear(weight.clone())
    bf16 = FastLinear(weight.to(torch.bfloat16))
    i4_bf16 = Int4PackedLinear.from_unpacked(unpacked, torch.bfloat16)
    assert i4_bf16 is not None
    # The layer refuses float32 (this table is why); time the kernel in float32 anyway.
    i4_f32 = Int4PackedLinear(
        i4_bf16.packed, i4_bf16.scales_and_zeros.float(), i4_bf16.group_size, None, None
    )
    shuffle = torch.randperm(unpacked.g_idx.numel())
    act_order = unpacked._replace(
        intweight=unpacked.intweight[:, shuffle], g_idx=unpacked.g_idx[shuffle]
    )
    i4_act = Int4PackedLinear.from_unpacked(act_order, torch.bfloat16)
    assert i4_act is not None

    def expand(x: torch.Tensor) -> torch.Tensor:
        dense = expand_int4(i4_bf16.packed, i4_bf16.scales_and_zeros, i4_bf16.group_size)
        assert dense is not None  # the C kernels are built here
        return torch.mm(x.to(torch.bfloat16), dense)

    ao_int8 = ao_int8_linear(weight)
    packed = pack_gptq(unpacked.intweight, unpacked.scales, unpacked.zeros, unpacked.g_idx, 4)

    def reference(x: torch.Tensor) -> torch.Tensor:
        return x @ dequantize_gptq(**packed, bits=4).T

    return {
        "fp32": fp32,
        "bf16": lambda x: bf16(x.to(torch.bfloat16)),
        "i4-f32": i4_f32,
        "i4-bf16": lambda x: i4_bf16(x.to(torch.bfloat16)),
        "i4-bf16-act": lambda x: i4_act(x.to(torch.bfloat16)),
        "i4-expand": expand,
        "ao-int8": ao_int8,
        "ref": reference,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.micro.int4_linear", description=__doc__
    )
    parser.add_argument("--rows", default="1,32,256", help="row counts M")
    parser.add_argument("--group-size", type=int, default=128, help="inputs per quantization group")
    parser.add_argument("--rounds", type=int, default=15, help="round-robin timing rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows_list = parse_list(args.rows, int)
    names: list[str] = []
    table = []
    for in_features, out_features in SHAPES:
        fns = candidates(random_unpacked(out_features, in_features, args.group_size))
        names = [n for n in fns if n != "fp32"]
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            times = best_seconds(fns, x, args.rounds)
            base = times["fp32"]
            ratios = [round(times[n] / base, 2) for n in names]
            table.append([f"{in_features}x{out_features}", rows, round(base * 1e3, 3), *ratios])
    print(
        f"{torch.get_num_threads()} threads, 4-bit g{args.group_size}; time / fp32 FastLinear time"
    )
    print(format_table(["shape", "M", "fp32 ms", *names], table))


if __name__ == "__main__":
    main()
