"""bench/micro/step.py: a shard's prefill and decode step times, straight from PagedModel."""

from __future__ import annotations

import pytest

from textgate.bench.micro import step


def test_prints_prefill_and_decode_times_per_batch(tiny_model_dir, capsys) -> None:
    argv = ["--model", str(tiny_model_dir), "--batch", "1,3", "--prompt-len", "5", "--steps", "3"]
    assert step.main([*argv, "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "prompts of 5 tokens, 3 decode steps" in out
    rows = [line.split() for line in out.splitlines()[3:]]
    assert [row[0] for row in rows] == ["1", "3"]
    assert all(float(value) > 0 for row in rows for value in row[1:])


def test_times_a_quantized_model(tiny_model_dir, capsys) -> None:
    argv = ["--model", str(tiny_model_dir), "--batch", "2", "--prompt-len", "4", "--steps", "2"]
    assert step.main([*argv, "--dtype", "float32", "--quantize", "int8"]) == 0
    assert "float32, int8," in capsys.readouterr().out


def test_no_int4_expand_sends_every_chunk_to_the_int4_kernel(tiny_model_dir, monkeypatch) -> None:
    from textgate.kernels import int4_linear

    monkeypatch.setattr(int4_linear, "PROMPT_ROWS", int4_linear.PROMPT_ROWS)  # restored after
    argv = ["--model", str(tiny_model_dir), "--batch", "1", "--prompt-len", "4", "--steps", "1"]
    assert step.main([*argv, "--dtype", "float32", "--no-int4-expand"]) == 0
    assert int4_linear.PROMPT_ROWS > 1 << 40


def test_times_a_native_checkpoint_through_transformers_on_paged(tiny_model_dir, capsys) -> None:
    argv = ["--model", str(tiny_model_dir), "--batch", "2", "--prompt-len", "4", "--steps", "2"]
    assert step.main([*argv, "--dtype", "float32", "--transformers"]) == 0
    out = capsys.readouterr().out
    assert "transformers LlamaForCausalLM on the paged engine" in out


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_bench_times_base_and_adapters_in_one_run(tiny_model_dir, capsys) -> None:
    pytest.importorskip("peft")
    from textgate.bench.micro import lora

    argv = ["--model", str(tiny_model_dir), "--adapters", "2", "--rank", "4", "--batch", "4"]
    assert lora.main([*argv, "--prompt-len", "4", "--steps", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 adapters of rank 4 mixed evenly" in out and "ratio" in out
    assert "one adapter load + attach:" in out
