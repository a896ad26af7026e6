"""One sequence prefilled in one step through a paged model: its logits, for tests that
compare two models (quantized against float, one device against another)."""

from __future__ import annotations

import torch
from torch import nn

from textgate.kernels import AttentionMetadata

BLOCK_SIZE = 16


def prefill_logits(model: nn.Module, tokens: list[int], device: str = "cpu") -> torch.Tensor:
    """Logits [T, vocab] (float32, on the CPU) of `tokens` prefilled in one step on `device`."""
    blocks = -(-len(tokens) // BLOCK_SIZE)
    cache = model.allocate_kv_cache(blocks, BLOCK_SIZE)
    metadata = AttentionMetadata.build(
        query_lens=[len(tokens)],
        context_lens=[0],
        block_tables=[list(range(blocks))],
        block_size=BLOCK_SIZE,
        device=device,
    )
    rows = torch.arange(len(tokens), device=device)
    with torch.inference_mode():
        ids = torch.tensor(tokens, device=device)
        return model(ids, metadata.positions(), cache, metadata, rows).float().cpu()
