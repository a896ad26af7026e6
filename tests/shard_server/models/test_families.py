"""Qwen3, Phi-3, Gemma 2 and 3 and the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) on the
native model, against transformers: prefill logits, paged decode, greedy generation of a
batch."""

from __future__ import annotations

import pytest
import torch

from textgate.shard_server.layers import moe
from textgate.shard_server.layers.moe import LinearExperts, SparseMoE, StackedExperts
from textgate.shard_server.models import load_model
from textgate.tests.shard_server.models.conftest import (
    assert_decode_follows_transformers_cache,
    assert_generate_agrees,
    greedy_continue,
    longrope,
)

ATOL = 1e-4

FAMILIES = [
    ("qwen3", {}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    ("mixtral", {}),
    ("mixtral", {"sliding_window": 6, "num_experts_per_tok": 1}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"norm_topk_prob": True, "mlp_only_layers": [0]}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2, "num_key_value_heads": 1}),
    ("phi3", {}),
    ("phi3", {"sliding_window": 5, "num_key_value_heads": 1}),
    # A 13-token prompt past an original context of 8: the long factors run.
    ("phi3", longrope(8)),
    # Phi-4-mini's shape: tied embeddings, only the leading half of each head rotates.
    ("phi3", {"tie_word_embeddings": True, **longrope(8, rotary_dim=6)}),
    ("gemma2", {}),
    ("gemma2", {"tie_word_embeddings": True, "final_logit_softcapping": None}),
    ("gemma3_text", {}),
    ("gemma3_text", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
]
IDS = [f"{kind}-{i}" for i, (kind, _) in enumerate(FAMILIES)]


