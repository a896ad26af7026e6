"""`--quantize bitsandbytes*`: the package's own layers, quantized at load, on a tiny llama."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from textgate.kernels import AttentionMetadata
from textgate.quantization.bitsandbytes import FourBitBnbWeight, Int8BnbWeight
from textgate.quantization.resident import resident_bytes
from textgate.shard_server.models import load_model

bnb = pytest.importorskip("bitsandbytes")


def _weight_and_input():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=generator) * 128**-0.5
    bias = torch.randn(96, generator=generator)
    x = torch.randn(2, 5, 128, generator=generator)
    return weight, bias, x


def test_llm_int8_layer_is_the_packages_and_close_to_float():
    weight, bias, x = _weight_and_input()
    layer = Int8BnbWeight(weight).get_linear(bias)
    assert isinstance(layer, bnb.nn.Linear8bitLt)
    assert layer.weight.dtype == torch.int8
    expected = F.linear(x, weight, bias)
    got = layer(x)
    assert got.shape == expected.shape
    assert (got - expected).norm() / expected.norm() < 0.02


@pytest.mark.parametrize(("quant_type", "tolerance"), [("nf4", 0.12), ("fp4", 0.15)])
def test_four_bit_layers_are_the_packages_and_close_to_float(quant_type, tolerance):
    weight, bias, x = _weight_and_input()
    layer = FourBitBnbWeight(weight, quant_type).get_linear(bias)
    assert isinstance(layer, bnb.nn.Linear4bit)
    assert layer.weight.quant_state.quant_type == quant_type
    expected = F.linear(x, weight, bias)
    got = layer(x)
    assert (got - expected).norm() / expected.norm() < tolerance
    # Two 4-bit values a byte, plus the block statistics.
    assert resident_bytes(layer) < weight.numel() // 2 + 96 * 4 + 2048


@pytest.mark.parametrize("method", ["bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"])
def test_tiny_llama_loads_and_tracks_the_float_model(tiny_model_dir, method):
    reference = load_model(tiny_model_dir, torch.float32, "cpu")
    model = load_model(tiny_model_dir, torch.float32, "cpu", quantize=method)
    assert model.quantize == method
    layer = model.layers[0].mlp.down_proj.linear
    assert isinstance(layer, bnb.nn.Linear8bitLt | bnb.nn.Linear4bit)
    metadata = AttentionMetadata.build(
        query_lens=[10], context_lens=[0], block_tables=[[0]], block_size=16
    )
    tokens, rows = torch.arange(5, 15), torch.arange(10)
    logits = []
    for m in (reference, model):
        cache = m.allocate_kv_cache(num_blocks=2, block_size=16)
        with torch.inference_mode():
            logits.append(m(tokens, metadata.positions(), cache, metadata, rows))
    expected, got = logits
    assert (got - expected).norm() / expected.norm() < 0.2
    assert resident_bytes(model) < resident_bytes(reference)


def test_device_check_names_what_the_package_supports():
    from textgate.quantization.bitsandbytes import Nf4BnbWeightsLoader

    Nf4BnbWeightsLoader.check_device(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"does not run on meta; it supports .*cpu"):
        Nf4BnbWeightsLoader.check_device(torch.device("meta"))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_layers_serve_in_eval_mode_and_stay_right_after_the_package_repacks(quant_type):
    # Eval mode selects bitsandbytes' fast CPU kernels; on AVX512-BF16 CPUs the first call
    # repacks the 4-bit weight in place. Every call, before and after, computes the weight
    # the package dequantizes to.
    weight, bias, x = _weight_and_input()
    layer = FourBitBnbWeight(weight.bfloat16(), quant_type).get_linear(bias.bfloat16())
    assert not layer.training
    stood_for = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    rows = x.reshape(-1, 128).bfloat16()
    big = torch.cat([rows] * 8)  # 80 rows first, then 1
    with torch.inference_mode():
        for inputs in (big, rows[:1], rows):
            want = F.linear(inputs.float(), stood_for.float(), bias.bfloat16().float())
            got = layer(inputs).float()
            assert (got - want).norm() / want.norm() < 0.01


def test_llm_int8_layers_serve_in_eval_mode():
    weight, bias, x = _weight_and_input()
    layer = Int8BnbWeight(weight).get_linear(bias)
    assert not layer.training
    with torch.inference_mode():
        got = layer(x)
    expected = F.linear(x, weight, bias)
    assert (got - expected).norm() / expected.norm() < 0.02


def test_four_bit_methods_ask_for_bf16_where_the_packages_cpu_kernel_runs(monkeypatch):
    from textgate.quantization import get_weights_loader

    for method in ("bitsandbytes-nf4", "bitsandbytes-fp4"):
        monkeypatch.setattr(bnb.functional, "has_avx512bf16", lambda: True)
        assert get_weights_loader(method).cpu_dtype() == torch.bfloat16
        monkeypatch.setattr(bnb.functional, "has_avx512bf16", lambda: False)
        assert get_weights_loader(method).cpu_dtype() is None  # measured instead
    assert get_weights_loader("bitsandbytes").cpu_dtype() is None
