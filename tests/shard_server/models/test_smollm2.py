"""The real default model (SmolLM2-135M) natively against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from textgate.kernels import AttentionMetadata
from textgate.shard_server.models import load_model


@pytest.mark.slow
def test_smollm2_logits_match_transformers(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    smol = default_model_dir
    reference = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32).eval()
    model = load_model(smol, torch.float32, "cpu")
    prompt = torch.randint(0, model.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    cache = model.allocate_kv_cache(num_blocks=8, block_size=16)
    with torch.inference_mode():
        expected = reference(prompt[None]).logits[0]
        # The prompt in two chunks, so the second reads the first from the cache.
        logits = []
        for start, stop in [(0, 17), (17, 24)]:
            metadata = AttentionMetadata.build(
                query_lens=[stop - start],
                context_lens=[start],
                block_tables=[[6, 2]],
                block_size=16,
            )
            rows = torch.arange(stop - start)
            logits.append(model(prompt[start:stop], metadata.positions(), cache, metadata, rows))
    # 30 float32 layers: the two sum in different orders, so the bound grows with the logit
    # (a Sapphire Rapids Xeon differed by 1.0e-4 on a logit of 15.8, 6e-6 of it).
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-4, rtol=2e-5)
    assert torch.equal(torch.cat(logits).argmax(-1), expected.argmax(-1))
