"""bench/micro/lora.py: decode and prefill with adapters mixed against the base alone."""

from __future__ import annotations

import re

import pytest

from textgate.bench.micro import lora

# peft, saving the random adapters, asks transformers a question it has renamed.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)


def test_prints_both_sides_their_ratios_and_the_cost_of_a_load(
    tiny_model_dir, tmp_path, capsys
) -> None:
    argv = ["--model", str(tiny_model_dir), "--adapters", "2", "--rank", "4", "--batch", "4"]
    argv += ["--save-adapters", str(tmp_path)]
    assert lora.main([*argv, "--prompt-len", "5", "--steps", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "batch 4, 2 adapters of rank 4 mixed evenly" in out
    decode = re.search(r"decode tok/s: base ([\d.]+), with adapters ([\d.]+), ratio ([\d.]+)", out)
    prefill = re.search(
        r"prefill tok/s \(4 prompts of 5\): base ([\d.]+), with adapters ([\d.]+)", out
    )
    assert decode and prefill, out
    assert all(float(value) > 0 for value in (*decode.groups(), *prefill.groups()))
    assert len(re.findall(r"median of the rounds' ratios (\d+\.\d+)", out)) == 2, out
    assert re.search(r"one adapter load \+ attach: \d+ \+ \d+ ms", out)
    # Kept for a serving run: PEFT folders.
    for name in ("lora0", "lora1"):
        assert (tmp_path / name / "adapter_config.json").is_file()
        assert (tmp_path / name / "adapter_model.safetensors").is_file()
