"""The Llama family (Llama 1-3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, and the
mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE), tensor parallel, over a paged KV
cache.

One forward step takes a flat varlen batch (all sequences' new tokens concatenated)
and returns logits only for the rows the caller asks for. Differences within the family
are config switches: GQA, q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), sliding
windows (Mistral, Qwen2), tied embeddings, RoPE scaling (Phi-3's LongRoPE), fused
q/k/v and gate/up tensors in the checkpoint (Phi-3), and a sparse MoE MLP in place
of the dense one (`layers.moe`, on the layers the config makes sparse).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from textgate.kernels import cpu_attention, cpu_layers, get_attention_backend
from textgate.kernels.attention import AttentionBackend, AttentionMetadata
from textgate.kernels.cpu_attention import CpuAttentionBackend, CpuPlan
from textgate.kernels.cpu_decoder import DecoderLayerWeights, DecoderStack
from textgate.kernels.int8_linear import Int8Linear
from textgate.kernels.linear import FastLinear
from textgate.kernels.triton import layers as gpu_layers
from textgate.quantization.weights import Shard, Weights
from textgate.shard_server.layers.heads import HeadPartition
from textgate.shard_server.layers.mlp import GatedMLP, silu_and_mul
from textgate.shard_server.layers.moe import SparseMoE
from textgate.shard_server.layers.norm import RMSNorm
from textgate.shard_server.layers.rotary import RotaryEmbedding, apply_rotary_signed, signed_sin
from textgate.shard_server.layers.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelHead,
    TensorParallelRowLinear,
    world_size_of,
)
from textgate.shard_server.models.config import ModelConfig
from textgate.shard_server.models.paged_cache import PagedCacheOwner
from textgate.shard_server.models.registry import register
from textgate.shard_server.step.kv_cache import KVCache


@dataclass
class ForwardContext:
    """What every layer of one step shares: rotary tables, the cache and the attention plan."""

    cos: Tensor  # [T, rotary_dim]
    sin_signed: Tensor  # [T, rotary_dim], see rotary.signed_sin
    kv_cache: KVCache
    metadata: AttentionMetadata
    backend: AttentionBackend[Any]
    plan: Any
    #: The sliding layers' own tables (ModelConfig.local_rope); None: they use cos / sin.
    local_cos_sin: tuple[Tensor, Tensor] | None = None

    def rotary(self, local: bool) -> tuple[Tensor, Tensor]:
        """(cos, sin_signed) for a layer: the local tables where it asks and they exist."""
        if local and self.local_cos_sin is not None:
            return self.local_cos_sin
        return self.cos, self.sin_signed


class LlamaAttention(nn.Module):
    """Fused q/k/v projection, RoPE, paged attention, output projection (this rank's heads)."""

    def __init__(self, config: ModelConfig, weights: Weights, prefix: str, layer_idx: int) -> None:
        super().__init__()
        heads = HeadPartition.for_rank(
            config.num_heads, config.num_kv_heads, weights.rank, weights.world_size
        )
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = config.head_dim
        q_rows = HeadPartition.rows(heads.q, config.head_dim)
        kv_rows = HeadPartition.rows(heads.kv, config.head_dim)
        self.qkv_proj = _qkv_proj(config, weights, prefix, [q_rows, kv_rows, kv_rows])
        self.o_proj = TensorParallelRowLinear.load(
            weights, f"{prefix}.o_proj", bias=config.o_bias, shard=q_rows
        )
        self.layer_idx = layer_idx
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_idx]
        # Only the backends that soft-cap take the argument at all.
        self.extras = {} if config.attn_softcap is None else {"softcap": config.attn_softcap}
        self.qk_norm: tuple[RMSNorm, RMSNorm] | None = None
        if config.qk_norm:
            eps, offset = config.rms_norm_eps, config.norm_offset
            self.q_norm = RMSNorm.load(weights, f"{prefix}.q_norm", eps, offset)
            self.k_norm = RMSNorm.load(weights, f"{prefix}.k_norm", eps, offset)
            self.qk_norm = (self.q_norm, self.k_norm)

    def forward(self, hidden: Tensor, ctx: ForwardContext) -> Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H_q + 2 H_kv) * D]
        if self.qk_norm is not None:
            qkv = self._normalize_heads(qkv, *self.qk_norm)
        key_cache, value_cache = ctx.kv_cache.layer(self.layer_idx)
        cos, sin = ctx.rotary(local=self.sliding_window is not None)
        query = self._fused_rotary_and_store(qkv, ctx, cos, sin, key_cache, value_cache)
        if query is None:
            query = self._rotary_and_store(qkv, ctx, cos, sin)  # [T, H_q, D]
        key_scales, value_scales = ctx.kv_cache.layer_scales(self.layer_idx)
        out = ctx.backend.forward(
            query,
            key_cache,
            value_cache,
            ctx.plan,
            scale=self.scale,
            sliding_window=self.sliding_window,
            key_scales=key_scales,
            value_scales=value_scales,
            **self.extras,
        )  # [T, H_q, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _normalize_heads(self, qkv: Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> Tensor:
        """q/k/v with every query and key head RMS-normalised over head_dim (Qwen3), so the
        rotary kernels that follow read it as they read any q/k/v."""
        num_tokens, dim = qkv.shape[0], self.head_dim
        query, key, value = qkv.split(
            [self.num_heads * dim, self.num_kv_heads * dim, self.num_kv_heads * dim], -1
        )
        query, _ = q_norm(query.reshape(-1, dim))
        key, _ = k_norm(key.reshape(-1, dim))
        return torch.cat([query.view(num_tokens, -1), key.view(num_tokens, -1), value], dim=-1)

    def _fused_rotary_and_store(
        self,
        qkv: Tensor,
        ctx: ForwardContext,
        cos: Tensor,
        sin_signed: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
    ) -> Tensor | None:
        """Rotated queries [T, H_q, D] from the first fused kernel that runs here (C on the
        CPU, its int8 / fp8 cache variant, Triton on the GPU), keys and values stored; None
        where none does (the caller then runs `_rotary_and_store`)."""
        if cos.shape[-1] != self.head_dim:
            return None  # the kernels rotate whole heads; a partial rotary runs the reference
        slots = ctx.metadata.slot_mapping
        # The plain CPU and GPU kernels share one signature: one argument list for both.
        heads = (self.num_heads, self.num_kv_heads)
        args = (qkv, cos, sin_signed, key_cache, value_cache, slots, *heads)
        query = cpu_layers.rotary_and_store(*args)
        if query is None:
            query = cpu_attention.rotary_and_store_quantized(
                qkv,
                cos,
                sin_signed,
                (key_cache, value_cache),
                ctx.kv_cache.layer_scales(self.layer_idx),
                slots,
                *heads,
            )
        if query is None:
            query = gpu_layers.rotary_and_store(*args)
        return query

    def _rotary_and_store(
        self, qkv: Tensor, ctx: ForwardContext, cos: Tensor, sin_signed: Tensor
    ) -> Tensor:
        """The reference of cpu_layers.rotary_and_store: rotated queries [T, H_q, D]."""
        num_tokens = qkv.shape[0]
        num_qk = self.num_heads + self.num_kv_heads
        query_key, value = qkv.split(
            [num_qk * self.head_dim, self.num_kv_heads * self.head_dim], -1
        )
        # Queries and keys rotate in one pass: half the small ops of a decode step's RoPE.
        query_key = apply_rotary_signed(
            query_key.view(num_tokens, num_qk, self.head_dim), cos, sin_signed
        )  # [T, H_q + H_kv, D]
        query, key = query_key.split([self.num_heads, self.num_kv_heads], dim=1)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        ctx.kv_cache.store(self.layer_idx, key, value, ctx.metadata.slot_mapping)
        return query


