"""bench/micro/attention.py: every backend timed on the same cases, relative to SDPA."""

from __future__ import annotations

from textgate.bench.micro import attention


def test_cases_cover_decode_batches_and_prompt_chunks() -> None:
    cases = attention.default_cases([1, 4], [10, 50], chunk=16)
    assert [(c.num_seqs, c.query_len, c.context_len) for c in cases] == [
        (1, 1, 10),
        (1, 1, 50),
        (4, 1, 10),
        (4, 1, 50),
        (1, 16, 0),
        (1, 16, 10),
        (1, 16, 50),
    ]


def test_shapes_come_from_the_model_config(tiny_model_dir) -> None:
    shape = attention.AttentionShape.from_config(tiny_model_dir)
    assert shape.num_heads % shape.num_kv_heads == 0 and shape.head_dim > 0


def test_prints_one_row_per_case_with_the_ratio_to_sdpa(tiny_model_dir, capsys) -> None:
    argv = ["--model", str(tiny_model_dir), "--batch", "2", "--context", "5", "--chunk", "4"]
    assert attention.main([*argv, "--repeats", "1", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "sdpa µs" in out and "cpu / sdpa" in out
    for case in ("decode B=2 C=5", "prefill Q=4 C=0", "prefill Q=4 C=5"):
        assert case in out
