"""The Llama-family model config: what the native models read from config.json."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from textgate.shard_server.layers.rotary import RopeConfig

# Families whose q/k/v projections carry a bias without saying so in config.json.
_QKV_BIAS_BY_DEFAULT = frozenset({"qwen2"})
_SUPPORTED_ACTIVATIONS = frozenset({"silu", "swish"})
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True)
class ModelConfig:
    """A validated, frozen view of a Llama / Mistral / Qwen2 config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    #: Bias on the q/k/v projections (Qwen2, or Llama's attention_bias).
    qkv_bias: bool
    #: Bias on the output projection (Llama's attention_bias only).
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    #: Per layer: the sliding attention window, or None for full attention.
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def parse(cls, config: ModelConfig | Mapping[str, Any] | Any) -> ModelConfig:
        """Accept a ModelConfig, a config.json dict, or a transformers config object."""
        if isinstance(config, ModelConfig):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        return cls.from_dict(config.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Read and validate a config.json dict."""
        model_type = d.get("model_type", "llama")
        activation = d.get("hidden_act", "silu")
        if activation not in _SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act={activation!r} is not supported (only silu)")
        num_heads = d["num_attention_heads"]
        num_layers = d["num_hidden_layers"]
        attention_bias = d.get("attention_bias")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=bool(
                attention_bias if attention_bias is not None else model_type in _QKV_BIAS_BY_DEFAULT
            ),
            o_bias=bool(attention_bias),
            mlp_bias=bool(d.get("mlp_bias", False)),
            rope=RopeConfig.from_config(d),
            sliding_windows=_sliding_windows(d, num_layers),
        )


def _sliding_windows(d: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Which layers attend within a window, in the ways the family's configs say it.

    `layer_types` (transformers 5) names each layer; otherwise Qwen2 slides from
    layer `max_window_layers` on when `use_sliding_window`, and Mistral slides on every
    layer whenever `sliding_window` is set.
    """
    window = d.get("sliding_window")
    if window is None or d.get("use_sliding_window") is False:
        return (None,) * num_layers
    layer_types = d.get("layer_types")
    if layer_types is None:
        first = d.get("max_window_layers", 0) if "use_sliding_window" in d else 0
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    unknown = set(layer_types) - _LAYER_TYPES
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"unsupported layer_types {layer_types!r}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