def _prompt(length: int, seed: int = 1, vocab: int = 101) -> list[int]:
    return torch.randint(
        0, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.mark.parametrize(("kind", "overrides"), FAMILIES, ids=IDS)
def test_prefill_logits_match_transformers(tiny, runner, reference, kind, overrides, kernels):
    path, hf = tiny(kind, **overrides)
    prompt = _prompt(13)
    logits = runner(path).step({0: prompt}, all_logits=True)[0]
    torch.testing.assert_close(logits, reference(hf, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("kind", "overrides"), FAMILIES, ids=IDS)
def test_paged_decode_matches_transformers_cache(tiny, runner, kind, overrides):
    path, hf = tiny(kind, **overrides)
    assert_decode_follows_transformers_cache(hf, runner(path, 16), _prompt(9))


@pytest.mark.parametrize(
    "kind", ["qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "phi3", "gemma2", "gemma3_text"]
)
def test_greedy_batch_of_eight_equals_transformers_generate(tiny, runner, kind):
    path, hf = tiny(kind)
    prompts = {seq: _prompt(3 + 2 * seq, seed=seq) for seq in range(8)}
    paged = runner(path)
    assert_generate_agrees(hf, prompts, greedy_continue(paged, paged.step(prompts), 8))


@pytest.mark.parametrize("prompt_length", [20, 40])
def test_longrope_switches_factors_where_transformers_modules_do(tiny, runner, prompt_length):
    """Within the original context of 32 the short factors run, past it the long ones: a
    20-token prompt crosses it while decoding, its cached keys kept as they were (as
    transformers' model with its own cache does; its `generate` instead drops the cache
    at the crossing and prefills again); a 40-token one prefills on the long factors."""
    path, hf = tiny("phi3", **longrope(32))
    assert_decode_follows_transformers_cache(hf, runner(path, 16), _prompt(prompt_length), steps=16)


def test_longrope_batch_mixes_short_and_long_sequences_as_generate_does(tiny, runner):
    """One step holds sequences on either side of the original context (12): each runs
    its own factors. None crosses it while decoding, where `generate` would re-prefill."""
    path, hf = tiny("phi3", **longrope(12))
    prompts = {seq: _prompt(length, seed=seq) for seq, length in enumerate([2, 4, 14, 20])}
    paged = runner(path)
    assert_generate_agrees(hf, prompts, greedy_continue(paged, paged.step(prompts), 6))


def test_phi3_checkpoints_keep_their_fused_projections(tiny):
    path, hf = tiny("phi3")
    names = {name for name, _ in hf.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    model = load_model(path, torch.float32, "cpu")
    layer, reference = model.layers[0], hf.model.layers[0]
    # One rank: the fused tensors are read whole, in the checkpoint's order.
    torch.testing.assert_close(
        layer.self_attn.qkv_proj.linear.weight, reference.self_attn.qkv_proj.weight
    )
    torch.testing.assert_close(
        layer.mlp.gate_up_proj.linear.weight, reference.mlp.gate_up_proj.weight
    )


@pytest.mark.parametrize("kind", ["phi3", "gemma2", "gemma3_text"])
def test_quantized_at_load_stays_close(tiny, runner, reference, kind):
    """Phi-3's fused tensors are split before quantizing; Gemma's layers are Llama's."""
    pytest.importorskip("bitsandbytes")
    path, hf = tiny(kind)
    paged = runner(path)
    paged.model = load_model(path, torch.float32, "cpu", quantize="bitsandbytes")
    paged.cache = paged.model.allocate_kv_cache(64, 4)
    prompt = _prompt(11)
    expected = reference(hf, prompt)
    error = (paged.step({0: prompt}, all_logits=True)[0] - expected).norm() / expected.norm()
    assert error < 0.06, error  # a dense tiny Llama under bitsandbytes int8: ~0.03


def test_gemma2_soft_caps_on_the_torch_backend_whatever_was_asked(tiny):
    path, _ = tiny("gemma2")
    model = load_model(path, torch.float32, "cpu", attention_backend="cpu")
    assert type(model.attention_backend).__name__ == "SdpaAttentionBackend"
    path, _ = tiny("gemma3_text")  # no soft-cap: the backend asked for
    model = load_model(path, torch.float32, "cpu", attention_backend="cpu")
    assert type(model.attention_backend).__name__ != "SdpaAttentionBackend"


def _moe_blocks(model: torch.nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_grouped_matmul_and_per_expert_loop_agree(tiny, runner, monkeypatch, kind):
    path, _ = tiny(kind)
    prompt = _prompt(17)
    grouped = runner(path).step({0: prompt}, all_logits=True)[0]
    monkeypatch.setattr(moe, "_GROUPED_MM", {})
    monkeypatch.setattr(moe, "_probe_grouped_mm", lambda dtype, device: False)
    paged = runner(path)
    assert all(not block.experts.grouped for block in _moe_blocks(paged.model))
    torch.testing.assert_close(
        paged.step({0: prompt}, all_logits=True)[0], grouped, atol=1e-5, rtol=0
    )


def test_this_torch_runs_the_grouped_matmul_on_the_cpu():
    """The fast path is the one CI exercises: a torch without it must be noticed here."""
    assert moe.grouped_mm_runs(torch.float32, torch.device("cpu"))
    assert moe.grouped_mm_runs(torch.bfloat16, torch.device("cpu"))


def test_sparse_layers_follow_mlp_only_layers_and_the_sparse_step(tiny):
    path, _ = tiny("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    model = load_model(path, torch.float32, "cpu")
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["GatedMLP", "SparseMoE", "GatedMLP", "GatedMLP"]
    (block,) = _moe_blocks(model)
    assert isinstance(block.experts, StackedExperts)
    assert block.experts.gate_up.shape == (4, 48, 48) and block.experts.down.shape == (4, 48, 24)


def test_quantized_experts_keep_their_loaders_layers(tiny, runner, reference):
    pytest.importorskip("bitsandbytes")
    path, hf = tiny("mixtral")
    model = load_model(path, torch.float32, "cpu", quantize="bitsandbytes")
    blocks = _moe_blocks(model)
    assert blocks and all(isinstance(block.experts, LinearExperts) for block in blocks)
    paged = runner(path)
    paged.model = model
    paged.cache = model.allocate_kv_cache(64, 4)
    prompt = _prompt(11)
    logits = paged.step({0: prompt}, all_logits=True)[0]
    expected = reference(hf, prompt)
    # A dense tiny Llama under bitsandbytes int8 lands at ~0.03 here, as this MoE does.
    error = (logits - expected).norm() / expected.norm()
    assert error < 0.06, error


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_bfloat16_runs_close_to_float32(tiny, runner, reference, kind):
    path, hf = tiny(kind)
    prompt = _prompt(10)
    logits = runner(path, dtype=torch.bfloat16).step({0: prompt}, all_logits=True)[0]
    expected = reference(hf, prompt)
    # bf16 rounding may flip a near-tied expert choice, so no elementwise bound holds for
    # every logit; the whole stays close (0.015-0.036 here; a dense tiny Llama: 0.015).
    error = (logits - expected).norm() / expected.norm()
    assert error < 0.05, error
