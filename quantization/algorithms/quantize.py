"""`textgate quantize`: a floating-point checkpoint in, a GPTQ or AWQ checkpoint out.

The model is loaded with transformers (float32, CPU) and quantized one decoder layer at a
time; a mixture-of-experts layer's experts each on the tokens routed to it (`experts.py`).
Each method is a `LayerQuantizer` registered by name (`layer_quantizers.py`): it
sees the layer and the calibration hidden states entering it, returns the layer's
quantized linear weights and the hidden states for the next layer.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from textgate.kernels.packing import UnpackedWeight
from textgate.quantization.algorithms.calibration import (
    calibration_samples,
    calibration_text_path,
    read_text,
)
from textgate.quantization.algorithms.checkpoint import write_checkpoint
from textgate.quantization.algorithms.experts import CHECKPOINT_NAMES, layer_experts
from textgate.quantization.algorithms.layer_quantizers import LAYER_QUANTIZERS
from textgate.quantization.algorithms.layers import (
    LINEAR_NAMES,
    CalibrationBatch,
    embed_calibration,
    input_groups,
    linear,
)
from textgate.quantization.algorithms.rtn import QuantSpec

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
    #: GPTQ: an expert routed fewer calibration tokens is not calibrated on them alone
    #: (`ExpertInputs.hessians`).
    min_expert_tokens: int = 32

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
        if self.search_tokens < 1 or self.chunk_size < 1 or self.min_expert_tokens < 1:
            raise ValueError("search_tokens, chunk_size and min_expert_tokens must be positive")

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


def quantize_model(
    model_dir: str | Path,
    output_dir: str | Path,
    options: QuantizeOptions,
    *,
    progress: bool = True,
) -> QuantizeReport:
    """Quantize the Llama-family checkpoint (dense or MoE) in `model_dir` into `output_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    _check_paths(model_dir, output_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.requires_grad_(False)
    layers = _decoder_layers(model)
    if options.method == "awq":
        _check_awq_layers(layers, options.spec)
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
            per_layer, next_hidden = LAYER_QUANTIZERS[options.method](layer, batch, options, config)
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
    model_type = str(model.config.model_type)
    if layers is None or not all(_is_supported(layer, model_type) for layer in layers):
        raise ValueError(
            f"model type {model_type!r} is not a Llama-family decoder (q/k/v/o_proj and "
            "gate/up/down_proj, or experts); textgate quantize supports llama, mistral, "
            f"qwen2, qwen3 and the mixture-of-experts {', '.join(CHECKPOINT_NAMES)}"
        )
    return list(layers)


def _is_supported(layer: nn.Module, model_type: str) -> bool:
    try:
        linears = [layer.get_submodule(n) for group in input_groups(layer) for n in group]
    except AttributeError:
        return False
    if not all(isinstance(module, nn.Linear) for module in linears):
        return False
    if not hasattr(layer.get_submodule("mlp"), "experts"):
        return True
    # A known family whose experts are not in the fused layout is refused with the reason.
    return model_type in CHECKPOINT_NAMES and layer_experts(layer) is not None


def _check_awq_layers(layers: list[nn.Module], spec: QuantSpec) -> None:
    if any(layer_experts(layer) is not None for layer in layers):
        raise ValueError("AWQ of mixture-of-experts models is not supported: use --method gptq")
    _check_awq_groups(layers[0], spec)


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


def _progress(layers: list[nn.Module], method: str, enabled: bool) -> Any:
    items = list(enumerate(layers))
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"{method} layers", unit="layer", file=sys.stderr)
