from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary

from textgate.shard_server.layers.rotary import (
    RopeConfig,
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_signed,
    signed_sin,
)

HEAD_DIM = 16
SCALINGS = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5},
]


def _hf_config(rope: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=32,
        rope_parameters={**rope, "rope_theta": 1000.0},
    )


@pytest.mark.parametrize("rope", SCALINGS, ids=lambda rope: rope["rope_type"])
@pytest.mark.parametrize("length", [20, 50])
def test_cos_sin_match_transformers(rope, length):
    hf_config = _hf_config(rope)
    reference = LlamaRotaryEmbedding(hf_config)
    ours = RotaryEmbedding(RopeConfig.from_config(hf_config.to_dict()), HEAD_DIM)
    positions = torch.arange(length)
    x = torch.zeros(1, length, HEAD_DIM)
    cos_ref, sin_ref = reference(x, positions[None])
    cos, sin = ours.cos_sin(positions, torch.float32, torch.full((length,), length))
    torch.testing.assert_close(cos, cos_ref[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, sin_ref[0], atol=1e-6, rtol=0)


def test_dynamic_rescales_each_sequence_by_its_own_length():
    ours = RotaryEmbedding(RopeConfig.from_config(_hf_config(SCALINGS[2]).to_dict()), HEAD_DIM)
    positions = torch.tensor([10, 40])
    cos, _ = ours.cos_sin(positions, torch.float32, torch.tensor([11, 41]))
    short, _ = ours.cos_sin(positions[:1], torch.float32, torch.tensor([11]))
    long, _ = ours.cos_sin(positions[1:], torch.float32, torch.tensor([41]))
    torch.testing.assert_close(cos, torch.cat([short, long]))
    with pytest.raises(ValueError, match="sequence length"):
        ours.cos_sin(positions, torch.float32)


def _phi3_longrope(partial: float = 1.0, **rope: object) -> Phi3Config:
    half = int(HEAD_DIM * partial) // 2
    return Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        original_max_position_embeddings=32,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1000.0,
            "short_factor": [1.0 + 0.2 * i for i in range(half)],
            "long_factor": [1.0 + 2.0 * i for i in range(half)],
            "partial_rotary_factor": partial,
            **rope,
        },
    )


@pytest.mark.parametrize(
    "rope", [{}, {"factor": 2.0}, {"attention_factor": 0.9}, {"partial": 0.75}]
)
@pytest.mark.parametrize("length", [20, 32, 33, 50])
def test_longrope_matches_transformers_on_either_side_of_the_original_context(rope, length):
    hf_config = _phi3_longrope(**rope)
    reference = Phi3RotaryEmbedding(hf_config)
    ours = RotaryEmbedding(RopeConfig.from_config(hf_config.to_dict()), HEAD_DIM)
    positions = torch.arange(length)
    cos_ref, sin_ref = reference(torch.zeros(1, length, HEAD_DIM), positions[None])
    cos, sin = ours.cos_sin(positions, torch.float32, torch.full((length,), length))
    torch.testing.assert_close(cos, cos_ref[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, sin_ref[0], atol=1e-6, rtol=0)


def test_partial_rotary_rotates_the_leading_dims_as_phi3_does():
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, HEAD_DIM), torch.randn(7, 2, HEAD_DIM)
    ours = RotaryEmbedding(RopeConfig(theta=500.0, partial_rotary_factor=0.5), HEAD_DIM)
    cos, sin = ours.cos_sin(torch.arange(7), torch.float32)
    assert cos.shape == (7, HEAD_DIM // 2)
    q_ref, k_ref = phi3_apply_rotary(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    torch.testing.assert_close(apply_rotary(q, cos, sin), q_ref[0].transpose(0, 1))
    torch.testing.assert_close(
        apply_rotary_signed(k, cos, signed_sin(sin)), k_ref[0].transpose(0, 1)
    )


def test_longrope_picks_factors_per_sequence():
    ours = RotaryEmbedding(RopeConfig.from_config(_phi3_longrope().to_dict()), HEAD_DIM)
    assert ours.needs_seq_lens
    positions = torch.tensor([10, 10])
    cos, _ = ours.cos_sin(positions, torch.float32, torch.tensor([32, 33]))
    short, _ = ours.cos_sin(positions[:1], torch.float32, torch.tensor([12]))
    long, _ = ours.cos_sin(positions[1:], torch.float32, torch.tensor([40]))
    torch.testing.assert_close(cos, torch.cat([short, long]), atol=0, rtol=0)
    assert not torch.equal(short, long)
    with pytest.raises(ValueError, match="sequence length"):
        ours.cos_sin(positions, torch.float32)


def test_longrope_reads_phi3_configs():
    config = {
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,  # wins over the rope parameters' own
        "rope_scaling": {
            "type": "su",  # longrope's older name
            "original_max_position_embeddings": 2048,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
        },
    }
    cfg = RopeConfig.from_config(config)
    assert (cfg.rope_type, cfg.params["original_max_position_embeddings"]) == ("longrope", 4096)
    # Phi-3-mini-128k's scale: from 4096 to 131072 positions.
    expected = (1 + math.log(32) / math.log(4096)) ** 0.5
    assert RotaryEmbedding(cfg, HEAD_DIM).attention_scaling == pytest.approx(expected)
    del config["rope_scaling"]["long_factor"]
    with pytest.raises(ValueError, match="long_factor"):
        RotaryEmbedding(RopeConfig.from_config(config), HEAD_DIM)


def test_apply_rotary_matches_transformers():
    torch.manual_seed(0)
    q, k = torch.randn(7, 4, HEAD_DIM), torch.randn(7, 2, HEAD_DIM)
    ours = RotaryEmbedding(RopeConfig(theta=500.0), HEAD_DIM)
    cos, sin = ours.cos_sin(torch.arange(7), torch.float32)
    # transformers' layout is [batch, heads, seq, dim]
    q_ref, k_ref = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    torch.testing.assert_close(apply_rotary(q, cos, sin), q_ref[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), k_ref[0].transpose(0, 1))


def test_reads_transformers_4_spelling():
    old = {
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    assert RopeConfig.from_config(old) == RopeConfig("linear", 500000.0, 4096, {"factor": 2.0})


def test_reads_transformers_5_spelling():
    new = {
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0},
    }
    cfg = RopeConfig.from_config(new)
    assert (cfg.rope_type, cfg.theta) == ("llama3", 5e5)
    # Missing in older Llama 3 configs: the trained context is the config's own.
    assert cfg.params["original_max_position_embeddings"] == 4096


def test_defaults_without_rope_settings():
    assert RopeConfig.from_config({"max_position_embeddings": 128}) == RopeConfig(
        "default", 10000.0, 128, {}
    )


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "not supported"),
        ({"rope_parameters": {"rope_type": "default"}, "partial_rotary_factor": 1.5}, "partial"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer"),
    ],
)
def test_unsupported_settings_are_rejected(config, match):
    with pytest.raises(ValueError, match=match):
        RopeConfig.from_config(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_signed_sin_rotation_is_the_same_rotation(dtype):
    ours = RotaryEmbedding(RopeConfig(), 16)
    cos, sin = ours.cos_sin(torch.arange(5) * 7, dtype)
    x = torch.randn(5, 3, 16).to(dtype)
    assert torch.equal(apply_rotary_signed(x, cos, signed_sin(sin)), apply_rotary(x, cos, sin))
