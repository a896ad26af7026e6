"""What Gemma 2 and Gemma 3 (text) config.json files set beyond the Llama-shaped ModelConfig."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from textgate.shard_server.layers.rotary import RopeConfig

GEMMA_TYPES = frozenset({"gemma2", "gemma3_text"})
_ACTIVATIONS = frozenset({"gelu_pytorch_tanh"})
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# transformers' class defaults, for config.json files that leave a field out.
_SOFTCAPS = {"gemma2": (50.0, 30.0), "gemma3_text": (None, None)}
_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}
_THETAS = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma 3's


def gemma_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields a Gemma config sets, by name (they replace the Llama reading)."""
    model_type = d["model_type"]
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not a causal LM")
    activation = d.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"hidden_activation={activation!r} is not supported (gelu_pytorch_tanh)")
    attn_softcap, final_softcap = _SOFTCAPS[model_type]
    rope, local_rope = _ropes(d)
    return {
        "activation": activation,
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": d["hidden_size"] ** 0.5,
        "attention_scale": d.get("query_pre_attn_scalar", 256) ** -0.5,
        "attn_softcap": d.get("attn_logit_softcapping", attn_softcap),
        "final_softcap": d.get("final_logit_softcapping", final_softcap),
        "qk_norm": model_type == "gemma3_text",
        "rope": rope,
        "local_rope": local_rope,
        "sliding_windows": _sliding_windows(d),
    }


def _sliding_windows(d: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Per layer: `sliding_window` where `layer_types` says sliding, else None. Older
    configs have no layer_types: every `sliding_window_pattern`-th layer is full, the
    others slide (transformers' rule)."""
    num_layers, window = d["num_hidden_layers"], d.get("sliding_window", 4096)
    pattern = d.get("sliding_window_pattern") or _SLIDING_PATTERN[d["model_type"]]
    layer_types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    if set(layer_types) - _LAYER_TYPES or len(layer_types) != num_layers:
        raise ValueError(f"unsupported layer_types {layer_types!r}")
    slides = window is not None
    return tuple(window if slides and t == "sliding_attention" else None for t in layer_types)


def _ropes(d: Mapping[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """The full-attention layers' RoPE, and the sliding layers' where it is their own
    (Gemma 3: `rope_parameters` per layer type, or `rope_local_base_freq` in older files)."""
    if d["model_type"] != "gemma3_text":
        return RopeConfig.from_config(d), None
    nested = d.get("rope_parameters") or {}
    if "full_attention" in nested:
        per_type = {kind: dict(nested.get(kind) or {}) for kind in _THETAS}
    else:
        local_theta = d.get("rope_local_base_freq", _THETAS["sliding_attention"])
        per_type = {
            "full_attention": {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta")},
            "sliding_attention": {"rope_theta": local_theta},
        }
    ropes = []
    for kind, params in per_type.items():
        params["rope_theta"] = params.get("rope_theta") or _THETAS[kind]
        context = d.get("max_position_embeddings", 131_072)
        ropes.append(
            RopeConfig.from_config({"max_position_embeddings": context, "rope_parameters": params})
        )
    return ropes[0], ropes[1]
