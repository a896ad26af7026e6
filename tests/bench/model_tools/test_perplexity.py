"""The perplexity evaluator: the native shard model's score equals transformers' on the
same windows, and `--quantize` reaches the weights loader unchanged."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from textgate.bench.model_tools.perplexity import perplexity
from textgate.cli import main
from textgate.quantization.algorithms.calibration import evaluation_windows

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 8


def reference_perplexity(model_dir, window: int) -> float:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    windows = evaluation_windows(tokenizer, TEXT, window)
    with torch.inference_mode():
        logits = model(windows).logits[:, :-1]  # [n, window - 1, V]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    return math.exp(float(nll))


def test_native_perplexity_matches_transformers(tiny_model_dir):
    result = perplexity(tiny_model_dir, text=TEXT, window=16)
    assert result.perplexity == pytest.approx(reference_perplexity(tiny_model_dir, 16), rel=1e-4)
    windows = evaluation_windows(AutoTokenizer.from_pretrained(tiny_model_dir), TEXT, 16)
    assert result.num_tokens == windows.shape[0] * 15
    params = AutoModelForCausalLM.from_pretrained(tiny_model_dir).num_parameters()
    # Every fp32 weight is resident; oneDNN-packed copies and rotary tables add some more.
    assert 4 * params <= result.weight_bytes < 8 * params


def test_max_windows_limits_the_scored_tokens(tiny_model_dir):
    assert perplexity(tiny_model_dir, text=TEXT, window=16, max_windows=2).num_tokens == 30


def test_quantize_is_passed_to_the_weights_loader(tiny_model_dir):
    # gptq needs quantized tensors: the loader (not the evaluator) refuses a float checkpoint.
    with pytest.raises(ValueError, match="gptq"):
        perplexity(tiny_model_dir, quantize="gptq", text=TEXT, window=16)


def test_a_text_shorter_than_one_window_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity(tiny_model_dir, text="short", window=512)


def test_textgate_perplexity_command(tiny_model_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    with pytest.raises(SystemExit) as exit_info:
        main(["perplexity", "--text", str(text), "--window", "16", str(tiny_model_dir)])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("perplexity ")


def test_kv_cache_dtype_stores_the_cache_quantized(tiny_model_dir):
    auto = perplexity(tiny_model_dir, text=TEXT, window=16)
    int8 = perplexity(tiny_model_dir, text=TEXT, window=16, kv_cache_dtype="int8")
    assert (auto.kv_cache_dtype, int8.kv_cache_dtype) == ("float32", "int8")
    assert int8.kv_bytes_per_token < auto.kv_bytes_per_token / 2
    assert int8.perplexity != auto.perplexity
    assert int8.perplexity == pytest.approx(auto.perplexity, rel=0.02)
