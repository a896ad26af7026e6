"""`python -m textgate.bench.gpu_kernels`: the native model's step on a GPU, against the HBM roofline.

No download: an 8B-shaped Llama (32 layers, hidden 4096, 32 heads, 8 kv heads,
intermediate 14336, vocab 128256) is built on the device from random weights (bf16;
the speed does not depend on the values). Measured, each the median of `--repeats` runs:
- a decode step (one new token per sequence, every sequence `--context` tokens deep) at
  batch 1/32/128, for each attention backend (torch, triton, flash: those registered and
  runnable here), with CUDA graphs off and on (`shard_server/cuda_graphs.py`);
- its ratio to the HBM roofline: the bytes a decode step must move (every linear weight
  once, plus the batch's whole KV context) ÷ the GPU's bandwidth (datasheet figures for
  known GPUs, or `--bandwidth-gbs`). 1.0 would be a step that only streams memory;
- a prefill of `--prefill-tokens` (2k) tokens as one sequence: tokens/s and TFLOP/s.
Every decode row also checks its logits against the torch backend's eager step
(`max_diff`), so a wrong graph or kernel shows up as a number, not as a fast row.

`--shape tiny` runs the same code on CPU in seconds (tests/bench/test_gpu_kernels.py);
on CPU "graphs on" replays an eager stand-in (cuda_graphs.eager_capture): it exercises
the runner, its times mean nothing. Output: a markdown table (stdout, `--markdown`) and
JSON (`--json`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from textgate.kernels import AttentionMetadata, get_attention_backend
from textgate.quantization.registry import get_weights_loader
from textgate.quantization.weights import Shard, Weights
from textgate.shard_server.cuda_graphs import (
    CudaGraphCapture,
    DecodeGraphRunner,
    eager_capture,
    graph_safe,
)

BLOCK_SIZE = 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Peak HBM bandwidth in GB/s from the vendors' datasheets, matched in order against
# torch.cuda.get_device_name (more specific names first).
KNOWN_BANDWIDTH_GBS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB parts
    ("L40S", 864.0),
    ("L4", 300.0),
)


@dataclass(frozen=True)
class ModelShape:
    """A Llama's dimensions (what the step's cost depends on)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def config(self) -> dict[str, Any]:
        """An HF-style config.json for it."""
        return {
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor's name and shape."""
        kv = self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab, self.hidden),
            "model.norm.weight": (self.hidden,),
            "lm_head.weight": (self.vocab, self.hidden),
        }
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            shapes |= {
                f"{p}.input_layernorm.weight": (self.hidden,),
                f"{p}.post_attention_layernorm.weight": (self.hidden,),
                f"{p}.self_attn.q_proj.weight": (self.hidden, self.hidden),
                f"{p}.self_attn.k_proj.weight": (kv, self.hidden),
                f"{p}.self_attn.v_proj.weight": (kv, self.hidden),
                f"{p}.self_attn.o_proj.weight": (self.hidden, self.hidden),
                f"{p}.mlp.gate_proj.weight": (self.intermediate, self.hidden),
                f"{p}.mlp.up_proj.weight": (self.intermediate, self.hidden),
                f"{p}.mlp.down_proj.weight": (self.hidden, self.intermediate),
            }
        return shapes

    def linear_params(self) -> int:
        """Weights every decode step multiplies by: all projections and the lm head."""
        kv = self.num_kv_heads * self.head_dim
        per_layer = 2 * self.hidden * self.hidden + 2 * kv * self.hidden
        per_layer += 3 * self.intermediate * self.hidden
        return self.num_layers * per_layer + self.vocab * self.hidden

    def kv_bytes_per_token(self, element_size: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


SHAPES = {
    "8b": ModelShape("8b", 32, 4096, 32, 8, 14336, 128256),
    "tiny": ModelShape("tiny", 2, 128, 4, 2, 256, 512, 2048),
}
SHAPE_DEFAULTS = {"8b": {"context": 1024, "prefill": 2048}, "tiny": {"context": 64, "prefill": 256}}


class RandomWeights(Weights):
    """A checkpoint of random tensors made on the device as they are read (no file).

    Norm weights are ones, everything else N(0, 0.02²): the activations stay finite
    through every layer, as in a trained model.
    """

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype
    ):
        self.device, self.dtype = device, dtype
        self.process_group = None
        self.aliases = {}
        self.loader = get_weights_loader(None)
        self._routing = dict.fromkeys(shapes, "random")
        self._handles = {}
        self._shapes = shapes
        self._generator = torch.Generator(device).manual_seed(0)

    def get_shape(self, name: str) -> list[int]:
        return list(self._shapes[name])

    def get_tensor(self, name: str, *, to_dtype: bool = True) -> torch.Tensor:
        return self._make(name, self._shapes[name])

    def get_partial(
        self, name: str, dim: int, shard: Shard, *, to_dtype: bool = True
    ) -> torch.Tensor:
        shape = list(self._shapes[name])
        shape[dim] = shard.stop - shard.start
        return self._make(name, tuple(shape))

    def _make(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if "norm" in name:
            return torch.ones(shape, device=self.device, dtype=self.dtype)
        out = torch.empty(shape, device=self.device, dtype=self.dtype)
        return out.normal_(0.0, 0.02, generator=self._generator)


def build_model(shape: ModelShape, device: torch.device, dtype: torch.dtype) -> Any:
    """The native Llama of `shape` with random weights on `device`."""
    from textgate.shard_server.models.llama import LlamaForCausalLM

    weights = RandomWeights(shape.tensor_shapes(), device, dtype)
    return LlamaForCausalLM(shape.config(), weights, get_attention_backend("torch"))


@dataclass(frozen=True)
class StepInputs:
    """A step's model inputs: every sequence `context` tokens deep plus `query` new ones."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    blocks_per_seq: int

    @classmethod
    def build(
        cls,
        batch: int,
        context: int,
        query: int,
        vocab: int,
        device: torch.device,
        first_block: int = 0,
    ) -> StepInputs:
        """Sequence i owns blocks from first_block + i * blocks_per_seq on."""
        per_seq = -(-(context + query) // BLOCK_SIZE)
        tables = [
            list(range(first_block + i * per_seq, first_block + (i + 1) * per_seq))
            for i in range(batch)
        ]
        metadata = AttentionMetadata.build(
            query_lens=[query] * batch,
            context_lens=[context] * batch,
            block_tables=tables,
            block_size=BLOCK_SIZE,
            device=device,
        )
        generator = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, vocab, (batch * query,), generator=generator)
        positions = torch.arange(context, context + query).repeat(batch)
        ends = torch.arange(1, batch + 1) * query - 1
        return cls(ids.to(device), positions.to(device), metadata, ends.to(device), per_seq)


@dataclass
class KernelRow:
    """One measured step."""

    kind: str  # "decode" or "prefill"
    backend: str
    graphs: str  # "off", "on", "on (eager stand-in)" or "n/a: why"
    batch: int
    context: int
    tokens: int
    ms: float
    tokens_per_s: float
    roofline_ms: float | None = None
    roofline_ratio: float | None = None
    tflops: float | None = None
    max_diff: float | None = None
    """Largest |logit - torch backend's eager logit| of the step (decode rows)."""


@dataclass
class KernelReport:
    device: str
    shape: ModelShape
    dtype: str
    bandwidth_gbs: float | None
    bandwidth_source: str
    torch_version: str
    rows: list[KernelRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def bandwidth_for(device: torch.device, flag: float | None) -> tuple[float | None, str]:
    """(GB/s, where the figure came from): the flag, the datasheet table, or none."""
    if flag is not None:
        return flag, "--bandwidth-gbs"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, gbs in KNOWN_BANDWIDTH_GBS:
            if key in name:
                return gbs, f"datasheet ({key})"
    return None, "unknown (pass --bandwidth-gbs)"


def decode_bytes(shape: ModelShape, batch: int, context: int, element_size: int) -> int:
    """Bytes a decode step must move at least: every linear weight once, the batch's
    embedding rows, and its KV context read plus the new tokens' KV written."""
    weights = (shape.linear_params() + batch * shape.hidden) * element_size
    return weights + batch * (context + 1) * shape.kv_bytes_per_token(element_size)


def prefill_flops(shape: ModelShape, tokens: int) -> float:
    """Multiply-adds ×2 of a causal prefill: the linears, then QKᵀ and PV over half of T²."""
    return 2.0 * shape.linear_params() * tokens + 2.0 * shape.num_layers * shape.hidden * tokens**2


def median_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn` after two untimed runs (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def run(args: argparse.Namespace) -> KernelReport:
    device = torch.device(args.device)
    shape, dtype = SHAPES[args.shape], DTYPES[args.dtype]
    element = torch.empty((), dtype=dtype).element_size()
    bandwidth, source = bandwidth_for(device, args.bandwidth_gbs)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report = KernelReport(name, shape, args.dtype, bandwidth, source, torch.__version__)
    torch.manual_seed(0)
    model = build_model(shape, device, dtype)
    batches, context = args.batch_sizes, args.context
    steps = {b: StepInputs.build(b, context, 1, shape.vocab, device) for b in batches}
    per_seq = steps[batches[-1]].blocks_per_seq
    # The largest batch's blocks, then the prefill's (so it never overwrites the decode
    # steps' context: every backend must see the same cache), then the graphs' scratch block.
    decode_blocks = max(batches) * per_seq
    num_blocks = decode_blocks + -(-args.prefill_tokens // BLOCK_SIZE) + 1
    cache = model.allocate_kv_cache(num_blocks, BLOCK_SIZE)
    reference: dict[int, torch.Tensor] = {}
    for backend_name in args.attention:
        try:
            model.attention_backend = get_attention_backend(backend_name)
            with torch.inference_mode():
                _bench_backend(
                    args, report, model, cache, steps, reference, backend_name, decode_blocks
                )
        except Exception as exc:  # a backend this machine cannot run is reported, not fatal
            report.skipped[backend_name] = f"{type(exc).__name__}: {exc}"
    for row in report.rows:
        if row.kind == "decode" and bandwidth is not None:
            moved = decode_bytes(shape, row.batch, row.context, element)
            row.roofline_ms = moved / (bandwidth * 1e9) * 1e3
            row.roofline_ratio = row.roofline_ms / row.ms
    return report


def _bench_backend(
    args: argparse.Namespace,
    report: KernelReport,
    model: Any,
    cache: Any,
    steps: dict[int, StepInputs],
    reference: dict[int, torch.Tensor],
    backend_name: str,
    prefill_first_block: int,
) -> None:
    device = torch.device(args.device)
    context = args.context
    for batch, step in steps.items():

        def eager(step: StepInputs = step) -> torch.Tensor:
            return model(step.input_ids, step.positions, cache, step.metadata, step.logits_indices)

        logits = eager()
        if backend_name == "torch":
            reference[batch] = logits.clone()
        diff = _max_diff(logits, reference.get(batch))
        if "off" in args.graphs:
            ms = median_ms(eager, device, args.repeats)
            report.rows.append(
                KernelRow(
                    "decode",
                    backend_name,
                    "off",
                    batch,
                    context,
                    batch,
                    ms,
                    batch / ms * 1e3,
                    max_diff=diff,
                )
            )
    if "on" in args.graphs:
        _bench_graphs(args, report, model, cache, steps, reference, backend_name)
    prefill = StepInputs.build(
        1, 0, args.prefill_tokens, report.shape.vocab, device, prefill_first_block
    )

    def prefill_step() -> torch.Tensor:
        return model(
            prefill.input_ids, prefill.positions, cache, prefill.metadata, prefill.logits_indices
        )

    ms = median_ms(prefill_step, device, max(args.repeats // 2, 1))
    tokens = args.prefill_tokens
    report.rows.append(
        KernelRow(
            "prefill",
            backend_name,
            "off",
            1,
            tokens,
            tokens,
            ms,
            tokens / ms * 1e3,
            tflops=prefill_flops(report.shape, tokens) / (ms * 1e-3) / 1e12,
        )
    )


def _bench_graphs(
    args: argparse.Namespace,
    report: KernelReport,
    model: Any,
    cache: Any,
    steps: dict[int, StepInputs],
    reference: dict[int, torch.Tensor],
    backend_name: str,
) -> None:
    device = torch.device(args.device)
    if device.type == "cuda" and not graph_safe(model.attention_backend):
        why = "n/a: backend reads lengths on the host"
        for batch in steps:
            report.rows.append(
                KernelRow(
                    "decode",
                    backend_name,
                    why,
                    batch,
                    args.context,
                    batch,
                    float("nan"),
                    float("nan"),
                )
            )
        return
    capture = CudaGraphCapture(device) if device.type == "cuda" else eager_capture
    label = "on" if device.type == "cuda" else "on (eager stand-in)"
    largest = steps[max(steps)]
    runner = DecodeGraphRunner(
        model,
        cache,
        list(steps),
        max_blocks_per_seq=largest.blocks_per_seq,
        scratch_block=cache.num_blocks - 1,
        capture=capture,
    )
    runner.capture()
    for batch, step in steps.items():

        def replay(step: StepInputs = step) -> torch.Tensor | None:
            return runner.run(step.input_ids, step.positions, step.metadata, step.logits_indices)

        logits = replay()
        assert logits is not None, f"batch {batch} has a graph of its own"
        diff = _max_diff(logits, reference.get(batch))
        ms = median_ms(replay, device, args.repeats)
        report.rows.append(
            KernelRow(
                "decode",
                backend_name,
                label,
                batch,
                args.context,
                batch,
                ms,
                batch / ms * 1e3,
                max_diff=diff,
            )
        )


def _max_diff(logits: torch.Tensor, reference: torch.Tensor | None) -> float | None:
    if reference is None:
        return None
    return float((logits.float() - reference.float()).abs().max())


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m textgate.bench.gpu_kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="default: bfloat16 on GPU, float32 on CPU",
    )
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
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    args.context = (
        args.context if args.context is not None else SHAPE_DEFAULTS[args.shape]["context"]
    )
    args.prefill_tokens = args.prefill_tokens or SHAPE_DEFAULTS[args.shape]["prefill"]
    args.attention = args.attention or (
        ["torch", "triton", "flash"] if on_gpu else ["torch", "cpu"]
    )
    args.batch_sizes = sorted(set(args.batch_sizes))
    if not args.batch_sizes or args.batch_sizes[0] < 1:
        parser.error("--batch-sizes must be positive")
    if args.context < 0 or args.prefill_tokens < 1 or args.repeats < 1:
        parser.error("--context must be >= 0, --prefill-tokens and --repeats >= 1")
    if set(args.graphs) - {"on", "off"}:
        parser.error("--graphs takes off, on or off,on")
    longest = max(args.context + 1, args.prefill_tokens)
    if longest > SHAPES[args.shape].max_positions:
        parser.error(f"{longest} tokens exceed the {args.shape} shape's positions")
    if "torch" in args.attention:  # the reference the others are checked against runs first
        args.attention.remove("torch")
        args.attention.insert(0, "torch")
    return args


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
