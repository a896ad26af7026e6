from __future__ import annotations

import json

import pytest
import torch

from textgate.quantization import UnsupportedQuantizationError
from textgate.shard_server.models import LlamaForCausalLM, UnsupportedModelError, load_model


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
