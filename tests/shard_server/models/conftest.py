"""Tiny random Llama-family checkpoints (dense and MoE) and a paged runner that drives a
native model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from textgate.kernels import AttentionMetadata
from textgate.shard_server.models import load_model

_CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
    "qwen3": Qwen3Config,
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "phi3": Phi3Config,
    "gemma2": Gemma2Config,
    "gemma3_text": Gemma3TextConfig,
}

TINY = {
    "vocab_size": 101,
    "hidden_size": 48,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}

# What each family adds to TINY: Qwen3's own head_dim (its default is 128), four experts
# of which each token runs two, Qwen2-MoE's shared expert, a Phi-3 pad id inside the
# tiny vocabulary (its default, 32000, is not), Gemma's soft-caps small enough that tanh
# bends the scores and logits, a query_pre_attn_scalar that is not head_dim, and one
# sliding layer then one full one.
FAMILY = {
    "qwen3": {"head_dim": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "head_dim": 16,
    },
    "phi3": {"pad_token_id": 0},
    "gemma2": {
        "head_dim": 16,
        "sliding_window": 4,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
        "query_pre_attn_scalar": 24,
    },
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": 4,
        "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
# transformers' sdpa attention cannot soft-cap: Gemma 2 is referenced by its eager one.
_EAGER = frozenset({"gemma2"})


def longrope(original: int, head_dim: int = 12, rotary_dim: int = 12) -> dict[str, Any]:
    """Phi-3 overrides for LongRoPE over a pretrained context of `original` positions:
    distinct short and long factors (rotary_dim / 2 each), so which one runs shows; the
    leading `rotary_dim` of each head's `head_dim` dimensions rotate."""
    half = rotary_dim // 2
    return {
        "original_max_position_embeddings": original,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 3.0 * i for i in range(half)],
            "partial_rotary_factor": rotary_dim / head_dim,
        },
    }


def build_tiny(directory: Path, kind: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Save a seeded random `kind` model to `directory` and return transformers' copy (fp32)."""
    torch.manual_seed(seed)
    config = _CONFIGS[kind](**{**TINY, **FAMILY.get(kind, {}), **overrides})
    # Random init is tiny (std 0.02); larger weights make attention and RoPE matter.
    config.initializer_range = 0.2
    attention = "eager" if kind in _EAGER else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    model.save_pretrained(directory)
    return model


@pytest.fixture
def tiny(tmp_path: Path) -> Callable[..., tuple[Path, PreTrainedModel]]:
    """tiny(kind, **config overrides) → (checkpoint folder, transformers model)."""
    count = 0

    def make(kind: str = "llama", **overrides: Any) -> tuple[Path, PreTrainedModel]:
        nonlocal count
        count += 1
        directory = tmp_path / f"{kind}-{count}"
        return directory, build_tiny(directory, kind, **overrides)

    return make


class PagedRunner:
    """Drives a native model as a shard does: sequences own scattered blocks of one cache."""

    def __init__(self, model: Any, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        self.model = model
        self.cache = model.allocate_kv_cache(num_blocks, block_size)
        self.block_size = block_size
        generator = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=generator).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(
        self, chunks: dict[int, list[int]], all_logits: bool = False
    ) -> dict[int, torch.Tensor]:
        """Feed each sequence its new tokens; logits of its last token ([V]) or all ([q, V])."""
        for seq, tokens in chunks.items():
            length = self.lengths.get(seq, 0) + len(tokens)
            blocks = self.blocks.setdefault(seq, [])
            while len(blocks) * self.block_size < length:
                blocks.append(self.free.pop())
        metadata = AttentionMetadata.build(
            query_lens=[len(tokens) for tokens in chunks.values()],
            context_lens=[self.lengths.get(seq, 0) for seq in chunks],
            block_tables=[self.blocks[seq] for seq in chunks],
            block_size=self.block_size,
        )
        input_ids = torch.tensor([t for tokens in chunks.values() for t in tokens])
        starts = metadata.query_start_loc.tolist()
        rows = torch.arange(len(input_ids)) if all_logits else metadata.query_start_loc[1:] - 1
        with torch.inference_mode():
            logits = self.model(input_ids, metadata.positions(), self.cache, metadata, rows)
        out = {}
        for b, seq in enumerate(chunks):
            self.lengths[seq] = self.lengths.get(seq, 0) + len(chunks[seq])
            out[seq] = logits[starts[b] : starts[b + 1]] if all_logits else logits[b]
        return out


@pytest.fixture
def runner() -> Callable[..., PagedRunner]:
    """runner(model_dir, block_size=4, dtype=fp32) → a PagedRunner over a freshly loaded model."""

    def make(path: Path, block_size: int = 4, dtype: torch.dtype = torch.float32) -> PagedRunner:
        return PagedRunner(load_model(path, dtype, "cpu"), block_size=block_size)

    return make


def greedy_continue(
    paged: PagedRunner, logits: dict[int, torch.Tensor], steps: int
) -> dict[int, list[int]]:
    """Greedy tokens of every sequence, from the logits of its last step on: `steps` each."""
    tokens: dict[int, list[int]] = {seq: [] for seq in logits}
    for step in range(steps):
        for seq, row in logits.items():
            tokens[seq].append(int(row.argmax()))
        if step < steps - 1:
            logits = paged.step({seq: tokens[seq][-1:] for seq in tokens})
    return tokens


def assert_generate_agrees(
    hf: PreTrainedModel, prompts: dict[int, list[int]], tokens: dict[int, list[int]]
) -> None:
    """transformers' greedy `generate` of each prompt gives its `tokens` (no eos stop)."""
    for seq, prompt in prompts.items():
        steps = len(tokens[seq])
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=0,
            )
        assert out[0, len(prompt) :].tolist() == tokens[seq], f"prompt {seq}"


def assert_decode_follows_transformers_cache(
    hf: PreTrainedModel, paged: PagedRunner, prompt: list[int], steps: int = 6, atol: float = 1e-4
) -> None:
    """Prefill then `steps` greedy decode steps: each step's last logits equal transformers'
    with its own DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt]), cache=cache).logits[0, -1]
    logits = paged.step({0: prompt})[0]
    for _ in range(steps):
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
        token = int(expected.argmax())
        with torch.inference_mode():
            expected = hf(torch.tensor([[token]]), cache=cache).logits[0, -1]
        logits = paged.step({0: [token]})[0]
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0)


def reference_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [L, V] for one sequence, no cache."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture
def reference() -> Callable[[PreTrainedModel, list[int]], torch.Tensor]:
    return reference_logits


@pytest.fixture(params=["cpu-kernels", "pytorch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test twice: on the C kernels, then on the PyTorch references (which is what
    runs off the CPU or without a compiler)."""
    from textgate.kernels import cpu_build

    if request.param == "pytorch":
        monkeypatch.setattr(cpu_build, "load_library", lambda: None)
    return str(request.param)
