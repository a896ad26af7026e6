"""Perplexity and resident weight bytes of a model, run through textgate's own shard model.

    python -m textgate.bench.model_tools.perplexity                      # the embedded default, fp32
    python -m textgate.bench.model_tools.perplexity --quantize int8 MODEL
    python -m textgate.bench.model_tools.perplexity --all                # the table in docs/quantization.md
    python -m textgate.bench.model_tools.perplexity --kv-cache-dtype int8 MODEL
    python -m textgate.bench.model_tools.perplexity --kv-table           # KV cache table (docs/quantization.md)

The model is loaded exactly as a shard loads it (`shard_server.models.load_model`, with the
`--quantize` method passed through to the weights loader), and reads the held-out text
shipped in `quantization/data/heldout.txt` in consecutive windows of `--window` tokens,
each scored from its own start (no context carried across windows). `--all` quantizes the
default model with `textgate quantize` (RTN, GPTQ, AWQ; cached under the work folder) and
prints one markdown row per method. `--kv-cache-dtype` stores the KV cache quantized
(kernels/kv_quant.py) as a shard with that flag does: each window is one prefill whose
attention reads its keys and values back from the cache. `--kv-table` prints one row per
weights dtype and KV cache dtype.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from textgate.kernels import AttentionMetadata
from textgate.kernels.kv_quant import KV_CACHE_DTYPES, kv_dtype_name, resolve_kv_cache_dtype
from textgate.quantization.algorithms import QuantizeOptions, QuantSpec, quantize_model
from textgate.quantization.algorithms.calibration import (
    evaluation_windows,
    heldout_text_path,
    read_text,
)
from textgate.quantization.registry import registered_methods
from textgate.quantization.resident import resident_bytes
from textgate.shard_server.loading.model_source import resolve_model
from textgate.shard_server.step.kv_cache import KVCache

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BLOCK_SIZE = 16


@dataclass(frozen=True)
class PerplexityResult:
    """One model's score on the held-out text."""

    perplexity: float
    num_tokens: int  # tokens scored (each window's first token has no prediction)
    weight_bytes: int  # resident bytes of the loaded model's weights
    seconds: float  # scoring time, loading excluded
    kv_cache_dtype: str = ""  # the cache's element dtype, e.g. int8, fp8_e4m3, float32
    kv_bytes_per_token: int = 0  # KV cache bytes per token, all layers, K and V (+ scales)


def perplexity(
    model_dir: str | Path,
    *,
    quantize: str | None = None,
    dtype: str = "float32",
    text: str | None = None,
    window: int = 512,
    max_windows: int | None = None,
    kv_cache_dtype: str = "auto",
) -> PerplexityResult:
    """exp(mean negative log-likelihood) of `text` (default: the held-out text), with the
    KV cache in `kv_cache_dtype` (auto: the weights' dtype; int8, fp8 / fp8_e4m3)."""
    from transformers import AutoTokenizer

    from textgate.shard_server.models import load_model

    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    model_dir = Path(model_dir)
    model = load_model(model_dir, _DTYPES[dtype], "cpu", quantize=quantize)
    model.set_kv_cache_dtype(resolve_kv_cache_dtype(kv_cache_dtype, model.dtype))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = evaluation_windows(tokenizer, text or read_text(heldout_text_path()), window)
    if max_windows is not None:
        windows = windows[:max_windows]
    num_blocks = math.ceil(window / _BLOCK_SIZE)
    cache = model.allocate_kv_cache(num_blocks=num_blocks, block_size=_BLOCK_SIZE)
    metadata = AttentionMetadata.build(
        query_lens=[window],
        context_lens=[0],
        block_tables=[list(range(num_blocks))],
        block_size=_BLOCK_SIZE,
    )
    rows = torch.arange(window)
    total_nll, started = 0.0, time.perf_counter()
    with torch.inference_mode():
        for tokens in windows:
            logits = model(tokens, metadata.positions(), cache, metadata, rows)  # [window, V]
            total_nll += float(F.cross_entropy(logits[:-1], tokens[1:], reduction="sum"))
    num_tokens = windows.shape[0] * (window - 1)
    return PerplexityResult(
        perplexity=math.exp(total_nll / num_tokens),
        num_tokens=num_tokens,
        weight_bytes=resident_bytes(model),
        seconds=time.perf_counter() - started,
        kv_cache_dtype=kv_dtype_name(cache.dtype),
        kv_bytes_per_token=KVCache.bytes_per_block(
            num_layers=model.num_layers,
            block_size=1,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=cache.dtype,
        ),
    )


@dataclass(frozen=True)
class TableRow:
    """One line of the fidelity table: how the model is made and how it is loaded."""

    label: str
    quantize: str | None  # the --quantize value the shard loads with
    dtype: str
    #: `textgate quantize` options making the checkpoint; None: the floating-point model.
    options: QuantizeOptions | None = None


def _int4(method: str, group_size: int, desc_act: bool = False) -> QuantizeOptions:
    return QuantizeOptions(method, QuantSpec(bits=4, group_size=group_size), desc_act=desc_act)


