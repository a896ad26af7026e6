"""`textgate quantize`: a floating-point checkpoint in, a GPTQ or AWQ checkpoint out.

The model is loaded with transformers (float32, CPU) and quantized one decoder layer at a
time. Each method is a `LayerQuantizer` registered by name: it sees the layer and the
calibration hidden states entering it, returns the layer's quantized linear weights and
the hidden states for the next layer.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from textgate.quantization.algorithms.awq import apply_clip, search_clip, search_scales
from textgate.quantization.algorithms.calibration import (
    calibration_samples,
    calibration_text_path,
    read_text,
)
from textgate.quantization.algorithms.checkpoint import write_checkpoint
from textgate.quantization.algorithms.gptq import HessianAccumulator, gptq_quantize, split_rows
from textgate.quantization.algorithms.layers import (
    LINEAR_NAMES,
    CalibrationBatch,
    embed_calibration,
    linear,
    observe_inputs,
)
from textgate.quantization.algorithms.rtn import QuantSpec, rtn_quantize
from textgate.quantization.packing import UnpackedWeight, dequantize

METHODS = ("rtn", "gptq", "awq")


@dataclass(frozen=True)
class QuantizeOptions:
    """Everything `textgate quantize` takes besides the model and the output folder."""

    method: str
    spec: QuantSpec = field(default_factory=QuantSpec)
    #: GPTQ act-order: quantize columns by decreasing Hessian diagonal (g_idx recorded).
    desc_act: bool = False
    #: GPTQ damping, as a fraction of the Hessian's mean diagonal.
    percdamp: float = 0.01
    #: Calibration text; None: the one shipped in quantization/data.
    calibration: Path | None = None
    num_samples: int = 64
    seq_len: int = 256
    #: AWQ: search each group's clipping range after the scales.
    clip: bool = True
    #: AWQ: calibration rows (tokens) the scale and clip searches evaluate on.
    search_tokens: int = 2048
    #: Samples per forward call of a decoder layer (bounds activation memory).
    chunk_size: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.desc_act and self.method != "gptq":
            raise ValueError("--desc-act (act-order) applies to --method gptq only")
        if self.method == "awq" and (self.spec.bits != 4 or self.spec.sym):
            raise ValueError("AWQ's GEMM layout is 4-bit with zero points: use --bits 4 --no-sym")
        if self.method == "awq" and self.spec.group_size == -1:
            raise ValueError("AWQ's GEMM layout needs a positive --group-size (64 or 128)")
        if not 0 < self.percdamp < 1:
            raise ValueError(f"percdamp must be in (0, 1), got {self.percdamp}")
        if self.search_tokens < 1 or self.chunk_size < 1:
            raise ValueError("search_tokens and chunk_size must be positive")

    @property
    def needs_calibration(self) -> bool:
        return self.method != "rtn"


@dataclass(frozen=True)
class QuantizeReport:
    """What a run did: where it wrote, how many layers, how long it took."""

    output: Path
    method: str
    num_layers: int
    num_calibration_tokens: int
    seconds: float


#: A method's per-layer step: (decoder layer, calibration batch, options, model config)
#: -> (quantized linears by name under the layer, hidden states for the next layer).
LayerQuantizer = Callable[
    [nn.Module, CalibrationBatch | None, QuantizeOptions, Mapping[str, Any]],
    tuple[dict[str, UnpackedWeight], Tensor | None],
]
_LAYER_QUANTIZERS: dict[str, LayerQuantizer] = {}


def register(name: str) -> Callable[[LayerQuantizer], LayerQuantizer]:
    def wrap(fn: LayerQuantizer) -> LayerQuantizer:
        _LAYER_QUANTIZERS[name] = fn
        return fn

    return wrap


def quantize_model(
    model_dir: str | Path,
    output_dir: str | Path,
    options: QuantizeOptions,
    *,
    progress: bool = True,
) -> QuantizeReport:
    """Quantize the Llama-family checkpoint in `model_dir` into `output_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    _check_paths(model_dir, output_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.requires_grad_(False)
    layers = _decoder_layers(model)
    if options.method == "awq":
        _check_awq_groups(layers[0], options.spec)
    batch: CalibrationBatch | None = None
    with torch.inference_mode():
        if options.needs_calibration:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            text = read_text(options.calibration or calibration_text_path())
            tokens = calibration_samples(tokenizer, text, options.num_samples, options.seq_len)
            batch = embed_calibration(model, tokens, options.chunk_size)
        quantized: dict[str, UnpackedWeight] = {}
        config = model.config.to_dict()
        for index, layer in _progress(layers, options.method, progress):
            per_layer, next_hidden = _LAYER_QUANTIZERS[options.method](
                layer, batch, options, config
            )
            quantized.update({f"model.layers.{index}.{n}": w for n, w in per_layer.items()})
            if batch is not None and next_hidden is not None:
                batch.hidden = next_hidden
    write_checkpoint(model_dir, output_dir, model, quantized, options)
    return QuantizeReport(
        output=output_dir,
        method=options.method,
        num_layers=len(layers),
        num_calibration_tokens=0 if batch is None else options.num_samples * options.seq_len,
        seconds=time.perf_counter() - started,
    )


def _check_paths(model_dir: Path, output_dir: Path) -> None:
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json (not a model folder)")
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise FileExistsError(f"{output_dir} already exists and is not an empty folder")


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    if getattr(model.config, "quantization_config", None):
        raise ValueError("the model is already quantized; pass a floating-point checkpoint")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(_has_linears(layer) for layer in layers):
        raise ValueError(
            f"model type {model.config.model_type!r} is not a Llama-family decoder "
            "(q/k/v/o_proj and gate/up/down_proj); textgate quantize supports llama, mistral, qwen2"
        )
    return list(layers)


def _check_awq_groups(layer: nn.Module, spec: QuantSpec) -> None:
    """AutoAWQ's GEMM layout has no short last group: every input count must divide."""
    for name in LINEAR_NAMES:
        in_features = linear(layer, name).in_features
        if in_features % spec.group_size:
            sizes = [
                g
                for g in (128, 64, 32)
                if all(linear(layer, n).in_features % g == 0 for n in LINEAR_NAMES)
            ]
            hint = f"--group-size {sizes[0]} fits every layer, or " if sizes else ""
            raise ValueError(
                f"{name} has {in_features} inputs, not a multiple of --group-size "
                f"{spec.group_size}: AutoAWQ's GEMM layout needs whole groups "
                f"(use {hint}--method gptq, whose layout allows a short last group)"
            )


def _has_linears(layer: nn.Module) -> bool:
    try:
        return all(isinstance(layer.get_submodule(n), nn.Linear) for n in LINEAR_NAMES)
    except AttributeError:
        return False


def _progress(layers: list[nn.Module], method: str, enabled: bool) -> Any:
    items = list(enumerate(layers))
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"{method} layers", unit="layer", file=sys.stderr)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run the per-column and per-candidate loops on one thread.

    They are thousands of small ops, where OpenMP's barriers cost more than the work as
    soon as the cores are shared: measured on the 2-core CI machine under load, one GPTQ
    decoder layer 0.6-0.9 s on one thread vs 1.2-7.9 s on two; one AWQ layer 3.7 s vs
    15-22 s. The forward passes and Hessian products keep every thread.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _set_weight(layer: nn.Module, name: str, weight: UnpackedWeight) -> None:
    """Replace a linear's float weight by its quantized values (what a loader rebuilds)."""
    module = linear(layer, name)
    module.weight.data = dequantize(weight, module.weight.dtype)


@register("rtn")
def _rtn_layer(
    layer: nn.Module,
    batch: CalibrationBatch | None,
    options: QuantizeOptions,
    config: Mapping[str, Any],
) -> tuple[dict[str, UnpackedWeight], Tensor | None]:
    return {n: rtn_quantize(linear(layer, n).weight, options.spec) for n in LINEAR_NAMES}, None


# Linears that read the same input, quantized together on that input's Hessian.
_INPUT_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


@register("gptq")
def _gptq_layer(
    layer: nn.Module,
    batch: CalibrationBatch | None,
    options: QuantizeOptions,
    config: Mapping[str, Any],
) -> tuple[dict[str, UnpackedWeight], Tensor | None]:
    """Hessians from the float layer, GPTQ per input group, then the quantized layer's outputs."""
    assert batch is not None
    observed = [group[0] for group in _INPUT_GROUPS]
    hessians = {n: HessianAccumulator(linear(layer, n).in_features) for n in observed}
    with observe_inputs(layer, observed, lambda name, x: hessians[name].add(x)):
        batch.run(layer)
    quantized = {}
    for group in _INPUT_GROUPS:
        modules = [linear(layer, name) for name in group]
        with _one_thread():
            stacked = gptq_quantize(
                torch.cat([m.weight for m in modules]),  # [Σ out, in]
                hessians[group[0]].result(),
                options.spec,
                desc_act=options.desc_act,
                percdamp=options.percdamp,
            )
        parts = split_rows(stacked, [m.out_features for m in modules])
        for name, part in zip(group, parts, strict=True):
            quantized[name] = part
            _set_weight(layer, name, part)
    # The next layer calibrates on what this quantized layer really outputs.
    return quantized, batch.run(layer)


class _InputStats:
    """Per observed linear: mean |x| over every calibration row, and a fixed row sample."""

    def __init__(self, sample_rows: int, total_rows: int) -> None:
        self.stride = max(1, total_rows // sample_rows)
        self.abs_sum: dict[str, Tensor] = {}
        self.rows: dict[str, list[Tensor]] = {}
        self.count: dict[str, int] = {}

    def observe(self, name: str, inputs: Tensor) -> None:
        rows = inputs.reshape(-1, inputs.shape[-1]).float()
        self.abs_sum[name] = self.abs_sum.get(name, 0) + rows.abs().sum(dim=0)
        self.count[name] = self.count.get(name, 0) + rows.shape[0]
        self.rows.setdefault(name, []).append(rows[:: self.stride].clone())

    def mean_abs(self, name: str) -> Tensor:
        return self.abs_sum[name] / self.count[name]

    def sample(self, name: str) -> Tensor:
        return torch.cat(self.rows[name])


@register("awq")
def _awq_layer(
    layer: nn.Module,
    batch: CalibrationBatch | None,
    options: QuantizeOptions,
    config: Mapping[str, Any],
) -> tuple[dict[str, UnpackedWeight], Tensor | None]:
    """Scale search per input-sharing group, folded into the op before it; clip; round.

    As AutoAWQ does, the next layer calibrates on this layer's float outputs.
    """
    assert batch is not None
    observed = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]
    stats = _InputStats(options.search_tokens, batch.hidden.shape[0] * batch.hidden.shape[1])
    with observe_inputs(layer, observed, stats.observe):
        next_hidden = batch.run(layer)
    with _one_thread():
        return _awq_search_and_round(layer, stats, options), next_hidden


def _awq_search_and_round(
    layer: nn.Module, stats: _InputStats, options: QuantizeOptions
) -> dict[str, UnpackedWeight]:
    observed = list(stats.rows)
    spec = options.spec
    attn, mlp = layer.self_attn, layer.mlp
    inputs = {name: stats.sample(name) for name in observed}

    def scale_group(
        source: str, names: list[str], fold: Callable[[Tensor], None], **kw: Any
    ) -> None:
        weights = [linear(layer, n).weight for n in names]
        scales = _awq_scales(inputs[source], stats.mean_abs(source), weights, spec, **kw)
        fold(scales)
        for weight in weights:
            weight.data *= scales  # columns: W·diag(s)
        inputs[source] = inputs[source] / scales  # what the scaled layers now receive

    scale_group(
        "self_attn.q_proj",
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        lambda s: _divide_(layer.input_layernorm.weight, s),
    )
    if attn.v_proj.out_features == attn.o_proj.in_features:
        # v's output channels are o's input channels only without grouped-query attention.
        scale_group(
            "self_attn.o_proj", ["self_attn.o_proj"], lambda s: _divide_rows(attn.v_proj, s)
        )
    scale_group(
        "mlp.gate_proj",
        ["mlp.gate_proj", "mlp.up_proj"],
        lambda s: _divide_(layer.post_attention_layernorm.weight, s),
        inspect=_mlp_output(mlp.down_proj.weight.detach().clone()),
    )
    scale_group("mlp.down_proj", ["mlp.down_proj"], lambda s: _divide_rows(mlp.up_proj, s))

    if options.clip:
        clip_inputs = {
            "self_attn.v_proj": "self_attn.q_proj",
            "self_attn.o_proj": "self_attn.o_proj",
            "mlp.gate_proj": "mlp.gate_proj",
            "mlp.up_proj": "mlp.gate_proj",
            "mlp.down_proj": "mlp.down_proj",
        }  # q/k are left unclipped: attention scores amplify their errors (as AutoAWQ)
        for name, source in clip_inputs.items():
            module = linear(layer, name)
            clip_rows = inputs[source][:_CLIP_TOKENS]
            bounds = search_clip(clip_rows, module.weight, spec)
            module.weight.data = apply_clip(module.weight, bounds, spec)
    return {n: rtn_quantize(linear(layer, n).weight, spec) for n in LINEAR_NAMES}


# Rows the clipping search evaluates on (AutoAWQ uses 512 tokens).
_CLIP_TOKENS = 512


def _awq_scales(
    inputs: Tensor, mean_abs: Tensor, weights: list[Tensor], spec: QuantSpec, **kw: Any
) -> Tensor:
    scales, _, _ = search_scales(inputs, weights, spec, mean_abs=mean_abs, **kw)
    return scales


def _mlp_output(down: Tensor) -> Callable[[Tensor, list[Tensor]], Tensor]:
    """The MLP's output with candidate gate/up weights (down kept in float)."""

    def inspect(x: Tensor, weights: list[Tensor]) -> Tensor:
        gate, up = weights
        return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T

    return inspect


def _divide_(weight: Tensor, scales: Tensor) -> None:
    weight.data /= scales


def _divide_rows(module: nn.Linear, scales: Tensor) -> None:
    """Divide the output rows of `module` (and its bias) by the next layer's input scales."""
    module.weight.data /= scales.unsqueeze(1)
    if module.bias is not None:
        module.bias.data /= scales
