"""The native Llama-family model against transformers, over the paged cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from textgate.kernels import AttentionMetadata
from textgate.quantization import Weights
from textgate.shard_server.models import LlamaForCausalLM, load_model
from textgate.tests.shard_server.models.conftest import assert_decode_follows_transformers_cache

ATOL = 1e-4


def _prompt(length: int, seed: int = 1, vocab: int = 101) -> list[int]:
    return torch.randint(
        0, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"num_key_value_heads": 4}),
        ("llama", {"num_key_value_heads": 1}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("llama", {"head_dim": 16}),
        ("qwen2", {}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
        ("mistral", {"sliding_window": 5}),
        ("mistral", {"sliding_window": None}),
    ],
)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_logits_match_transformers(
    tiny, runner, reference, kind, overrides, block_size, kernels
):
    path, hf = tiny(kind, **overrides)
    prompt = _prompt(13)
    logits = runner(path, block_size).step({0: prompt}, all_logits=True)[0]
    torch.testing.assert_close(logits, reference(hf, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_matches_transformers_cache(tiny, runner, kind, block_size, kernels):
    path, hf = tiny(kind, sliding_window=6) if kind == "mistral" else tiny(kind)
    assert_decode_follows_transformers_cache(hf, runner(path, block_size), _prompt(9), atol=ATOL)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_matches_each_sequence_alone(tiny, runner, reference, block_size):
    path, hf = tiny("llama")
    paged = runner(path, block_size)
    tokens = {seq: _prompt(length, seed=seq) for seq, length in enumerate([7, 12, 10, 15, 5])}
    # Cache prefixes first: seq 1 (5 of 12), seq 2 (9 of 10), seq 3 (14 of 15), seq 4 (4 of 5).
    paged.step({1: tokens[1][:5], 2: tokens[2][:9]})
    paged.step({3: tokens[3][:14], 4: tokens[4][:4]})
    # One step: a fresh prefill, a prefill over a cached prefix, and three decodes.
    step = {
        0: tokens[0],
        2: tokens[2][9:],
        1: tokens[1][5:],
        3: tokens[3][14:],
        4: tokens[4][4:],
    }
    logits = paged.step(step, all_logits=True)
    for seq, new in step.items():
        expected = reference(hf, tokens[seq])[-len(new) :]
        torch.testing.assert_close(logits[seq], expected, atol=ATOL, rtol=0, msg=f"seq {seq}")


def test_chunked_prefill_matches_one_shot(tiny, runner, reference):
    path, hf = tiny("qwen2")
    paged = runner(path)
    prompt = _prompt(20)
    chunks = [prompt[:6], prompt[6:7], prompt[7:15], prompt[15:]]
    logits = torch.cat([paged.step({0: chunk}, all_logits=True)[0] for chunk in chunks])
    torch.testing.assert_close(logits, reference(hf, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rope_scaling_matches_transformers(tiny, runner, reference, rope):
    # A short trained context so the sequence runs past it (dynamic NTK rescales there).
    path, hf = tiny(
        "llama", max_position_embeddings=16, rope_parameters={**rope, "rope_theta": 500.0}
    )
    prompt = _prompt(20)
    logits = runner(path).step({0: prompt}, all_logits=True)[0]
    torch.testing.assert_close(logits, reference(hf, prompt), atol=ATOL, rtol=0)


def test_dynamic_rope_decode_matches_transformers_cache(tiny, runner):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}
    path, hf = tiny("llama", max_position_embeddings=12, rope_parameters=rope)
    paged = runner(path)
    prompt = _prompt(10)
    cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt]), cache=cache).logits[0, -1]
    logits = paged.step({0: prompt})[0]
    for token in _prompt(6, seed=5):  # crosses the trained context at step 3
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        with torch.inference_mode():
            expected = hf(torch.tensor([[token]]), cache=cache).logits[0, -1]
        logits = paged.step({0: [token]})[0]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_tied_head_shares_the_embedding(tiny):
    path, _ = tiny("llama", tie_word_embeddings=True)
    model = load_model(path, torch.float32, "cpu")
    # No second plain copy: the head packed the embedding's tensor, or holds that tensor.
    dense = model.lm_head.linear.dense
    assert dense is None or dense.data_ptr() == model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.lm_head.weight, model.embed_tokens.weight)


def test_untied_head_reads_lm_head(tiny):
    path, hf = tiny("llama")
    model = load_model(path, torch.float32, "cpu")
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight)


def test_logits_only_for_requested_rows(tiny, runner, reference):
    path, hf = tiny("llama")
    paged = runner(path)
    prompt = _prompt(8)
    logits = paged.step({0: prompt})[0]
    assert logits.shape == (101,)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference(hf, prompt)[-1], atol=ATOL, rtol=0)


def test_cache_sizing_attributes(tiny):
    path, _ = tiny("llama", num_hidden_layers=3, num_key_value_heads=2)
    model = load_model(path, torch.float32, "cpu")
    assert isinstance(model, LlamaForCausalLM)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (3, 2, 12)
    cache = model.allocate_kv_cache(num_blocks=5, block_size=4)
    assert cache.key_caches[0].shape == (5, 4, 2, 12)


def test_bfloat16_runs_close_to_float32(tiny, runner, reference, kernels):
    path, hf = tiny("llama")
    prompt = _prompt(10)
    logits = runner(path, dtype=torch.bfloat16).step({0: prompt}, all_logits=True)[0]
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference(hf, prompt), atol=0.15, rtol=0.05)


def test_bfloat16_kernels_round_like_the_pytorch_references(tiny, runner, monkeypatch):
    from textgate.kernels import cpu_build

    path, _ = tiny("llama", num_hidden_layers=3)
    prompt = _prompt(20)

    def logits() -> torch.Tensor:
        paged = runner(path, dtype=torch.bfloat16)
        outputs = [paged.step({0: prompt}, all_logits=True)[0]]
        for _ in range(4):
            outputs.append(paged.step({0: [int(outputs[-1][-1].argmax())]}, all_logits=True)[0])
        return torch.cat(outputs)

    fused = logits()
    monkeypatch.setattr(cpu_build, "load_library", lambda: None)
    reference = logits()
    # Same rounding points; float summation order differs (norms, attention), so a few
    # logits land one bf16 step (0.0625 between 8 and 16) apart.
    torch.testing.assert_close(fused, reference, atol=0.13, rtol=0.01)
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


def test_builds_from_a_transformers_config_and_weights(tiny, reference):
    path, hf = tiny("qwen2")
    weights = Weights(path.glob("*.safetensors"), device="cpu", dtype=torch.float32)
    model = LlamaForCausalLM(hf.config, weights)
    prompt = _prompt(6)
    metadata = AttentionMetadata.build(
        query_lens=[6], context_lens=[0], block_tables=[[1, 0]], block_size=4
    )
    cache = model.allocate_kv_cache(num_blocks=2, block_size=4)
    with torch.inference_mode():
        logits = model(torch.tensor(prompt), metadata.positions(), cache, metadata, torch.arange(6))
    torch.testing.assert_close(logits, reference(hf, prompt), atol=ATOL, rtol=0)
