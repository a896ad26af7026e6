"""How many bytes a loaded model's weights occupy, whatever form its layers keep them in."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Layers keep weights in parameters and buffers, and also as plain tensor attributes
# (oneDNN-packed weights) or inside helper objects (bitsandbytes' quantization state,
# LLM.int8()'s matmul state); this is how deep those objects are followed.
_MAX_DEPTH = 3


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every distinct tensor storage the model's modules hold (shared storages,
    e.g. a tied head that is the embedding, count once)."""
    storages: dict[tuple[str, int], int] = {}
    for module in model.modules():
        for value in vars(module).values():
            _collect(value, storages, _MAX_DEPTH)
    return sum(storages.values())


def _collect(value: Any, storages: dict[tuple[str, int], int], depth: int) -> None:
    if isinstance(value, nn.Module) or depth < 0:
        return  # submodules are walked by model.modules()
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return
        if value.is_mkldnn:
            # Opaque oneDNN tensors have no storage; count their elements.
            key = (str(value.device), id(value))
            storages[key] = value.numel() * value.element_size()
        else:
            storage = value.untyped_storage()
            storages[(str(value.device), storage.data_ptr())] = storage.nbytes()
        extra = getattr(value, "__dict__", {})
        for item in extra.values():
            _collect(item, storages, depth - 1)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, storages, depth - 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, storages, depth - 1)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        for item in vars(value).values():
            _collect(item, storages, depth - 1)