def _qkv_proj(
    config: ModelConfig, weights: Weights, prefix: str, shards: list[Shard]
) -> TensorParallelColumnLinear:
    """This rank's q, k and v heads in one column linear, from three tensors or from the
    one fused `qkv_proj` of the checkpoint (Phi-3)."""
    if not config.fused_projections:
        names = [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"]
        return TensorParallelColumnLinear.load_multi(
            weights, names, bias=config.qkv_bias, shards=shards
        )
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    return TensorParallelColumnLinear.load_fused(
        weights,
        f"{prefix}.qkv_proj",
        bias=config.qkv_bias,
        sizes=[q_size, kv_size, kv_size],
        shards=shards,
    )


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks around one residual stream."""

    def __init__(self, config: ModelConfig, weights: Weights, prefix: str, layer_idx: int) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.input_layernorm = RMSNorm.load(weights, f"{prefix}.input_layernorm", eps, offset)
        self.self_attn = LlamaAttention(config, weights, f"{prefix}.self_attn", layer_idx)
        self.post_attention_layernorm = RMSNorm.load(
            weights, f"{prefix}.post_attention_layernorm", eps, offset
        )
        self.mlp = _mlp(config, weights, prefix, layer_idx)

    def forward(
        self, hidden: Tensor, residual: Tensor | None, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor]:
        normed, residual = add_rms_norm(self.input_layernorm, hidden, residual)
        attended = self.self_attn(normed, ctx)
        normed, residual = add_rms_norm(self.post_attention_layernorm, attended, residual)
        return self.mlp(normed), residual


def _mlp(config: ModelConfig, weights: Weights, prefix: str, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s MLP: dense SwiGLU, or the sparse MoE block where the config has one."""
    moe = config.moe
    if moe is None or not moe.sparse_layers[layer_idx]:
        fused_size = config.intermediate_size if config.fused_projections else None
        return GatedMLP(
            weights,
            f"{prefix}.mlp",
            bias=config.mlp_bias,
            fused_size=fused_size,
            activation=config.activation,
        )
    block = "block_sparse_moe" if moe.naming == "mixtral" else "mlp"
    return SparseMoE.load(
        weights,
        f"{prefix}.{block}",
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        normalize_top_k=moe.normalize_top_k,
        naming=moe.naming,
        shared_expert=moe.shared_intermediate_size > 0,
    )


def add_rms_norm(norm: RMSNorm, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
    """`norm(x, residual)`, fused in one Triton program on the GPU (the CPU's C kernel and
    the reference run inside RMSNorm)."""
    fused = gpu_layers.add_rms_norm(x, residual, norm.weight, norm.eps)
    return fused if fused is not None else norm(x, residual)


def _stack_weights(layer: nn.Module) -> tuple[DecoderLayerWeights, list[nn.Module]] | None:
    """What `DecoderStack` needs of one decoder layer, and the layer's four projections
    (where adapters attach), or None where the stack would not compute what the layer's
    modules do: another forward (Gemma's), q/k norms, soft-capping, an MoE or non-SiLU MLP,
    tensor parallelism, linears neither int8 nor dense (`DecoderStack.build` then checks
    that they are packed for its kernels)."""
    if (
        not isinstance(layer, LlamaDecoderLayer)
        or type(layer).forward is not LlamaDecoderLayer.forward
    ):
        return None
    attention, mlp = layer.self_attn, layer.mlp
    if (
        type(attention).forward is not LlamaAttention.forward
        or attention.qk_norm is not None
        or attention.extras
        or not isinstance(mlp, GatedMLP)
        or type(mlp).forward is not GatedMLP.forward
        or mlp.act_and_mul is not silu_and_mul
    ):
        return None
    projections: list[TensorParallelColumnLinear | TensorParallelRowLinear] = [
        attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
    ]  # fmt: skip
    linears = [projection.linear for projection in projections]
    kernel = [linear for linear in linears if isinstance(linear, (Int8Linear, FastLinear))]
    if len(kernel) != len(linears) or any(
        world_size_of(projection.process_group) > 1
        for projection in projections
        if isinstance(projection, TensorParallelRowLinear)
    ):
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm).forward is not RMSNorm.forward for norm in norms):
        return None
    weights = DecoderLayerWeights(
        norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps, *kernel,
        scale=attention.scale, window=attention.sliding_window,
    )  # fmt: skip
    return weights, list(projections)


