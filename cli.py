"""`textgate`: the offline tools beside the server.

    textgate quantize --method gptq --bits 4 --group-size 128 [MODEL] OUT
    textgate perplexity [--quantize X] [MODEL]

MODEL is a local Hugging Face folder (config.json, safetensors, tokenizer), a hub id where
the machine is online, or `default` / absent for the embedded default model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _add_quantize(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from textgate.quantization.algorithms import METHODS

    parser = subparsers.add_parser(
        "quantize",
        help="write a GPTQ or AWQ checkpoint (RTN, GPTQ, AWQ on CPU)",
        description="Quantize a floating-point Llama-family checkpoint (dense or "
        "mixture-of-experts) on CPU. rtn and gptq "
        "write GPTQ's layout (quantize_config.json, quant_method gptq); awq writes AutoAWQ's "
        "GEMM layout (quant_method awq, version gemm).",
    )
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--bits", type=int, default=4, help="4 or 8 (gptq, rtn); awq: 4")
    parser.add_argument(
        "--group-size", type=int, default=128, help="inputs per scale/zero group; -1: per row"
    )
    parser.add_argument(
        "--desc-act", action="store_true", help="gptq: act-order (columns by Hessian diagonal)"
    )
    parser.add_argument(
        "--sym",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="symmetric grid (zero point mid-range); default: asymmetric",
    )
    parser.add_argument("--damp", type=float, default=0.01, help="gptq: damping (percdamp)")
    parser.add_argument(
        "--clip", action=argparse.BooleanOptionalAction, default=True, help="awq: clip search"
    )
    parser.add_argument(
        "--calibration", type=Path, default=None, help="text file (default: the shipped one)"
    )
    parser.add_argument("--num-samples", type=int, default=64, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    parser.add_argument(
        "--min-expert-tokens",
        type=int,
        default=32,
        help="gptq, MoE: an expert routed fewer calibration tokens falls back (docs/quantization.md)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no per-layer progress bar")
    parser.add_argument("model", nargs="?", default=None, help="model folder, or `default`")
    parser.add_argument("out", type=Path, help="output folder (must not exist, or be empty)")
    parser.set_defaults(run=_run_quantize)


def _run_quantize(args: argparse.Namespace) -> int:
    from textgate.quantization.algorithms import QuantizeOptions, QuantSpec, quantize_model
    from textgate.shard_server.loading.model_source import resolve_model

    options = QuantizeOptions(
        method=args.method,
        spec=QuantSpec(bits=args.bits, group_size=args.group_size, sym=args.sym),
        desc_act=args.desc_act,
        percdamp=args.damp,
        calibration=args.calibration,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        clip=args.clip,
        min_expert_tokens=args.min_expert_tokens,
    )
    model_dir = resolve_model(None if args.model in (None, "default") else args.model)
    report = quantize_model(model_dir, args.out, options, progress=not args.no_progress)
    tokens = (
        f", {report.num_calibration_tokens} calibration tokens"
        if report.num_calibration_tokens
        else ""
    )
    print(
        f"{report.method}: {report.num_layers} layers{tokens} in {report.seconds:.1f} s "
        f"-> {report.output}"
    )
    return 0


def _add_perplexity(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from textgate.bench.model_tools import perplexity

    parser = subparsers.add_parser(
        "perplexity",
        help="perplexity on the held-out text through the native shard model",
        description=perplexity.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    perplexity.add_arguments(parser)
    parser.set_defaults(run=perplexity.run)


def build_parser() -> argparse.ArgumentParser:
    """The `textgate` command line."""
    parser = argparse.ArgumentParser(
        prog="textgate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_quantize(subparsers)
    _add_perplexity(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    from textgate.shard_server.loading.model_source import ModelNotFoundError

    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, ModelNotFoundError) as exc:
        print(f"textgate {args.command}: error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
