"""`--quantize int8` on a tiny random llama: every linear and the head become Int8Linear."""

from __future__ import annotations

import json

import pytest
import torch

from textgate.kernels.int8_linear import Int8Linear
from textgate.kernels.linear import FastLinear
from textgate.quantization import get_weights_loader
from textgate.quantization.int8 import Int8WeightsLoader
from textgate.quantization.resident import resident_bytes
from textgate.quantization.smooth import ObservedLinear, alpha_for, smoothing_factors
from textgate.quantization.weights import Weights
from textgate.shard_server.models import load_model


@pytest.fixture
def checkpoint(tiny_model_dir):
    """tests/conftest.py's tiny llama (tied embeddings)."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def int8_model(tiny_model_dir):
    """The tiny llama loaded with --quantize int8 (calibrated at load), shared: loads cost."""
    return load_model(tiny_model_dir, torch.float32, "cpu", quantize="int8")


def _linears(model):
    return [m for m in model.modules() if isinstance(m, Int8Linear)]


def test_every_linear_and_the_tied_head_are_int8(int8_model):
    model = int8_model
    assert model.quantize == "int8"
    # 2 layers x (qkv, o, gate_up, down) + the head
    assert len(_linears(model)) == 2 * 4 + 1
    assert isinstance(model.lm_head.linear, Int8Linear)
    # The embedding stays in float: lookups need it.
    assert model.embed_tokens.weight.dtype == torch.float32


def test_logits_stay_close_to_the_float_model(checkpoint, int8_model):
    reference = load_model(checkpoint, torch.float32, "cpu")
    model = int8_model
    cache = {m: m.allocate_kv_cache(num_blocks=4, block_size=16) for m in (reference, model)}
    from textgate.kernels import AttentionMetadata

    metadata = AttentionMetadata.build(
        query_lens=[12], context_lens=[0], block_tables=[[1]], block_size=16
    )
    tokens = torch.arange(3, 15)
    rows = torch.arange(12)
    with torch.inference_mode():
        expected = reference(tokens, metadata.positions(), cache[reference], metadata, rows)
        got = model(tokens, metadata.positions(), cache[model], metadata, rows)
    assert (got - expected).norm() / expected.norm() < 0.05
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_int8_weights_take_about_a_quarter_of_float32(checkpoint, int8_model):
    reference = load_model(checkpoint, torch.float32, "cpu")
    model = int8_model
    linear_bytes = sum(resident_bytes(m) for m in _linears(model))
    float_bytes = sum(
        m.weight.numel() * 4 for m in reference.modules() if isinstance(m, FastLinear)
    )
    # 1 byte per weight, plus a few float32 terms per channel (scale, VNNI offset, smoothing
    # factor), which weigh more on the tiny model's 64-wide rows than on real ones.
    assert linear_bytes < 0.35 * float_bytes


def test_refuses_an_already_quantized_config():
    with pytest.raises(ValueError, match="already quantized"):
        Int8WeightsLoader.from_config({"quant_method": "gptq", "bits": 4})
    assert isinstance(get_weights_loader("int8"), Int8WeightsLoader)


def test_layers_are_smoothed_on_the_calibration_text(int8_model):
    assert not [m for m in int8_model.modules() if isinstance(m, ObservedLinear)]
    for layer in _linears(int8_model):
        assert layer.smooth is not None and layer.smooth.shape == (layer.in_features,)
        assert torch.isfinite(layer.smooth).all() and (layer.smooth > 0).all()
        # Not all ones: the factors follow what each layer saw.
        assert layer.smooth.std() > 0


def test_smoothing_factors_balance_activation_and_weight_ranges():
    input_max = torch.tensor([100.0, 1.0, 0.0])
    weight = torch.tensor([[1.0, 4.0, 2.0], [-1.0, 1.0, 0.5]])  # column maxima 1, 4, 2
    smooth = smoothing_factors(input_max, weight, alpha=0.5)
    # After smoothing, channel c's activation max and weight max are both sqrt(x_c * w_c).
    torch.testing.assert_close(input_max[:2] * smooth[:2], torch.tensor([10.0, 2.0]))
    torch.testing.assert_close(weight.abs().amax(0)[:2] / smooth[:2], torch.tensor([10.0, 2.0]))
    assert torch.isfinite(smooth).all()  # a silent channel is floored, not divided by 0


def test_down_projections_take_more_migration(checkpoint):
    assert alpha_for("model.layers.3.mlp.down_proj") == 0.65
    assert alpha_for("model.layers.3.self_attn.o_proj") == 0.5
    loader = Int8WeightsLoader()
    files = sorted(checkpoint.glob("*.safetensors"))
    weights = Weights(files, device="cpu", dtype=torch.float32, loader=loader)
    assert loader.get_weights_row(weights, "model.layers.0.mlp.down_proj").alpha == 0.65
    assert loader.get_weights_row(weights, "model.layers.0.self_attn.o_proj").alpha == 0.5


def test_head_is_quantized_only_by_methods_that_say_so(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["tie_word_embeddings"]
    model = load_model(checkpoint, torch.float32, "cpu", quantize="bitsandbytes-nf4")
    assert not isinstance(model.lm_head.linear, Int8Linear)
    assert model.lm_head.linear.__class__.__name__ == "FastLinear"
