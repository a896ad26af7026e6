"""`python -m textgate.bench.serving.roofline`: the matmul-only ceiling of a decode step.

One decode step of a dense decoder must at least multiply the batch's hidden states by
every linear weight of the model (attention projections, MLP, lm_head). This times one
pass of `x @ W.T` over weights of exactly the model's shapes (read from the safetensors
headers; random values, the speed does not depend on them) at batch sizes 1 and 32 in
fp32 and bf16. Attention over the KV cache, norms, sampling and all serving overheads
come on top, so no engine can beat `batch / step_time` tokens/s on this machine:
engine throughput is reported as a fraction of it.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from textgate.bench.serving.report import append_json_lines, format_table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LinearShape:
    """One weight multiplied during decode: (out_features, in_features)."""

    name: str
    out_features: int
    in_features: int


@dataclass(frozen=True)
class RooflineRow:
    """The timing of one full pass over all linear weights."""

    dtype: str
    batch: int
    ms_per_step: float
    tok_per_s: float
    weight_gb: float
    gb_per_s: float
    gflop_per_s: float


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors file's JSON header (the tensors are not read)."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def linear_shapes(model_dir: str | Path) -> list[LinearShape]:
    """Every 2-D weight a decode step multiplies, plus lm_head (the embedding when tied)."""
    folder = Path(model_dir)
    shapes: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        shapes.update(safetensors_shapes(file))
    if not shapes:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    # Embeddings are a gather, not a matmul; 1-D tensors are norms and biases.
    linears = [
        LinearShape(name, shape[0], shape[1])
        for name, shape in shapes.items()
        if len(shape) == 2 and name.endswith(".weight") and "embed" not in name
    ]
    if not any("lm_head" in s.name for s in linears):
        embed = next((n for n in shapes if "embed_tokens" in n), None)
        if embed is not None:
            vocab, hidden = shapes[embed]
            linears.append(LinearShape("lm_head (tied to embed_tokens)", vocab, hidden))
    return linears


def time_pass(
    shapes: Sequence[LinearShape],
    batch: int,
    dtype: torch.dtype,
    repeats: int = 5,
    device: str = "cpu",
) -> float:
    """Fastest seconds of one pass of `x @ W.T` over all `shapes` at `batch` rows.

    The minimum, not the median: a ceiling is the best the machine can do, and on a shared
    machine slower repeats measure the neighbours, not the hardware.
    """
    torch.manual_seed(0)
    weights = [
        torch.randn(s.out_features, s.in_features, dtype=dtype, device=device) for s in shapes
    ]
    dims = {s.in_features for s in shapes}
    inputs = {d: torch.randn(batch, d, dtype=dtype, device=device) for d in dims}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def one_pass() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)  # [batch, in] → [batch, out]
        sync()  # GPU kernels are asynchronous: the pass ends when they finish

    with torch.inference_mode():
        one_pass()  # warm caches and kernel selection
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            one_pass()
            times.append(time.perf_counter() - start)
    return min(times)


def measure(
    shapes: Sequence[LinearShape],
    batches: Sequence[int] = (1, 32),
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    repeats: int = 5,
    device: str = "cpu",
) -> list[RooflineRow]:
    """A RooflineRow per (dtype, batch)."""
    params = sum(s.out_features * s.in_features for s in shapes)
    rows = []
    for name in dtypes:
        dtype = DTYPES[name]
        weight_bytes = params * torch.finfo(dtype).bits // 8
        for batch in batches:
            seconds = time_pass(shapes, batch, dtype, repeats, device)
            rows.append(
                RooflineRow(
                    dtype=name,
                    batch=batch,
                    ms_per_step=seconds * 1e3,
                    tok_per_s=batch / seconds,
                    weight_gb=weight_bytes / 1e9,
                    gb_per_s=weight_bytes / 1e9 / seconds,
                    gflop_per_s=2 * batch * params / 1e9 / seconds,
                )
            )
    return rows


def format_rows(rows: Sequence[RooflineRow]) -> str:
    """The roofline as a text table."""
    headers = ("dtype", "batch", "ms/step", "tok/s", "weights GB", "GB/s", "GFLOP/s")
    return format_table(headers, [list(asdict(r).values()) for r in rows])


def build_parser() -> argparse.ArgumentParser:
    """The command line of the roofline tool."""
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.serving.roofline", description=__doc__
    )
    parser.add_argument("--model", default=None, help="model folder (default: embedded model)")
    parser.add_argument("--batch", default="1,32", help="batch sizes, comma-separated")
    parser.add_argument("--dtype", default="float32,bfloat16", help="dtypes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, …")
    parser.add_argument("--json-out", default=None, help="append one JSON line per row")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Print the matmul-only ceiling for a model folder."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        model_dir = Path(args.model)
    else:
        from textgate.bench.serving.tokenizer import default_model_dir

        model_dir = default_model_dir()
    shapes = linear_shapes(model_dir)
    batches = [int(b) for b in args.batch.split(",")]
    rows = measure(shapes, batches, args.dtype.split(","), args.repeats, args.device)
    params = sum(s.out_features * s.in_features for s in shapes)
    print(
        f"roofline: {model_dir}: {len(shapes)} linear weights, {params / 1e6:.1f}M params, "
        f"{args.device}, {torch.get_num_threads()} threads"
    )
    print(format_rows(rows))
    if args.json_out:
        context = {
            "model": str(model_dir),
            "device": args.device,
            "threads": torch.get_num_threads(),
        }
        append_json_lines(args.json_out, [{**context, **asdict(r)} for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
