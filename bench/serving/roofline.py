"""`python -m textgate.bench.serving.roofline`: the matmul-only ceiling of a decode step.

One decode step of a dense decoder must at least multiply the batch's hidden states by
every linear weight of the model (attention projections, MLP, lm_head). This times one
pass of `x @ W.T` over weights of exactly the model's shapes (read from the safetensors
headers; random values, the speed does not depend on them) at batch sizes 1 and 32 in
fp32 and bf16. Attention over the KV cache, norms, sampling and all serving overheads
come on top, so no engine can beat `batch / step_time` tokens/s on this machine:
engine throughput is reported as a fraction of it.

Below it, the memory-bandwidth floor: a decode step at small batch reads every weight
once, so it cannot take less than (bytes of the weights a step reads) / (the machine's
read bandwidth). The bandwidth is measured here (`read_bandwidth`: a sum over a tensor
far larger than the caches, best of N), and the floor is given per weight format
(`FORMATS`: float32, bfloat16, textgate's int8 and 4-bit layouts, or the exact resident
bytes a server reports in /info's `model_weight_bytes` with `--weight-bytes`), next to
the measured matmul pass of the same dtype.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class WeightFormat:
    """How one decode step's weights lie in memory, i.e. the bytes it must read."""

    name: str
    bits: int
    """Bits per weight element."""
    group_size: int = 0
    """Input elements sharing `group_bytes` of scales (and zeros); 0 = one set per output
    row, whatever its length."""
    group_bytes: int = 0
    head_bits: int | None = None
    """Bits per element of the lm_head where a format leaves it unquantized; None = as the
    other weights."""

    def step_bytes(self, shapes: Sequence[LinearShape]) -> int:
        """Bytes of every weight (and its scales) one decode step reads."""
        return sum(self._bytes(s) for s in shapes)

    def _bytes(self, shape: LinearShape) -> int:
        elements = shape.out_features * shape.in_features
        if self.head_bits is not None and "lm_head" in shape.name:
            return elements * self.head_bits // 8
        group = self.group_size or shape.in_features
        groups = shape.out_features * -(-shape.in_features // group)
        return elements * self.bits // 8 + groups * self.group_bytes


FORMATS = {
    f.name: f
    for f in (
        WeightFormat("float32", 32),
        WeightFormat("bfloat16", 16),
        # W8A8 (kernels/int8_linear.py): a float32 scale and an int32 column sum per row.
        WeightFormat("int8", 8, group_bytes=8),
        # GPTQ/AWQ (kernels/int4_linear.py): bf16 scale and zero per 128 inputs; the
        # checkpoints keep lm_head dense, in bf16 on CPU.
        WeightFormat("int4-g128", 4, group_size=128, group_bytes=4, head_bits=16),
    )
}


@dataclass(frozen=True)
class FloorRow:
    """The bandwidth floor of one decode step in one weight format."""

    format: str
    step_mb: float
    read_gb_per_s: float
    floor_ms: float
    floor_tok_per_s: float
    """At batch 1: one token per step."""
    measured_ms: float | None
    """The matmul-only pass of this dtype at batch 1, when it was timed."""


def read_bandwidth(
    num_bytes: int = 256 << 20,
    repeats: int = 5,
    device: str = "cpu",
    timer: Callable[[], float] = time.perf_counter,
) -> float:
    """The machine's memory read bandwidth in bytes/s: the fastest of `repeats` sums over a
    float32 tensor of `num_bytes` (far beyond the caches, so every byte comes from DRAM),
    all threads torch uses. The best, as for the roofline: slower repeats measure the
    neighbours."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        data.sum()  # fault the pages in, pick the kernel
        sync()
        best = float("inf")
        for _ in range(repeats):
            start = timer()
            data.sum()
            sync()
            best = min(best, timer() - start)
    return data.numel() * 4 / best


def floor_rows(
    step_bytes: dict[str, int], bandwidth: float, measured: Sequence[RooflineRow] = ()
) -> list[FloorRow]:
    """A FloorRow per named byte count, with the batch-1 pass of the same dtype beside it."""
    passes = {r.dtype: r.ms_per_step for r in measured if r.batch == 1}
    rows = []
    for name, num_bytes in step_bytes.items():
        seconds = num_bytes / bandwidth
        rows.append(
            FloorRow(
                format=name,
                step_mb=num_bytes / 1e6,
                read_gb_per_s=bandwidth / 1e9,
                floor_ms=seconds * 1e3,
                floor_tok_per_s=1 / seconds,
                measured_ms=passes.get(name),
            )
        )
    return rows


def format_floor(rows: Sequence[FloorRow]) -> str:
    """The bandwidth floor as a text table ("-" where no pass of that format was timed)."""
    headers = ("format", "MB/step", "read GB/s", "floor ms", "floor tok/s", "matmul pass ms")
    cells = [[*list(asdict(r).values())[:-1], r.measured_ms or "-"] for r in rows]
    return format_table(headers, cells)


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
    parser.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help="weight formats of the bandwidth floor, comma-separated; empty: no floor",
    )
    parser.add_argument(
        "--weight-bytes",
        type=int,
        default=None,
        help="also the floor for exactly this many bytes per step (a server's /info "
        "model_weight_bytes)",
    )
    parser.add_argument(
        "--bandwidth-mib", type=int, default=256, help="size of the bandwidth probe"
    )
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
    floors = _floor(args, shapes, rows)
    if args.json_out:
        context = {
            "model": str(model_dir),
            "device": args.device,
            "threads": torch.get_num_threads(),
        }
        records = [{**context, **asdict(r)} for r in rows]
        records += [{**context, "row": "floor", **asdict(r)} for r in floors]
        append_json_lines(args.json_out, records)
    return 0


def _floor(
    args: argparse.Namespace, shapes: Sequence[LinearShape], rows: Sequence[RooflineRow]
) -> list[FloorRow]:
    step_bytes = {name: FORMATS[name].step_bytes(shapes) for name in parse_names(args.formats)}
    if args.weight_bytes:
        step_bytes["--weight-bytes"] = args.weight_bytes
    if not step_bytes:
        return []
    bandwidth = read_bandwidth(args.bandwidth_mib << 20, args.repeats, args.device)
    floors = floor_rows(step_bytes, bandwidth, rows)
    print()
    print(
        f"bandwidth floor: weight bytes per decode step / {bandwidth / 1e9:.1f} GB/s read "
        f"(sum over {args.bandwidth_mib} MiB, best of {args.repeats})"
    )
    print(format_floor(floors))
    return floors


def parse_names(text: str) -> list[str]:
    """Comma-separated weight format names, each checked against FORMATS."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown weight formats {unknown}; known: {', '.join(FORMATS)}")
    return names


if __name__ == "__main__":
    sys.exit(main())
