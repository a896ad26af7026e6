"""`python -m textgate.bench.micro.gpu_kernels`: the native model's step on a GPU, against the HBM roofline.

No download: an 8B-shaped Llama (32 layers, hidden 4096, 32 heads, 8 kv heads,
intermediate 14336, vocab 128256) is built on the device from random weights (bf16;
the speed does not depend on the values). Measured, each the median of `--repeats` runs:
- a decode step (one new token per sequence, every sequence `--context` tokens deep) at
  batch 1/32/128, for each attention backend (torch, triton, flash: those registered and
  runnable here), with CUDA graphs off and on (`shard_server/step/cuda_graphs.py`);
- its ratio to the HBM roofline: the bytes a decode step must move (every linear weight
  once, plus the batch's whole KV context) ÷ the GPU's bandwidth (datasheet figures for
  known GPUs, or `--bandwidth-gbs`). 1.0 would be a step that only streams memory;
- a prefill of `--prefill-tokens` (2k) tokens as one sequence: tokens/s and TFLOP/s.
Every decode row also checks its logits against the torch backend's eager step
(`max_diff`), so a wrong graph or kernel shows up as a number, not as a fast row.

`--shape tiny` runs the same code on CPU in seconds (tests/bench/micro/test_gpu_kernels.py);
on CPU "graphs on" replays an eager stand-in (cuda_graphs.eager_capture): it exercises
the runner, its times mean nothing. Output: a markdown table (stdout, `--markdown`) and
JSON (`--json`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from textgate.bench.micro.gpu_model import SHAPE_DEFAULTS, SHAPES
from textgate.bench.micro.gpu_runs import KernelReport, run
from textgate.bench.serving.roofline import DTYPES


def markdown(report: KernelReport) -> str:
    """The report as markdown: a header line, the table, skipped backends."""
    bandwidth = (
        f"{report.bandwidth_gbs:.0f} GB/s, {report.bandwidth_source}"
        if report.bandwidth_gbs
        else report.bandwidth_source
    )
    lines = [
        f"**{report.device}**, {report.shape.name}-shaped Llama ({report.dtype}, random weights), "
        f"torch {report.torch_version}; HBM roofline at {bandwidth}",
        "",
        "| step | attention | CUDA graphs | batch | context | ms | tokens/s | roofline ms | of roofline | TFLOP/s | max diff vs torch |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report.rows:
        cells = [
            row.kind,
            row.backend,
            row.graphs,
            str(row.batch),
            str(row.context),
            _num(row.ms, 3),
            _num(row.tokens_per_s, 1),
            _num(row.roofline_ms, 3),
            "" if row.roofline_ratio is None else f"{row.roofline_ratio:.0%}",
            "" if row.tflops is None else f"{row.tflops:.3g}",
            "" if row.max_diff is None else f"{row.max_diff:.2g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [f"\nNot run: `{name}`: {why}" for name, why in report.skipped.items()]
    return "\n".join(lines) + "\n"


def _num(value: float | None, digits: int) -> str:
    if value is None or value != value:  # None or NaN
        return ""
    return f"{value:.{digits}f}"


def _list(parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [parse(part) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.micro.gpu_kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_flags(parser)
    _add_run_flags(parser)
    _add_output_flags(parser)
    return parser


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """What is built: the shape, where, in which dtype."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="default: bfloat16 on GPU, float32 on CPU",
    )


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    """What is measured: the steps, the backends, graphs, the roofline's bandwidth."""
    parser.add_argument("--batch-sizes", type=_list(int), default=[1, 32, 128])
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens of context per decoding sequence (8b: 1024)",
    )
    parser.add_argument(
        "--prefill-tokens", type=int, default=None, help="tokens of the prefill step (8b: 2048)"
    )
    parser.add_argument(
        "--attention",
        type=_list(str),
        default=None,
        help="backends, comma-separated (default: torch,triton,flash on GPU; torch,cpu on CPU)",
    )
    parser.add_argument(
        "--graphs",
        type=_list(str),
        default=["off", "on"],
        help="off,on: decode without and with CUDA graphs",
    )
    parser.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=None,
        help="HBM bandwidth for the roofline (default: the GPU's datasheet figure)",
    )
    parser.add_argument("--repeats", type=int, default=10)


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the markdown table here")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags, with the device's and the shape's defaults filled in, checked."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _fill_defaults(args)
    problem = _check(args)
    if problem:
        parser.error(problem)
    if "torch" in args.attention:  # the reference the others are checked against runs first
        args.attention.remove("torch")
        args.attention.insert(0, "torch")
    return args


def _fill_defaults(args: argparse.Namespace) -> None:
    """Defaults that depend on the device (dtype, backends) or the shape (lengths)."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    defaults = SHAPE_DEFAULTS[args.shape]
    args.context = args.context if args.context is not None else defaults["context"]
    args.prefill_tokens = args.prefill_tokens or defaults["prefill"]
    args.attention = args.attention or (
        ["torch", "triton", "flash"] if on_gpu else ["torch", "cpu"]
    )
    args.batch_sizes = sorted(set(args.batch_sizes))


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the filled-in flags, or None."""
    if not args.batch_sizes or args.batch_sizes[0] < 1:
        return "--batch-sizes must be positive"
    if args.context < 0 or args.prefill_tokens < 1 or args.repeats < 1:
        return "--context must be >= 0, --prefill-tokens and --repeats >= 1"
    if set(args.graphs) - {"on", "off"}:
        return "--graphs takes off, on or off,on"
    longest = max(args.context + 1, args.prefill_tokens)
    if longest > SHAPES[args.shape].max_positions:
        return f"{longest} tokens exceed the {args.shape} shape's positions"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    text = markdown(report)
    sys.stdout.write(text)
    if args.markdown is not None:
        args.markdown.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    if not report.rows:
        sys.exit("no attention backend could run: " + json.dumps(report.skipped))


if __name__ == "__main__":
    main()
