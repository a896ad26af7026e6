"""Build a native model from a local checkpoint folder (config.json + safetensors)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from textgate.kernels import DEFAULT_ATTENTION_BACKEND, get_attention_backend
from textgate.quantization.registry import (
    UNQUANTIZED,
    UnsupportedQuantizationError,
    loader_class,
    registered_methods,
)
from textgate.quantization.resident import resident_bytes
from textgate.quantization.weights import Weights
from textgate.shard_server.models.registry import get_model_class

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger("textgate.shard")

QUANTIZE_CONFIG_FILE = "quantize_config.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    model_path: str | Path,
    dtype: torch.dtype | str,
    device: torch.device | str,
    process_group: ProcessGroup | None = None,
    *,
    quantize: str | None = None,
    attention_backend: str = DEFAULT_ATTENTION_BACKEND,
) -> nn.Module:
    """Load the native model in `model_path` for this rank of `process_group`.

    `quantize` names the weights loader; by default the checkpoint's own method (see
    `resolve_quantization`), else plain floating point. The model's `quantize` attribute
    says which method it was loaded with (None: unquantized).
    Raises UnsupportedModelError for model types without a native implementation and
    ValueError when `quantize` contradicts the checkpoint or cannot run on `device`.
    """
    path = Path(model_path)
    config = read_config(path)
    model_class = get_model_class(config.get("model_type"))
    method, quantization_config = resolve_quantization(path, config, quantize)
    loader_class(method).check_device(torch.device(device))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    weights = Weights(
        files,
        device=device,
        dtype=_DTYPES[dtype] if isinstance(dtype, str) else dtype,
        process_group=process_group,
        loader=loader_class(method).from_checkpoint(path, quantization_config),
    )
    model = model_class(config, weights, get_attention_backend(attention_backend))
    weights.loader.finish(model, path)
    model.quantize = method
    log.info(
        "Loaded %s (native %s) %s weights (%s) on %s: %.1f MiB resident, attention backend %s",
        config.get("model_type"),
        model_class.__name__,
        method or "unquantized",
        weights.dtype,
        weights.device,
        resident_bytes(model) / 2**20,
        attention_backend,
    )
    return model


def quantized_cpu_dtype(model_path: str | Path, quantize: str | None) -> torch.dtype | None:
    """The dtype `--dtype auto` must serve `model_path` in on a CPU for its quantization
    method's fast path (`WeightsLoader.cpu_dtype`); None: unquantized, or any dtype."""
    path = Path(model_path)
    method, quantization_config = resolve_quantization(path, read_config(path), quantize)
    return loader_class(method).from_checkpoint(path, quantization_config).cpu_dtype()


def resolve_quantization(
    path: Path, config: dict[str, Any], quantize: str | None
) -> tuple[str | None, dict[str, Any]]:
    """The quantization method to load `path` with, and the checkpoint's quantization config.

    The checkpoint's method comes from config.json's `quantization_config.quant_method`,
    or from a `quantize_config.json` beside it (AutoGPTQ's layout; GPTQ unless it says
    otherwise). `quantize` must agree with it; on a floating-point checkpoint it may name
    a method that quantizes at load (int8, bitsandbytes*), not one that needs quantized
    tensors (gptq, awq).
    """
    quantization_config: dict[str, Any] = dict(config.get("quantization_config") or {})
    legacy = path / QUANTIZE_CONFIG_FILE
    if not quantization_config and legacy.is_file():
        quantization_config = json.loads(legacy.read_text())
        quantization_config.setdefault("quant_method", "gptq")
    checkpoint_method = quantization_config.get("quant_method")
    if checkpoint_method is not None:
        checkpoint_method = str(checkpoint_method).lower()
        if quantize is not None and quantize != checkpoint_method:
            raise ValueError(
                f"--quantize {quantize} contradicts the checkpoint, which is already quantized "
                f"with {checkpoint_method!r}: drop --quantize, or pass --quantize "
                f"{checkpoint_method}"
            )
        if (
            checkpoint_method not in registered_methods()
            or loader_class(checkpoint_method).reads_float_checkpoint
        ):
            raise UnsupportedQuantizationError(
                f"the checkpoint is quantized with {checkpoint_method!r}, which textgate "
                f"cannot load; it loads gptq and awq checkpoints and quantizes floating-point "
                f"ones at load with: {', '.join(_at_load_methods())}"
            )
        return checkpoint_method, quantization_config
    if quantize is not None and not loader_class(quantize).reads_float_checkpoint:
        raise ValueError(
            f"--quantize {quantize} needs a checkpoint quantized with {quantize} "
            f"(no quantization_config in {path / 'config.json'}, so its weights are floating "
            f"point); quantize it first (`textgate quantize`), or quantize at load with one "
            f"of: {', '.join(_at_load_methods())}"
        )
    return quantize, {}


def _at_load_methods() -> list[str]:
    return [
        name
        for name in registered_methods()
        if name != UNQUANTIZED and loader_class(name).reads_float_checkpoint
    ]


def read_config(path: Path) -> dict[str, Any]:
    """config.json of a checkpoint folder."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    config: dict[str, Any] = json.loads(config_file.read_text())
    return config
