from __future__ import annotations

import json

import torch

from textgate.bench.serving import roofline


def test_linear_shapes_read_from_safetensors_headers(tiny_model_dir) -> None:
    shapes = roofline.linear_shapes(tiny_model_dir)
    names = [s.name for s in shapes]
    # 2 layers × (q, k, v, o, gate, up, down), plus the tied lm_head; no embedding, no norms.
    assert len(shapes) == 2 * 7 + 1
    assert not any(n.split(".", 1)[-1] == "embed_tokens.weight" for n in names)
    assert not any("norm" in n for n in names)
    lm_head = next(s for s in shapes if "lm_head" in s.name)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert (lm_head.out_features, lm_head.in_features) == (config["vocab_size"], 32)
    q = next(s for s in shapes if s.name.endswith("layers.0.self_attn.q_proj.weight"))
    assert (q.out_features, q.in_features) == (32, 32)


def test_untied_lm_head_is_taken_as_is(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(10, 4),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4),
            "lm_head.weight": torch.zeros(10, 4),
            "model.norm.weight": torch.zeros(4),
        },
        str(tmp_path / "model.safetensors"),
    )
    shapes = roofline.linear_shapes(tmp_path)
    assert sorted((s.name, s.out_features, s.in_features) for s in shapes) == [
        ("lm_head.weight", 10, 4),
        ("model.layers.0.mlp.up_proj.weight", 8, 4),
    ]


def test_measure_reports_consistent_rows(tiny_model_dir) -> None:
    shapes = roofline.linear_shapes(tiny_model_dir)
    rows = roofline.measure(shapes, batches=(1, 4), dtypes=("float32", "bfloat16"), repeats=1)
    assert [(r.dtype, r.batch) for r in rows] == [
        ("float32", 1), ("float32", 4), ("bfloat16", 1), ("bfloat16", 4)
    ]  # fmt: skip
    params = sum(s.out_features * s.in_features for s in shapes)
    for r in rows:
        assert r.tok_per_s == r.batch * 1e3 / r.ms_per_step
        assert r.weight_gb == params * (4 if r.dtype == "float32" else 2) / 1e9


def test_main(tiny_model_dir, tmp_path, capsys) -> None:
    argv = ["--model", str(tiny_model_dir), "--batch", "1,2", "--dtype", "float32",
            "--repeats", "1", "--json-out", str(tmp_path / "roof.jsonl")]  # fmt: skip
    assert roofline.main(argv) == 0
    assert "ms/step" in capsys.readouterr().out
    lines = (tmp_path / "roof.jsonl").read_text().splitlines()
    assert [json.loads(line)["batch"] for line in lines] == [1, 2]
