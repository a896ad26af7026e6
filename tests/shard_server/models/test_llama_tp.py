"""Tensor parallel over gloo: two ranks give the same logits as one, dense and MoE."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from textgate.shard_server.models import load_model
from textgate.tests.shard_server.models.conftest import longrope
from textgate.tests.tp_ranks import WORLD_SIZE, rank_outputs, spawn_ranks, step_logits

# Heads, kv heads, intermediate and vocab sizes that split evenly, unevenly (SmolLM2's
# 9 heads / 3 kv heads do not divide by 2), and fewer kv heads than ranks (replicated).
CASES = {
    "even": ("llama", {}),
    "uneven": (
        "llama",
        {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 37},
    ),
    "mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {"vocab_size": 100}),
    "qwen3-qk-norm": ("qwen3", {}),
    # Mixture of experts: every expert's intermediate features split over the ranks
    # (unevenly for Mixtral's 37), the shared expert too, one all-reduce per layer.
    "mixtral": ("mixtral", {"intermediate_size": 37}),
    "qwen2-moe-shared": ("qwen2_moe", {"mlp_only_layers": [1]}),
    "qwen3-moe": ("qwen3_moe", {"norm_topk_prob": True}),
    # Phi-3's fused qkv_proj and gate_up_proj, each part split on its own: unevenly, and
    # with the kv heads replicated; LongRoPE's long factors on the sequence past 8.
    "phi3-uneven": (
        "phi3",
        {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 37},
    ),
    "phi3-mqa-longrope": ("phi3", {"num_key_value_heads": 1, **longrope(8)}),
    # Gemma: soft-capping on the torch backend of each rank, (1 + w) norms replicated,
    # Gemma 3's q/k norms and local RoPE on replicated kv heads.
    "gemma2": ("gemma2", {"intermediate_size": 37}),
    "gemma3-mqa": ("gemma3_text", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
}


def run_steps(path: Path, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """All-row logits of each step of `tp_ranks.steps` for the model in `path`."""
    return step_logits(load_model(path, torch.float32, "cpu", group))


def test_tensor_parallel_matches_single_rank(tiny, tmp_path):
    paths = []
    for name, (kind, overrides) in CASES.items():
        path, _ = tiny(kind, **overrides)
        paths.append(path.rename(path.with_name(name)))
    spawn_ranks(run_steps, paths, tmp_path)
    for path in paths:
        expected = run_steps(path, None)
        for rank in range(WORLD_SIZE):
            got = rank_outputs(tmp_path, path, rank)
            for step, (logits, reference) in enumerate(zip(got, expected, strict=True)):
                torch.testing.assert_close(
                    logits, reference, atol=1e-4, rtol=0, msg=f"{path.name} rank {rank} step {step}"
                )
