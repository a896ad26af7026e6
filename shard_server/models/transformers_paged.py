"""Any transformers decoder on the paged engine: the model's own modules, textgate's
attention and KV cache.

transformers 5 sends every attention call through its `AttentionInterface`. Loading a
model with `attn_implementation=IMPLEMENTATION` routes each layer's queries, keys and
values (after the model's own RoPE, norms and scaling) to `paged_attention`: the keys
and values go into textgate's paged cache at the step's slot mapping, and textgate's
attention backend attends over the cached blocks, with the layer's sliding window (and
its logit soft-capping or sink logits, which only the torch backend does). Everything else in the step (embeddings, norms, MLPs or experts, the head and its
soft-capping) is the model's own code, so a model with no native class still gets the
scheduler, prefix caching, chunked prefill, KV dtypes, grammars and logprobs.

A step's flat batch (every sequence's new tokens, concatenated) runs as one row of T
tokens, each at its own position: every layer but attention treats tokens one by one,
and attention separates the sequences by the step's metadata. So a model whose layers
mix tokens any other way (recurrent or convolutional layers, encoder-decoders) cannot
run here; `unsupported_reason` names why before anything loads. One shard only: the
model's modules are not split.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from textgate.kernels.attention import AttentionBackend, AttentionMetadata, SdpaAttentionBackend
from textgate.shard_server.layers.step_local import StepLocal
from textgate.shard_server.models.paged_cache import PagedCacheOwner
from textgate.shard_server.step.kv_cache import KVCache

IMPLEMENTATION = "textgate_paged"
"""The attention implementation name registered with transformers."""

log = logging.getLogger("textgate.shard")

_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


@dataclass(frozen=True)
class PagedStep:
    """What every attention call of one step reads: the cache and the step's plan."""

    kv_cache: KVCache
    metadata: AttentionMetadata
    backend: AttentionBackend[Any]
    plan: Any


@dataclass
class KVShapes:
    """A dry run's record: each attention layer's (kv heads, head size), by layer index,
    and what its attention needs beyond masking (`soft-capping`, `sinks`)."""

    seen: dict[int, tuple[int, int]]
    needs: set[str] = field(default_factory=set)

    def uniform(self) -> tuple[int, int, int]:
        """(layers, kv heads, head size), the same for every layer as one cache needs."""
        shapes = set(self.seen.values())
        if sorted(self.seen) != list(range(len(self.seen))) or len(shapes) != 1:
            raise ValueError(f"attention layers of different KV shapes: {self.seen}")
        ((heads, dim),) = shapes
        return len(self.seen), heads, dim


_STEP: StepLocal[PagedStep | KVShapes] = StepLocal("textgate_paged_step")


def paged_step(step: PagedStep | KVShapes) -> contextlib.AbstractContextManager[None]:
    """Run a forward pass whose attention calls read and write `step`."""
    return _STEP.bound(step)


def paged_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention signature: query [1, H_q, T, D], key/value [1, H_kv, T, D]
    → (output [1, T, H_q, D], no weights). Stores this step's keys and values, then
    attends over every cached token of each sequence."""
    del attention_mask, dropout
    step = _STEP.get()
    if step is None:
        raise RuntimeError(f"{IMPLEMENTATION} attention ran outside a textgate paged step")
    # Gemma 2 soft-caps its scores; gpt-oss passes its sink logits as s_aux.
    extras = {"softcap": kwargs.get("softcap"), "sinks": kwargs.get("s_aux")}
    extras = {name: value for name, value in extras.items() if value is not None}
    layer = module.layer_idx
    query, key, value = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if isinstance(step, KVShapes):
        step.seen[layer] = (key.shape[1], key.shape[2])
        step.needs |= extras.keys()
        return torch.zeros_like(query)[None], None
    step.kv_cache.store(layer, key, value, step.metadata.slot_mapping)
    key_cache, value_cache = step.kv_cache.layer(layer)
    key_scales, value_scales = step.kv_cache.layer_scales(layer)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    out = step.backend.forward(
        query.contiguous(),
        key_cache,
        value_cache,
        step.plan,
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        sliding_window=window or None,
        key_scales=key_scales,
        value_scales=value_scales,
        **extras,
    )  # [T, H_q, D]
    return out[None], None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask transformers would build: none, the step's metadata says it all."""
    del args, kwargs