@register("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "phi3")
class LlamaForCausalLM(PagedCacheOwner, nn.Module):
    """A Llama-family causal LM for one tensor-parallel rank.

    Cache sizing: `num_layers`, `num_kv_heads` (this rank's) and `head_dim`.
    """

    decoder_layer: ClassVar[type[nn.Module]] = LlamaDecoderLayer

    def __init__(
        self,
        config: ModelConfig | Mapping[str, Any] | Any,
        weights: Weights,
        attention_backend: AttentionBackend[Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = config = ModelConfig.parse(config)
        self.attention_backend = attention_backend or get_attention_backend()
        self.embed_tokens = TensorParallelEmbedding.load(weights, "model.embed_tokens")
        layers = [
            self.decoder_layer(config, weights, f"model.layers.{i}", i)
            for i in range(config.num_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm.load(weights, "model.norm", config.rms_norm_eps, config.norm_offset)
        if config.tie_word_embeddings:
            self.lm_head = TensorParallelHead.load(weights, "model.embed_tokens", self.embed_tokens)
        else:
            self.lm_head = TensorParallelHead.load(weights, "lm_head")
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, weights.device)
        self.local_rotary: RotaryEmbedding | None = None
        if config.local_rope is not None:
            self.local_rotary = RotaryEmbedding(config.local_rope, config.head_dim, weights.device)
        self.dtype, self.device = weights.dtype, weights.device
        self.num_layers = config.num_layers
        self.num_kv_heads = layers[0].self_attn.num_kv_heads
        self.head_dim = config.head_dim
        self.vocab_size = config.vocab_size
        self.kv_cache_dtype = self.dtype
        """Element dtype of the caches `allocate_kv_cache` makes (int8 / fp8: quantized)."""
        self._decoder_stack: DecoderStack | bool | None = False
        """The layers as one C call (`DecoderStack`), built on the first step after each
        `allocate_kv_cache` (False until then: the modules may change before, as int8's
        calibration swaps its layers); None where they do not fit it."""
        self.use_decoder_stack = True
        """False: every step runs the modules (the A/B of `bench.micro.step --no-decoder-stack`)."""
        self._stack_projections: list[nn.Module] = []
        """The stack's linears: while an adapter is attached to one (`lora`), steps run
        the modules."""

    @property
    def implementation(self) -> str:
        """How this model runs, for /info: its native class."""
        return f"native {type(self).__name__}"

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        logits_indices: Tensor,
    ) -> Tensor:
        """One step: input_ids/positions [T] → float32 logits [N, vocab] for rows logits_indices [N].

        Writes the step's keys/values into `kv_cache` at `attn_metadata.slot_mapping`.
        """
        cos, sin = self._cos_sin(self.rotary, positions, attn_metadata)
        backend = self.attention_backend
        ctx = ForwardContext(
            cos, sin, kv_cache, attn_metadata, backend, backend.prepare(attn_metadata)
        )
        if self.local_rotary is not None:
            ctx.local_cos_sin = self._cos_sin(self.local_rotary, positions, attn_metadata)
        hidden = self.embed(input_ids)  # [T, hidden]
        residual = None
        stacked = self._run_decoder_stack(hidden, ctx)
        if stacked is not None:
            hidden, residual = stacked
        else:
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, ctx)
        assert residual is not None
        # The final norm is per row, so only the rows that need logits go through it.
        hidden, _ = add_rms_norm(
            self.norm,
            hidden.index_select(0, logits_indices),
            residual.index_select(0, logits_indices),
        )  # [N, hidden]
        return self.logits(hidden)

    @property
    def decoder_stack(self) -> DecoderStack | None:
        """The built `DecoderStack`, None before the first step or where it does not fit."""
        return self._decoder_stack if isinstance(self._decoder_stack, DecoderStack) else None

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        cache = super().allocate_kv_cache(num_blocks, block_size)
        self._decoder_stack = False
        return cache

    def _run_decoder_stack(
        self, hidden: Tensor, ctx: ForwardContext
    ) -> tuple[Tensor, Tensor] | None:
        """(hidden, residual) after every layer through `DecoderStack`, or None where
        this model or this step does not fit it: no stack, LoRA adapters attached, local
        rotary tables, prompt chunks the attention backend sends to SDPA, a quantized or
        partially rotated cache (then the modules run the step)."""
        if self._decoder_stack is False:
            stacked = [_stack_weights(layer) for layer in self.layers]
            fits = [each for each in stacked if each is not None]
            self._decoder_stack = None
            if len(fits) == len(stacked):
                self._decoder_stack = DecoderStack.build(
                    [weights for weights, _ in fits],
                    num_heads=self.config.num_heads,
                    num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim,
                )
                self._stack_projections = [p for _, projections in fits for p in projections]
        stack, plan = self._decoder_stack, ctx.plan
        if (
            not self.use_decoder_stack
            or not isinstance(stack, DecoderStack)
            or not isinstance(ctx.backend, CpuAttentionBackend)
            or not isinstance(plan, CpuPlan)
            or plan.kernel is None
            or plan.sdpa_groups
            or ctx.local_cos_sin is not None
            or any(projection.lora is not None for projection in self._stack_projections)
        ):
            return None
        return stack.run(
            hidden,
            None,
            ctx.cos,
            ctx.sin_signed,
            ctx.metadata.slot_mapping,
            ctx.kv_cache.key_caches,
            ctx.kv_cache.value_caches,
            plan.kernel,
        )

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] → the first layer's input [T, hidden]."""
        return self.embed_tokens(input_ids)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final-normed hidden [N, hidden] → float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def _cos_sin(
        self, rotary: RotaryEmbedding, positions: Tensor, metadata: AttentionMetadata
    ) -> tuple[Tensor, Tensor]:
        """(cos, signed sin) [T, rotary_dim] of one rotary embedding for this step."""
        seq_lens = None
        if rotary.needs_seq_lens:
            seq_lens = metadata.seq_lens[metadata.token_seq_index()]  # [T]
        cos, sin = rotary.cos_sin(positions, self.dtype, seq_lens)
        return cos, signed_sin(sin)
