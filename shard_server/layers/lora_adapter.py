"""A PEFT LoRA adapter as read from its folder (`adapter_config.json`,
`adapter_model.safetensors`), checked for what this server can apply; where its updates
go in a native model is shard_server/layers/lora.py's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

# PEFT's target names -> (the native layer that holds them, the part's index in it; None:
# the whole fused layer, as Phi-3's checkpoints and PEFT's adapters of it name it).
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "qkv_proj": ("self_attn.qkv_proj", None),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "gate_up_proj": ("mlp.gate_up_proj", None),
    "down_proj": ("mlp.down_proj", 0),
}


PEFT_PREFIX = "base_model.model."
"""What PEFT's saved keys put before the module's path in the model."""


class LoraError(ValueError):
    """An adapter that cannot run on this base model; the message says why."""


@dataclass(frozen=True)
class LoraAdapter:
    """One PEFT adapter as read from its folder."""

    name: str
    rank: int
    scale: float
    #: The targeted module's path in the model (`model.layers.0.self_attn.q_proj`) ->
    #: (A [r, in], B [out, r])
    modules: dict[str, tuple[Tensor, Tensor]]

    @property
    def weights(self) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
        """(decoder layer index, PEFT target name) -> (A, B), as a native model's layers
        take them (LoraError for a module they do not have)."""
        return {_locate(self.name, path): pair for path, pair in self.modules.items()}

    @classmethod
    def load(
        cls,
        name: str,
        path: Path,
        dtype: torch.dtype,
        device: torch.device,
        max_rank: int | None = None,
    ) -> LoraAdapter:
        """Read `path`; LoraError for what this server cannot apply (a rank over
        `max_rank`, --max-lora-rank, included)."""
        config_path = path / "adapter_config.json"
        if not config_path.is_file():
            raise LoraError(f"LoRA adapter {name!r}: {path} has no adapter_config.json")
        config = json.loads(config_path.read_text())
        _check_config(name, config)
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        if max_rank is not None and rank > max_rank:
            raise LoraError(
                f"LoRA adapter {name!r} has rank {rank}, over --max-lora-rank {max_rank}"
            )
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        files = [path / "adapter_model.safetensors"]
        if not files[0].is_file():
            raise LoraError(f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors")
        tensors = load_file(files[0])
        modules: dict[str, tuple[Tensor, Tensor]] = {}
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors.get(key.replace(".lora_A.", ".lora_B."))
            if b is None:
                raise LoraError(f"LoRA adapter {name!r}: {key} has no lora_B")
            path = key.split(".lora_A.")[0].removeprefix(PEFT_PREFIX)
            modules[path] = (a.to(device, dtype), b.to(device, dtype))
        if not modules:
            raise LoraError(f"LoRA adapter {name!r}: no lora_A / lora_B weights in {files[0]}")
        return cls(name, rank, scale, modules)


def _check_config(name: str, config: Mapping[str, object]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r} is a {config.get('peft_type')} adapter, not LORA")
    for key in ("use_dora", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoraError(f"LoRA adapter {name!r} sets {key}, which is not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {name!r} trains biases (bias={config['bias']!r})")


def _locate(name: str, path: str) -> tuple[int, str]:
    """(layer index, target) of a module path `...layers.<i>.<module>.<target>`."""
    parts = path.split(".")
    target = parts[-1]
    if "layers" not in parts or target not in TARGETS:
        raise LoraError(
            f"LoRA adapter {name!r} targets {path}; supported: the decoder layers' "
            f"{', '.join(TARGETS)}"
        )
    return int(parts[parts.index("layers") + 1]), target
