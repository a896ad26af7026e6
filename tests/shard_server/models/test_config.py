from __future__ import annotations

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

from textgate.shard_server.models import ModelConfig

BASE = {
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
}


def test_reads_transformers_config_objects():
    config = ModelConfig.parse(LlamaConfig(**BASE, num_key_value_heads=2, tie_word_embeddings=True))
    assert (config.model_type, config.num_kv_heads, config.head_dim) == ("llama", 2, 2)
    assert config.tie_word_embeddings
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias)
    assert config.sliding_windows == (None, None, None)
    assert ModelConfig.parse(config) is config


def test_defaults_kv_heads_and_head_dim():
    config = ModelConfig.from_dict({**BASE, "model_type": "llama"})
    assert (config.num_kv_heads, config.head_dim) == (4, 2)


def test_llama_attention_bias_covers_qkv_and_output():
    config = ModelConfig.from_dict({**BASE, "model_type": "llama", "attention_bias": True})
    assert config.qkv_bias and config.o_bias


def test_qwen2_has_qkv_bias_only():
    config = ModelConfig.parse(Qwen2Config(**BASE))
    assert config.qkv_bias and not config.o_bias


def test_qwen2_slides_from_max_window_layers_on():
    hf = Qwen2Config(**BASE, use_sliding_window=True, sliding_window=7, max_window_layers=1)
    assert ModelConfig.parse(hf).sliding_windows == (None, 7, 7)
    # Older config.json files have no layer_types.
    old = {**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 7}
    assert ModelConfig.from_dict({**old, "max_window_layers": 2}).sliding_windows == (None, None, 7)
    old_off = {**old, "use_sliding_window": False, "max_window_layers": 0}
    assert ModelConfig.from_dict(old_off).sliding_windows == (None, None, None)


def test_mistral_slides_on_every_layer_when_set():
    assert ModelConfig.parse(MistralConfig(**BASE, sliding_window=5)).sliding_windows == (5, 5, 5)
    assert ModelConfig.parse(MistralConfig(**BASE, sliding_window=None)).sliding_windows == (
        None,
        None,
        None,
    )


def test_phi3_stores_fused_projections_and_slides_on_every_layer():
    config = ModelConfig.parse(Phi3Config(**BASE, sliding_window=5, pad_token_id=0))
    assert config.fused_projections and config.sliding_windows == (5, 5, 5)
    assert not ModelConfig.parse(LlamaConfig(**BASE)).fused_projections


GEMMA = {**BASE, "num_hidden_layers": 7, "head_dim": 2, "sliding_window": 5}


def test_older_gemma_configs_alternate_as_transformers_does():
    gemma2 = ModelConfig.from_dict({**GEMMA, "model_type": "gemma2"})
    assert gemma2.sliding_windows == (5, None, 5, None, 5, None, 5)
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)
    assert gemma2.attention_scale == 256**-0.5 and gemma2.norm_offset == 1.0
    old = {**GEMMA, "model_type": "gemma3_text", "rope_local_base_freq": 500.0}
    gemma3 = ModelConfig.from_dict({**old, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma3.sliding_windows == (5, 5, 5, 5, 5, None, 5)
    assert (gemma3.rope.rope_type, gemma3.rope.theta) == ("linear", 1e6)
    assert gemma3.local_rope is not None and gemma3.local_rope.theta == 500.0


def test_gemma3_reads_rope_parameters_per_layer_type():
    hf = Gemma3TextConfig(**GEMMA, rope_parameters=None)
    config = ModelConfig.parse(hf)
    assert (
        config.sliding_windows
        == ModelConfig.from_dict({**hf.to_dict(), "layer_types": None}).sliding_windows
    )
    assert config.qk_norm and config.rope.theta == 1e6
    assert config.local_rope is not None and config.local_rope.theta == 1e4


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"sliding_window": 4, "layer_types": ["chunked_attention"] * 3}, "layer_types"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidirectional"),
        ({"model_type": "gemma2", "hidden_activation": "relu"}, "hidden_activation"),
    ],
)
def test_unsupported_settings_are_rejected(extra, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**BASE, **extra})