# AWQ runs at group size 64: AutoAWQ's layout cannot hold the default model's 576 inputs
# in groups of 128 (see docs/quantization.md), so RTN at 64 is its baseline.
TABLE = (
    TableRow("fp32", None, "float32"),
    TableRow("bf16", None, "bfloat16"),
    TableRow("int8 (W8A8 dynamic)", "int8", "float32"),
    TableRow("bitsandbytes LLM.int8", "bitsandbytes", "float32"),
    TableRow("bitsandbytes nf4", "bitsandbytes-nf4", "float32"),
    TableRow("bitsandbytes fp4", "bitsandbytes-fp4", "float32"),
    TableRow("RTN 4-bit g128", "gptq", "float32", _int4("rtn", 128)),
    TableRow("GPTQ 4-bit g128", "gptq", "float32", _int4("gptq", 128)),
    TableRow("GPTQ 4-bit g128 act-order", "gptq", "float32", _int4("gptq", 128, desc_act=True)),
    TableRow("RTN 4-bit g64", "gptq", "float32", _int4("rtn", 64)),
    TableRow("AWQ 4-bit g64", "awq", "float32", _int4("awq", 64)),
)


def checkpoint_for(row: TableRow, base: Path, work_dir: Path) -> Path:
    """The folder `row` loads: the base model, or its quantized copy (made once, cached)."""
    if row.options is None:
        return base
    options = row.options
    act = "-act" if options.desc_act else ""
    name = f"{base.name}-{options.method}-{options.spec.bits}b-g{options.spec.group_size}{act}"
    target = work_dir / name
    if not (target / "config.json").is_file():
        report = quantize_model(base, target, row.options)
        print(f"quantized {row.label} in {report.seconds:.0f} s -> {target}", file=sys.stderr)
    return target


def run_table(args: argparse.Namespace) -> int:
    base = resolve_model(None if args.model in (None, "default") else args.model)
    work_dir = Path(args.work_dir) if args.work_dir else base.parent / "quantized"
    text = read_text(args.text) if args.text else None
    print(f"held-out text: {args.text or heldout_text_path().name}, window {args.window}\n")
    print("| method | --quantize | dtype | perplexity | weight bytes (resident) |")
    print("|---|---|---|---:|---:|")
    skipped = []
    for row in TABLE:
        if row.quantize is not None and row.quantize not in registered_methods():
            skipped.append(row.label)
            continue
        result = perplexity(
            checkpoint_for(row, base, work_dir),
            quantize=row.quantize,
            dtype=row.dtype,
            text=text,
            window=args.window,
            max_windows=args.max_windows,
        )
        print(
            f"| {row.label} | {row.quantize or '-'} | {row.dtype} | {result.perplexity:.3f} | "
            f"{result.weight_bytes:,} |",
            flush=True,
        )
    if skipped:
        print(f"\nnot measured (method not registered here): {', '.join(skipped)}")
    return 0


#: The KV cache table's rows: (weights dtype, --kv-cache-dtype).
KV_TABLE = tuple((dtype, kv) for dtype in ("float32", "bfloat16") for kv in ("auto", "int8", "fp8"))


def run_kv_table(args: argparse.Namespace) -> int:
    """One row per weights dtype and KV cache dtype, on the (unquantized) model."""
    model_dir = resolve_model(None if args.model in (None, "default") else args.model)
    text = read_text(args.text) if args.text else None
    print(f"held-out text: {args.text or heldout_text_path().name}, window {args.window}\n")
    print("| weights | --kv-cache-dtype | KV element | KV bytes/token | perplexity | vs auto |")
    print("|---|---|---|---:|---:|---:|")
    baseline: dict[str, float] = {}
    for dtype, kv in KV_TABLE:
        result = perplexity(
            model_dir,
            quantize=args.quantize,
            dtype=dtype,
            text=text,
            window=args.window,
            max_windows=args.max_windows,
            kv_cache_dtype=kv,
        )
        base = baseline.setdefault(dtype, result.perplexity)
        print(
            f"| {dtype} | {kv} | {result.kv_cache_dtype} | {result.kv_bytes_per_token:,} | "
            f"{result.perplexity:.3f} | {100 * (result.perplexity / base - 1):+.2f}% |",
            flush=True,
        )
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The evaluator's flags (shared by `textgate perplexity`)."""
    parser.add_argument(
        "model", nargs="?", default=None, help="model folder (default: the embedded model)"
    )
    parser.add_argument("--quantize", default=None, help="weights loader method, as the launcher's")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache element dtype, as the launcher's (auto: the weights' dtype)",
    )
    parser.add_argument("--window", type=int, default=512, help="tokens per scored window")
    parser.add_argument("--max-windows", type=int, default=None, help="score only the first N")
    parser.add_argument("--text", default=None, help="text file (default: the held-out text)")
    parser.add_argument("--all", action="store_true", help="the docs table: every method")
    parser.add_argument(
        "--kv-table", action="store_true", help="the docs KV table: weights x KV cache dtypes"
    )
    parser.add_argument("--work-dir", default=None, help="--all: where quantized copies are cached")


def run(args: argparse.Namespace) -> int:
    """Run the evaluator for parsed `args`; prints the result, returns the exit code."""
    if args.all:
        return run_table(args)
    if args.kv_table:
        return run_kv_table(args)
    model_dir = resolve_model(None if args.model in (None, "default") else args.model)
    result = perplexity(
        model_dir,
        quantize=args.quantize,
        dtype=args.dtype,
        text=read_text(args.text) if args.text else None,
        window=args.window,
        max_windows=args.max_windows,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    print(
        f"perplexity {result.perplexity:.3f} over {result.num_tokens} tokens; "
        f"weights {result.weight_bytes:,} bytes resident; KV cache {result.kv_cache_dtype}, "
        f"{result.kv_bytes_per_token:,} bytes/token; {result.seconds:.1f} s"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.model_tools.perplexity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    sys.exit(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
