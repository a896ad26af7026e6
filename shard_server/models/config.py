"""The Llama-family model config: what the native models read from config.json.

The family covers dense decoders (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3) and
sparse mixture-of-experts ones built on the same attention (Mixtral, Qwen2-MoE,
Qwen3-MoE); `MoEConfig` holds what the latter add, `gemma_config` what Gemma sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from textgate.shard_server.layers.rotary import RopeConfig
from textgate.shard_server.models.gemma_config import GEMMA_TYPES, gemma_fields

# Families whose q/k/v projections carry a bias without saying so in config.json.
_QKV_BIAS_BY_DEFAULT = frozenset({"qwen2", "qwen2_moe"})
# Families that RMS-normalise each query and key head before RoPE.
_QK_NORM = frozenset({"qwen3", "qwen3_moe"})
# Mixtral names its experts w1 / w3 / w2 under `block_sparse_moe`; the Qwen MoEs name them
# gate_proj / up_proj / down_proj under `mlp`, as a dense MLP does.
_MIXTRAL_NAMING = frozenset({"mixtral"})
_MOE_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe"})
# Families whose checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj.
_FUSED_PROJECTIONS = frozenset({"phi3"})
_SUPPORTED_ACTIVATIONS = frozenset({"silu", "swish"})
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: each token runs `top_k` of `num_experts` SwiGLU experts, weighted."""

    num_experts: int
    top_k: int
    #: Each expert's intermediate size.
    intermediate_size: int
    #: Renormalise the top-k softmax probabilities to sum to 1 (Mixtral always does;
    #: the Qwen MoEs when `norm_topk_prob`).
    normalize_top_k: bool
    #: A shared expert every token runs, scaled by sigmoid(its gate) (Qwen2-MoE); 0: none.
    shared_intermediate_size: int
    #: Per layer: True where the MLP is sparse, False where it is dense (`mlp_only_layers`,
    #: `decoder_sparse_step`).
    sparse_layers: tuple[bool, ...]
    #: "mixtral" (block_sparse_moe.experts.N.w1/w3/w2) or "qwen" (mlp.experts.N.*_proj).
    naming: str

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], num_layers: int) -> MoEConfig:
        model_type = d["model_type"]
        mixtral = model_type in _MIXTRAL_NAMING
        num_experts = d.get("num_local_experts") if mixtral else None
        num_experts = num_experts or d.get("num_experts") or d.get("num_local_experts")
        if not num_experts:
            raise ValueError(f"{model_type} config.json names no experts (num_experts)")
        top_k = d["num_experts_per_tok"]
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        step = d.get("decoder_sparse_step") or 1
        dense = set(d.get("mlp_only_layers") or ())
        return cls(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=d["intermediate_size"] if mixtral else d["moe_intermediate_size"],
            normalize_top_k=True if mixtral else bool(d.get("norm_topk_prob", False)),
            shared_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
            sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
            naming="mixtral" if mixtral else "qwen",
        )


@dataclass(frozen=True)
class ModelConfig:
    """A validated, frozen view of a Llama-family config.json (dense or MoE)."""

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
    #: RMSNorm over each query and key head before RoPE (Qwen3's q_norm / k_norm).
    qk_norm: bool = False
    #: The sparse MLP of a mixture-of-experts model; None for a dense one.
    moe: MoEConfig | None = None
    #: The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
    #: (Phi-3); the loader splits each per rank.
    fused_projections: bool = False
    #: The gated MLP's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, Gemma).
    activation: str = "silu"
    #: Added to every RMSNorm scale at load: Gemma stores w for a (1 + w) scale.
    norm_offset: float = 0.0
    #: Gemma's sandwich: the attention output normed before its residual add, and the MLP
    #: between pre_feedforward_layernorm and post_feedforward_layernorm.
    sandwich_norms: bool = False
    #: Embeddings times this, rounded to the model dtype first (Gemma: sqrt(hidden_size)).
    embed_scale: float | None = None
    #: The attention scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
    attention_scale: float | None = None
    #: Attention scores soft-capped to (-c, c) by c * tanh(s / c) (Gemma 2); None: not.
    attn_softcap: float | None = None
    #: The same soft-cap on the final logits (Gemma 2); None: not.
    final_softcap: float | None = None
    #: The sliding-window layers' own RoPE (Gemma 3's local base frequency); None: `rope`.
    local_rope: RopeConfig | None = None

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
        gemma = model_type in GEMMA_TYPES
        activation = d.get("hidden_act", "silu")
        if activation not in _SUPPORTED_ACTIVATIONS and not gemma:  # Gemma reads its own
            raise ValueError(f"hidden_act={activation!r} is not supported (only silu)")
        num_heads = d["num_attention_heads"]
        num_layers = d["num_hidden_layers"]
        attention_bias = d.get("attention_bias")
        # Llama's attention_bias covers q/k/v and o; Qwen2-MoE's qkv_bias q/k/v only.
        qkv_bias = d.get("qkv_bias", model_type in _QKV_BIAS_BY_DEFAULT)
        fields: dict[str, Any] = dict(
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
            qkv_bias=bool(attention_bias if attention_bias is not None else qkv_bias),
            o_bias=bool(attention_bias),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type in _QK_NORM,
            moe=MoEConfig.from_dict(d, num_layers) if model_type in _MOE_TYPES else None,
            fused_projections=model_type in _FUSED_PROJECTIONS,
        )
        if gemma:
            fields.update(gemma_fields(d))
        else:
            fields.update(
                rope=RopeConfig.from_config(d), sliding_windows=_sliding_windows(d, num_layers)
            )
        return cls(**fields)


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
