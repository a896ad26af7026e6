"""Gemma 2 and Gemma 3 (text) as a delta over the Llama model: sandwich norms, scaled
embeddings, and logit soft-capping.

What the shared blocks take from `ModelConfig` as options: (1 + w) RMSNorms (the 1 folded
at load), GeGLU, `query_pre_attn_scalar`, attention soft-capping (Gemma 2), alternating
sliding-window layers, Gemma 3's q/k norms and its sliding layers' own RoPE base. What
this module adds: the decoder layer's four norms, embeddings times sqrt(hidden_size) in
the model dtype, the final logits' soft-cap, and the attention backend that soft-caps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from textgate.kernels.attention import AttentionBackend, SdpaAttentionBackend
from textgate.quantization.weights import Weights
from textgate.shard_server.layers.norm import RMSNorm
from textgate.shard_server.models.config import ModelConfig
from textgate.shard_server.models.llama import (
    ForwardContext,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    add_rms_norm,
)
from textgate.shard_server.models.registry import register

log = logging.getLogger("textgate.shard")


class GemmaDecoderLayer(LlamaDecoderLayer):
    """The Llama layer with sandwich norms: the attention output is normed before its
    residual add (post_attention_layernorm), the MLP sits between pre_ and
    post_feedforward_layernorm."""

    def __init__(self, config: ModelConfig, weights: Weights, prefix: str, layer_idx: int) -> None:
        super().__init__(config, weights, prefix, layer_idx)
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.pre_feedforward_layernorm = RMSNorm.load(
            weights, f"{prefix}.pre_feedforward_layernorm", eps, offset
        )
        self.post_feedforward_layernorm = RMSNorm.load(
            weights, f"{prefix}.post_feedforward_layernorm", eps, offset
        )

    def forward(
        self, hidden: Tensor, residual: Tensor | None, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor]:
        normed, residual = add_rms_norm(self.input_layernorm, hidden, residual)
        attended, _ = self.post_attention_layernorm(self.self_attn(normed, ctx))
        normed, residual = add_rms_norm(self.pre_feedforward_layernorm, attended, residual)
        out, _ = self.post_feedforward_layernorm(self.mlp(normed))
        return out, residual


@register("gemma2", "gemma3_text")
class GemmaForCausalLM(LlamaForCausalLM):
    """A Gemma 2 / Gemma 3 text model for one tensor-parallel rank."""

    decoder_layer = GemmaDecoderLayer

    def __init__(
        self,
        config: ModelConfig | Mapping[str, Any] | Any,
        weights: Weights,
        attention_backend: AttentionBackend[Any] | None = None,
    ) -> None:
        super().__init__(config, weights, attention_backend)
        config = self.config
        if (
            config.attn_softcap is not None
            and not self.attention_backend.supports_softcap_and_sinks
        ):
            # Only the torch backend soft-caps scores; it serves the whole model.
            log.info(
                "%s soft-caps its attention: the torch attention backend serves it",
                config.model_type,
            )
            self.attention_backend = SdpaAttentionBackend()
        assert config.embed_scale is not None
        # transformers rounds the scale to the model dtype before multiplying (in bf16
        # sqrt(3072) = 55.43 is 55.5).
        self.embed_scale = torch.tensor(config.embed_scale, dtype=self.dtype, device=self.device)
        self.final_softcap = config.final_softcap

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.lm_head(hidden)  # [N, vocab]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()
