"""A Llama-family decoder layer (transformers' modules, dense or MoE) as the quantizers see it.

The quantizers run the model one decoder layer at a time over the calibration batch: the
layer's inputs are kept as hidden states [samples, seq_len, hidden], its linear layers'
inputs are observed through forward hooks, and its output becomes the next layer's input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

# Linears that read the same input, by their name under the decoder layer: GPTQ quantizes
# each group together on that input's Hessian.
ATTENTION_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
)
MLP_GROUPS = (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
#: Qwen2-MoE's shared expert, which every token runs (its sigmoid gate stays float).
SHARED_EXPERT_GROUPS = (
    ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    ("mlp.shared_expert.down_proj",),
)

#: The linear layers of a dense decoder layer, by their name under the layer.
LINEAR_NAMES = tuple(name for group in (*ATTENTION_GROUPS, *MLP_GROUPS) for name in group)


def input_groups(layer: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The layer's `nn.Linear`s in input-sharing groups: attention, then the dense MLP or,
    in a mixture-of-experts block, the shared expert if any (the experts are fused
    tensors, see `experts.py`; the router is not quantized)."""
    mlp = layer.get_submodule("mlp")
    if not hasattr(mlp, "experts"):
        return (*ATTENTION_GROUPS, *MLP_GROUPS)
    return (*ATTENTION_GROUPS, *(SHARED_EXPERT_GROUPS if hasattr(mlp, "shared_expert") else ()))


def linear(layer: nn.Module, name: str) -> nn.Linear:
    """The linear layer `name` (one of LINEAR_NAMES) of a decoder layer."""
    module = layer.get_submodule(name)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{name} is a {type(module).__name__}, not a Linear layer")
    return module


@dataclass
class CalibrationBatch:
    """Hidden states entering the current layer, and what every layer call needs with them."""

    hidden: Tensor  # [samples, seq_len, hidden]
    layer_kwargs: dict[str, Any]  # position embeddings and mask for one chunk of samples
    chunk_size: int  # samples per forward call, to bound activation memory

    def run(self, layer: nn.Module) -> Tensor:
        """The layer's outputs [samples, seq_len, hidden] for the batch's hidden states."""
        outputs = [
            _layer_output(layer(chunk, **self._kwargs_for(chunk)))
            for chunk in self.hidden.split(self.chunk_size)
        ]
        return torch.cat(outputs)

    def _kwargs_for(self, chunk: Tensor) -> dict[str, Any]:
        mask = self.layer_kwargs.get("attention_mask")
        if isinstance(mask, Tensor) and mask.shape[0] not in (1, chunk.shape[0]):
            return {**self.layer_kwargs, "attention_mask": mask[: chunk.shape[0]]}
        return self.layer_kwargs


def _layer_output(output: Any) -> Tensor:
    # transformers 5 returns the hidden states; older versions a tuple starting with them.
    return output if isinstance(output, Tensor) else output[0]


def embed_calibration(model: nn.Module, tokens: Tensor, chunk_size: int) -> CalibrationBatch:
    """The calibration tokens [samples, seq_len] embedded, with rotary tables and mask."""
    from transformers.masking_utils import create_causal_mask

    inner = model.model
    hidden = inner.embed_tokens(tokens)  # [samples, seq_len, hidden]
    chunk = hidden[:chunk_size]
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0)  # [1, seq_len]
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=chunk,
        attention_mask=None,
        cache=None,
        position_ids=position_ids,
    )
    kwargs = {
        "attention_mask": mask,
        "position_ids": position_ids,
        "position_embeddings": inner.rotary_emb(chunk, position_ids),
    }
    return CalibrationBatch(hidden, kwargs, chunk_size)


@contextmanager
def observe_inputs(
    layer: nn.Module, names: list[str], observer: Callable[[str, Tensor], None]
) -> Iterator[None]:
    """Call observer(name, inputs [..., in_features]) on every forward of those linears."""

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            observer(name, args[0].detach())

        return hook

    handles = [linear(layer, name).register_forward_hook(hook_for(name)) for name in names]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
