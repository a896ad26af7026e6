from __future__ import annotations

import json

import pytest
import torch

from textgate.quantization import UnsupportedQuantizationError, registry
from textgate.quantization.unquantized import UnquantizedWeightsLoader
from textgate.shard_server.models import LlamaForCausalLM, UnsupportedModelError, load_model
from textgate.shard_server.models.loader import resolve_quantization


def test_loads_a_checkpoint_folder_in_the_requested_dtype(tiny):
    path, _ = tiny("llama")
    model = load_model(str(path), "bfloat16", "cpu")
    assert isinstance(model, LlamaForCausalLM)
    assert model.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.bfloat16


def test_unsupported_model_type(tiny):
    path, _ = tiny("llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError):
        load_model(path, torch.float32, "cpu")


def test_quantized_checkpoint_needs_a_registered_loader(tiny):
    path, _ = tiny("llama")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq-but-not-yet", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match="gptq-but-not-yet"):
        load_model(path, torch.float32, "cpu")


def test_missing_files_are_clear_errors(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(tmp_path, torch.float32, "cpu")
    path, _ = tiny("llama")
    for weights_file in path.glob("*.safetensors"):
        weights_file.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(path, torch.float32, "cpu")


class _QuantizedCheckpointLoader(UnquantizedWeightsLoader):
    """Stands in for a loader of pre-quantized checkpoints (GPTQ-like)."""

    reads_float_checkpoint = False

    @classmethod
    def from_config(cls, quantization_config):
        return cls()


def _set_quantization(path, quantization_config):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))


def test_the_checkpoint_names_the_method_when_quantize_is_unset(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._LOADERS, "gptq", _QuantizedCheckpointLoader)
    config = {"quantization_config": {"quant_method": "GPTQ", "bits": 4}}
    assert resolve_quantization(tmp_path, config, None) == ("gptq", config["quantization_config"])
    assert resolve_quantization(tmp_path, config, "gptq")[0] == "gptq"
    # AutoGPTQ's layout: quantize_config.json beside a config.json without the section.
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    method, quantization_config = resolve_quantization(tmp_path, {}, None)
    assert method == "gptq" and quantization_config["group_size"] == 128
    assert resolve_quantization(tmp_path / "elsewhere", {}, None) == (None, {})


def test_quantize_contradicting_a_quantized_checkpoint_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._LOADERS, "gptq", _QuantizedCheckpointLoader)
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(ValueError, match=r"--quantize int8 contradicts .* 'gptq'"):
        resolve_quantization(tmp_path, config, "int8")


def test_checkpoint_quantization_method_needs_float_weights(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._LOADERS, "fake-gptq", _QuantizedCheckpointLoader)
    with pytest.raises(ValueError, match="needs a checkpoint quantized with fake-gptq") as info:
        resolve_quantization(tmp_path, {}, "fake-gptq")
    assert "int8" in str(info.value)  # names what would work instead
    # A checkpoint saved already quantized by bitsandbytes: textgate quantizes at load only.
    saved = {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}
    with pytest.raises(UnsupportedQuantizationError, match="cannot load"):
        resolve_quantization(tmp_path, saved, None)


def test_quantize_on_a_float_checkpoint_and_a_device_check(tiny, monkeypatch):
    path, _ = tiny("llama")
    # int8 calibrates its smoothing on text at load (tests/quantization/test_int8.py loads a
    # checkpoint with a tokenizer); this one has none, which must be said, not guessed around.
    with pytest.raises(ValueError, match="needs the tokenizer"):
        load_model(path, torch.float32, "cpu", quantize="int8")
    assert (
        load_model(path, torch.float32, "cpu", quantize="bitsandbytes").quantize == "bitsandbytes"
    )
    assert load_model(path, torch.float32, "cpu").quantize is None

    class CudaOnly(UnquantizedWeightsLoader):
        @classmethod
        def check_device(cls, device):
            raise ValueError(f"cuda-only cannot run on {device.type}")

    monkeypatch.setitem(registry._LOADERS, "cuda-only", CudaOnly)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        load_model(path, torch.float32, "cpu", quantize="cuda-only")
    _set_quantization(path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="contradicts"):
        load_model(path, torch.float32, "cpu", quantize="bitsandbytes")
