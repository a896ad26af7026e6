"""Load the draft model of draft-model speculation (`--speculative-model`) beside a target.

The draft is a native model (any family with a native class) on the target's device, in
its own quantization (`--speculative-quantize`: int8, gguf, ...): on a CPU in float32, or
in the dtype its quantization method's kernel needs; on a GPU in the target's dtype. Its
guesses are token ids the target verifies, so both must share one tokenizer: a draft
whose vocabulary differs from the target's is refused at startup, naming the difference.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from textgate.kernels import select_attention_backend
from textgate.kernels.kv_quant import resolve_kv_cache_dtype
from textgate.shard_server.step.draft_proposer import DraftProposer

log = logging.getLogger("textgate.shard")


def load_draft(
    path: Path,
    quantize: str | None,
    target: Any,
    tokenizer: Any,
    block_size: int,
    attention: str = "auto",
) -> DraftProposer:
    """The draft model in `path` for `target` (a loaded native or transformers model) and
    its `tokenizer`, wrapped as a proposer over blocks of `block_size`."""
    from textgate.shard_server.models import load_model as load_native
    from textgate.shard_server.models import supported_model_types
    from textgate.shard_server.models.loader import quantized_cpu_dtype, read_config

    config = read_config(path)
    if config.get("model_type") not in supported_model_types():
        raise ValueError(
            f"--speculative-model {path}: model type {config.get('model_type')!r} has no "
            "native class (a draft model needs one)"
        )
    check_vocabulary(path, tokenizer)
    device = torch.device(target.device)
    dtype = target.dtype
    if device.type == "cpu":
        dtype = quantized_cpu_dtype(path, quantize) or torch.float32
    backend = select_attention_backend(attention, device, dtype, block_size, False)
    model = load_native(path, dtype, device, None, quantize=quantize, attention_backend=backend)
    model.set_kv_cache_dtype(resolve_kv_cache_dtype("auto", model.dtype))
    if model.config.vocab_size > target.config.vocab_size:
        raise ValueError(
            f"--speculative-model {path}: its vocabulary ({model.config.vocab_size} ids) is "
            f"larger than the served model's ({target.config.vocab_size})"
        )
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(
            f"--speculative-model {path}: its vocabulary ({model.config.vocab_size} ids) "
            f"cannot embed every token of the served model's tokenizer ({len(tokenizer)})"
        )
    log.info(
        "Draft model for speculation: %s, %s, %s",
        path,
        getattr(model, "quantize", None) or "unquantized",
        dtype,
    )
    positions = min(target.config.max_position_embeddings, model.config.max_position_embeddings)
    return DraftProposer(model, block_size, positions)


def check_vocabulary(path: Path, tokenizer: Any) -> None:
    """Refuse a draft whose tokenizer (where its folder has one) maps any token otherwise."""
    from transformers import AutoTokenizer

    try:
        own = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return  # a folder without a tokenizer: its vocabulary size is checked after loading
    theirs, ours = own.get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
        raise ValueError(
            f"--speculative-model {path}: its tokenizer differs from the served model's "
            f"(e.g. {differ}): draft tokens would mean other text"
        )
