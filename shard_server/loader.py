"""Pick and load the implementation that serves a model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from textgate.shard_server.model import Model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU and bfloat16 on GPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_model(
    model_path: Path,
    model_id: str,
    dtype: str,
    rank: int = 0,
    world_size: int = 1,
    trust_remote_code: bool = False,
) -> Model[Any]:
    """Load `model_path` for this rank."""
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    torch_dtype = resolve_dtype(dtype, device)
    if world_size > 1:
        raise ValueError(
            "tensor parallel (--num-shard > 1) needs a native model implementation; "
            "this model is served through the transformers fallback, which runs one shard"
        )
    from textgate.shard_server.transformers_model import TransformersModel

    return TransformersModel(model_path, torch_dtype, device, model_id, trust_remote_code)
