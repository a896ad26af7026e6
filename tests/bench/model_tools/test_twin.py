"""bench/model_tools/twin.py: a model folder of the same shape and tokenizer, with random weights."""

from __future__ import annotations

import json
from pathlib import Path

from textgate.bench.model_tools.twin import TINY, copy_model_files, make_twin


def test_twin_keeps_the_tokenizer_and_shape_and_tiny_shrinks_only_the_layers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    copied = copy_model_files(tiny_model_dir, tmp_path / "files")
    assert "config.json" in copied and "tokenizer.json" in copied
    assert not list((tmp_path / "files").glob("*.safetensors"))
    source = json.loads((tiny_model_dir / "config.json").read_text())
    for tiny, name in ((False, "same"), (True, "tiny")):
        twin = make_twin(tiny_model_dir, tmp_path / name, tiny=tiny)
        config = json.loads((twin / "config.json").read_text())
        expected = {**source, **TINY} if tiny else source
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads"):
            assert config[key] == expected[key], key
        assert (twin / "tokenizer.json").read_bytes() == (
            tiny_model_dir / "tokenizer.json"
        ).read_bytes()
        model = AutoModelForCausalLM.from_pretrained(twin)
        assert model.config.num_hidden_layers == expected["num_hidden_layers"]