def register() -> None:
    """Make IMPLEMENTATION a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)


def unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why the model in this config.json cannot run on the paged engine, or None."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if config.get("is_encoder_decoder"):
        return f"{model_type!r} is an encoder-decoder model"
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type or "")
    if architecture is None:
        return f"transformers has no causal LM for model type {model_type!r}"
    model_class = _causal_lm_class(model_type or "")
    if not getattr(model_class, "_supports_attention_backend", False):
        return f"{architecture} does not run its attention through transformers' AttentionInterface"
    hf_config = AutoConfig.for_model(**dict(config))
    layer_types = set(getattr(hf_config, "layer_types", None) or ())
    if getattr(hf_config, "attention_chunk_size", None) or "chunked_attention" in layer_types:
        return f"{architecture} uses chunked attention, which textgate's attention backends lack"
    if layer_types - _ATTENTION_LAYER_TYPES:
        other = ", ".join(sorted(layer_types - _ATTENTION_LAYER_TYPES))
        return f"{architecture} has layers that are not attention ({other})"
    return None


def _causal_lm_class(model_type: str) -> type[nn.Module]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls: type[nn.Module] = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return cls


class TransformersPagedModel(PagedCacheOwner, nn.Module):
    """A transformers causal LM served like a native model: same forward and cache
    interface (`shard_server.models.llama.LlamaForCausalLM`'s), one shard."""

    quantize: str | None = None

    def __init__(
        self,
        model: nn.Module,
        attention_backend: AttentionBackend[Any],
        why: str = "no native class",
    ) -> None:
        super().__init__()
        self.hf = model.eval()
        self.why = why
        """Why transformers' modules serve it: no native class, or --no-native."""
        self.config = config = model.config
        self.attention_backend = attention_backend
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # What the cache must hold, from the model itself: configs name their heads in
        # too many ways (n_head, num_key_value_heads, multi_query, ...).
        shapes = self._dry_run()
        self.num_layers, self.num_kv_heads, self.head_dim = shapes.uniform()
        if shapes.needs and not attention_backend.supports_softcap_and_sinks:
            # Only the reference backend soft-caps and sinks; it serves the whole model.
            log.info(
                "%s's attention needs %s: the torch attention backend serves it",
                type(model).__name__,
                " and ".join(sorted(shapes.needs)),
            )
            self.attention_backend = SdpaAttentionBackend()
        self.vocab_size = config.vocab_size
        self.kv_cache_dtype = self.dtype

    @property
    def implementation(self) -> str:
        """How this model runs, for /info."""
        return f"transformers {type(self.hf).__name__} on the paged engine ({self.why})"

    def _dry_run(self) -> KVShapes:
        """What the cache must hold and the attention must do, seen in a one-token run."""
        shapes = KVShapes({})
        token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with paged_step(shapes), torch.inference_mode():
            self.hf(input_ids=token, position_ids=token, use_cache=False, logits_to_keep=1)
        if not shapes.seen:
            raise ValueError(f"{type(self.hf).__name__} ran no attention through {IMPLEMENTATION}")
        return shapes

    @classmethod
    def load(
        cls,
        path: Path,
        dtype: torch.dtype,
        device: torch.device | str,
        attention_backend: AttentionBackend[Any],
        trust_remote_code: bool = False,
        why: str = "no native class",
    ) -> TransformersPagedModel:
        from transformers import AutoModelForCausalLM

        register()
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=IMPLEMENTATION,
            trust_remote_code=trust_remote_code,
        ).to(device)
        return cls(model, attention_backend, why)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        logits_indices: Tensor,
    ) -> Tensor:
        """One step: input_ids/positions [T] → float32 logits [N, vocab] for rows
        logits_indices [N]; writes the step's keys/values into `kv_cache`."""
        backend = self.attention_backend
        step = PagedStep(kv_cache, attn_metadata, backend, backend.prepare(attn_metadata))
        with paged_step(step):
            out = self.hf(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=logits_indices,
            )
        return out.logits[0].float()
