"""Models with no native class on the paged engine: transformers' modules, textgate's
attention and cache, against transformers itself (olmo2 and granite stay unregistered;
gemma3_text for alternating sliding-window layers, gemma2 for logit soft-capping, gpt_oss
for sink logits, gpt2 for a config that names its heads its own way)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from textgate.kernels import get_attention_backend
from textgate.shard_server.loading.shard_loader import load_model as load_shard_model
from textgate.shard_server.models import supported_model_types
from textgate.shard_server.models.transformers_paged import (
    TransformersPagedModel,
    unsupported_reason,
)
from textgate.shard_server.protocols.paged_model import PagedModel
from textgate.tests.conftest import build_tiny_model
from textgate.tests.shard_server.models.conftest import (
    TINY,
    PagedRunner,
    assert_generate_agrees,
    greedy_continue,
)

ATOL = 1e-4

FAMILIES: dict[str, dict[str, Any]] = {
    "olmo2": {},
    "granite": {
        "embedding_multiplier": 2.0,
        "attention_multiplier": 0.3,
        "residual_multiplier": 0.7,
        "logits_scaling": 1.5,
    },
    "gemma3_text": {"head_dim": 16, "sliding_window": 4},
    # Soft-capping small enough that tanh bends the scores; the final soft-cap is its own code.
    "gemma2": {"head_dim": 16, "sliding_window": 4, "attn_logit_softcapping": 2.0},
    "gpt_oss": {  # sink logits, alternating sliding layers, its own experts
        "head_dim": 16,
        "sliding_window": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "gpt2": {"n_embd": 48, "n_head": 4, "n_layer": 2},
}


def build(directory: Path, kind: str, **overrides: Any) -> PreTrainedModel:
    """A seeded random `kind` model saved to `directory`; transformers' copy (fp32, eager)."""
    torch.manual_seed(0)
    # No eos: generate() then runs every greedy step as the paged loop does.
    config = {**TINY, "eos_token_id": None, **FAMILIES.get(kind, {}), **overrides}
    config = AutoConfig.for_model(kind, **config)
    config.initializer_range = 0.2
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(directory)
    return model


def paged_runner(path: Path, backend: str = "cpu") -> PagedRunner:
    model = TransformersPagedModel.load(path, torch.float32, "cpu", get_attention_backend(backend))
    return PagedRunner(model, block_size=4)


def _prompt(length: int, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 101, (length,), generator=generator).tolist()


# Native now, and kept here: the transformers path's alternating windows and soft-capping.
_NATIVE_TOO = {"gemma2", "gemma3_text"}


def test_these_families_have_no_native_class() -> None:
    assert set(FAMILIES) & set(supported_model_types()) == _NATIVE_TOO


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_chunked_prefill_and_decode_match_transformers(tmp_path, kind) -> None:
    hf = build(tmp_path, kind)
    paged = paged_runner(tmp_path)
    prompt = _prompt(13)
    first = paged.step({0: prompt[:6]}, all_logits=True)[0]
    rest = paged.step({0: prompt[6:]}, all_logits=True)[0]  # a chunk over a cached prefix
    tokens = list(prompt)
    logits = [first, rest]
    for _ in range(4):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(paged.step({0: tokens[-1:]}, all_logits=True)[0])
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.cat(logits), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["olmo2", "granite", "gemma2", "gpt_oss"])
def test_a_concurrent_batch_with_shared_prefixes_equals_transformers_generate(
    tmp_path, kind
) -> None:
    hf = build(tmp_path, kind)
    paged = paged_runner(tmp_path)
    shared = _prompt(9, seed=99)
    prompts = {seq: shared[: 3 + seq] + _prompt(1 + 2 * seq, seed=seq) for seq in range(6)}
    # Sequences of different lengths; two join one step late, one prefills in two chunks.
    logits = paged.step({0: prompts[0], 1: prompts[1], 2: prompts[2][:4]})
    del logits[2]
    logits |= paged.step({2: prompts[2][4:], 3: prompts[3], 4: prompts[4], 5: prompts[5]})
    assert_generate_agrees(hf, prompts, greedy_continue(paged, dict(sorted(logits.items())), 6))


def test_the_cache_shape_comes_from_the_model_not_its_config_names(tmp_path) -> None:
    build(tmp_path, "gpt2")  # n_head 4, and TINY's num_key_value_heads 2, which gpt2 ignores
    model = paged_runner(tmp_path).model
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 4, 12)


@pytest.mark.parametrize(
    ("kind", "overrides", "why"),
    [
        ("llama4_text", {"attention_chunk_size": 8}, "uses chunked attention"),
        ("mamba", {}, "does not run its attention through transformers' AttentionInterface"),
        ("t5", {}, "is an encoder-decoder model"),
        ("vit", {}, "transformers has no causal LM for model type 'vit'"),
    ],
)
def test_what_cannot_run_paged_says_why(kind, overrides, why) -> None:
    config = AutoConfig.for_model(kind, **overrides).to_dict()
    reason = unsupported_reason(config)
    assert reason is not None and why in reason


def test_a_native_model_says_it_is_native(tiny_model_dir) -> None:
    info = load_shard_model(tiny_model_dir, "tiny", "float32").describe()
    assert info.model_implementation == "native LlamaForCausalLM"


def test_the_shard_serves_it_paged_and_says_so(tmp_path, caplog) -> None:
    path = build_tiny_model(tmp_path / "olmo2", "olmo2")
    with caplog.at_level(logging.INFO, logger="textgate.shard"):
        model = load_shard_model(path, "tiny-olmo2", "float32")
    assert isinstance(model, PagedModel) and isinstance(model.model, TransformersPagedModel)
    assert "'olmo2': transformers' modules on the paged engine (no native class)" in caplog.text
    info = model.describe()
    assert info.model_type == "olmo2"
    assert info.model_implementation == (
        "transformers Olmo2ForCausalLM on the paged engine (no native class)"
    )
    with pytest.raises(ValueError, match="--num-shard > 1"):
        load_shard_model(path, "tiny-olmo2", "float32", world_size=2)
    with pytest.raises(ValueError, match="--quantize needs a native implementation"):
        load_shard_model(path, "tiny-olmo2", "float32", quantize="int8")


def test_what_cannot_run_paged_is_refused_at_startup_naming_why(tmp_path) -> None:
    torch.manual_seed(0)
    config = AutoConfig.for_model("mamba", vocab_size=101, hidden_size=32, num_hidden_layers=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as error:
        load_shard_model(tmp_path, "tiny-mamba", "float32")
    assert str(error.value) == (
        "model type 'mamba' cannot be served: MambaForCausalLM does not run its attention "
        "through transformers' AttentionInterface"
    )


def test_no_native_serves_a_native_family_through_transformers(tiny_model_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="textgate.shard"):
        model = load_shard_model(tiny_model_dir, "tiny", "float32", native=False)
    assert isinstance(model.model, TransformersPagedModel)
    assert "'llama': transformers' modules on the paged engine (--no-native)" in caplog.text
    assert model.describe().model_implementation == (
        "transformers LlamaForCausalLM on the paged engine (--no-native)"
    )


def test_soft_capping_runs_on_the_torch_backend_whatever_was_asked(tmp_path, caplog) -> None:
    build(tmp_path, "gemma2")
    with caplog.at_level(logging.INFO, logger="textgate.shard"):
        model = paged_runner(tmp_path, backend="cpu").model
    assert type(model.attention_backend).__name__ == "SdpaAttentionBackend"
    assert "Gemma2ForCausalLM's attention needs softcap: the torch attention backend" in (
        caplog.text
    )
