"""Build a native model from a local checkpoint folder (config.json + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from textgate.kernels import DEFAULT_ATTENTION_BACKEND, get_attention_backend
from textgate.quantization.registry import get_weights_loader
from textgate.quantization.weights import Weights
from textgate.shard_server.models.registry import get_model_class

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

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

    `quantize` names the weights loader; by default the checkpoint's own
    `quantization_config.quant_method` if any, else plain floating point.
    Raises UnsupportedModelError for model types without a native implementation.
    """
    path = Path(model_path)
    config = read_config(path)
    model_class = get_model_class(config.get("model_type"))
    quantization_config: dict[str, Any] = config.get("quantization_config") or {}
    method = quantize or quantization_config.get("quant_method")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    weights = Weights(
        files,
        device=device,
        dtype=_DTYPES[dtype] if isinstance(dtype, str) else dtype,
        process_group=process_group,
        loader=get_weights_loader(method, quantization_config),
    )
    return model_class(config, weights, get_attention_backend(attention_backend))


def read_config(path: Path) -> dict[str, Any]:
    """config.json of a checkpoint folder."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    config: dict[str, Any] = json.loads(config_file.read_text())
    return config
